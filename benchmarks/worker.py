"""One implementation on one mesh, as one torchrun job (``benchmarks/run.py`` launches it):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/worker.py --mesh dp2 --impl ds-zero1 --size small --weights FOLDER --warmup 2 --steps 4

``--device`` (default ``auto``: CUDA wherever torch sees it) picks where every implementation runs: ``cuda`` puts
rank r on ``cuda:$LOCAL_RANK`` with NCCL (DeepSpeed's accelerator ``cuda``), ``cpu`` on host tensors with gloo
(``DS_ACCELERATOR=cpu``); the models, batches and optimizer state live there, nothing else differs.

Every implementation starts from the transformers checkpoint in ``--weights`` (funcpar through ``fp.hf.load``, the
peers through ``LlamaForCausalLM.from_pretrained``), trains on the same global batches (``common.global_batch``:
``labels`` = ``input_ids``, each dp rank its rows, every tp rank of a group the same rows) with AdamW and clipping of
the global gradient norm (``common.LR, WD, CLIP``), fp32. Each step is timed on rank 0 between a barrier before
and one after it (so the slowest rank's time). Rank 0 prints one line ``RESULT {json}``: the step times after the
warm-up, every step's loss (the global batch's token mean), each rank's peak RSS (``ru_maxrss``; on CUDA also
``gpu_mb``, its peak of allocated device memory, ``torch.cuda.max_memory_allocated``) and, for funcpar
where its mesh counts them (``mesh.traffic``), the bytes each rank sent per timed step by axis. A failure
prints ``ERROR {json}`` (the exception, one line) on the rank where it happened and exits 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common as C  # noqa: E402


def setup_device(args) -> None:
    """``args.device`` resolved ("cuda" | "cpu"), ``args.dev`` this rank's torch.device (made current on CUDA) and
    DeepSpeed's accelerator chosen to match (``DS_ACCELERATOR``, unless set)."""
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device on this machine")
        args.dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(args.dev)
    else:
        args.dev = torch.device("cpu")
    os.environ.setdefault("DS_ACCELERATOR", args.device)


def _mean_over_world(loss, world: int) -> float:
    """The global batch's mean loss from each rank's local mean (equal token counts on every dp rank; the ranks of
    a tp group hold the same value)."""
    import torch
    import torch.distributed as dist

    t = loss.detach().clone().reshape(1).to(torch.float64)
    if world > 1:
        dist.all_reduce(t)
    return t.item() / world


def build_funcpar(args, size, rank, world, lora: bool = False, generic: bool = False):
    """funcpar's step on the weights; with ``lora``, adapters ``common.LORA`` on the base frozen
    (``--impl funcpar-lora``, for benchmarks/lora.py); with ``generic``, transformers' own Llama through the generic
    path instead of the built-in model (``--impl funcpar-generic``)."""
    import torch

    import funcpar as fp

    mesh = fp.Mesh(device=args.dev, **C.MESHES[args.mesh]["axes"])
    model = fp.get_model("llama", generic=generic)
    params, cfg = fp.hf.load(args.weights, model, mesh)
    loss, specs, init = model.loss_fn(cfg, mesh), model.specs(cfg, mesh), params
    if lora:
        adapters = fp.lora.Lora(model, cfg, fp.lora.LoraConfig.parse(C.LORA), mesh)
        loss, specs, init = adapters.loss_fn(loss, params), adapters.specs(), adapters.init(seed=0, device=args.dev)
    pipe = C.pipeline(args.mesh)  # ({} off a pipeline mesh)
    dtype = {"fp32": None, "bf16": torch.bfloat16}[getattr(args, "precision", "fp32")]  # bf16: fp32 masters in the optimizer state
    step = fp.compile_step(loss, specs, mesh=mesh, optimizer=fp.optim.adamw(C.LR, weight_decay=C.WD), zero=1,
                           clip_norm=C.CLIP, accum_steps=C.micro_batches(args.mesh), param_dtype=dtype,
                           compile=C.COMPILE[getattr(args, "compile", "auto")], **pipe)
    box = {"state": step.init(init)}
    del params, init

    def run(i):
        ids = C.local_rows(C.global_batch(size, i), args.mesh, mesh.rank).to(args.dev)
        box["state"], m = step(box["state"], {"input_ids": ids, "labels": ids})
        return float(m["loss"])

    run.step = step  # (benchmarks/profile_step.py marks its phases)
    if isinstance(getattr(mesh, "traffic", None), dict):  # bytes sent by axis, counted by funcpar's collectives
        run.traffic = lambda: dict(mesh.traffic)
    return run


def _hf_model(args):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(args.weights, attn_implementation="sdpa")
    return model.float().to(args.dev).train()


def build_hf_eager(args, size, rank, world):
    import torch

    model = _hf_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=C.LR, weight_decay=C.WD)

    amp = torch.autocast(args.dev.type, dtype=torch.bfloat16, enabled=getattr(args, "precision", "fp32") == "bf16")

    def run(i):
        ids = C.global_batch(size, i).to(args.dev)
        with amp:  # bf16: the forward's matmuls in bf16, the parameters and their gradients fp32 (torch AMP)
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), C.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    run.model, run.optimizer = model, opt  # (benchmarks/profile_step.py marks their phases)
    return run


def build_deepspeed(args, size, rank, world):
    import deepspeed

    deepspeed.init_distributed(dist_backend=C.backend(args.device))
    tp = C.axis(args.mesh, "tp")
    dp = world // tp
    zero = {"ds-zero1": 1, "ds-zero2": 2, "ds-autotp": 0, "ds-autotp-zero1": 1}[args.impl]
    config = {  # no train_batch_size: with AutoTP DeepSpeed checks it against every rank, tp ones included
        "train_micro_batch_size_per_gpu": size["global_batch"] // dp,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": C.LR, "weight_decay": C.WD, "torch_adam": True}},
        "gradient_clipping": C.CLIP,
        "zero_optimization": {"stage": zero},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    model = _hf_model(args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def run(i):
        ids = C.local_rows(C.global_batch(size, i), args.mesh, rank).to(args.dev)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return _mean_over_world(loss, world)

    return run


def build_ds_pipe(args, size, rank, world):
    """DeepSpeed's pipe engine, 2 stages: the checkpoint's transformers modules as pipe layers (embedding | decoder
    layers | norm + head, split uniformly, each stage reading only its tensors; benchmarks/pipeline_vs_deepspeed.py's
    ``_ds_layers``), the same micro-batches as funcpar's schedule, ZeRO stage 0 (the pipe engine refuses 2/3).
    Clipped by the global norm over both stages, as every other implementation here (the engine's own clipping is
    per stage)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from pipeline_vs_deepspeed import _ds_layers

    deepspeed.init_distributed(dist_backend=C.backend(args.device))
    Embed, Block, Head, causal_lm_loss = _ds_layers()
    layers = ([LayerSpec(Embed, args.weights)] + [LayerSpec(Block, args.weights, i) for i in range(size["layers"])]
              + [LayerSpec(Head, args.weights)])
    module = PipelineModule(layers=layers, num_stages=world, loss_fn=causal_lm_loss, partition_method="uniform",
                            activation_checkpoint_interval=0)
    A = C.micro_batches(args.mesh)
    config = {"train_batch_size": size["global_batch"], "train_micro_batch_size_per_gpu": size["global_batch"] // A,
              "gradient_accumulation_steps": A,
              "optimizer": {"type": "AdamW", "params": {"lr": C.LR, "weight_decay": C.WD, "torch_adam": True}},
              "gradient_clipping": C.CLIP, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
              "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)

    def clip_global():  # the norm over every stage's gradients, one all-reduce
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        sq = torch.stack([g.double().pow(2).sum() for g in grads]).sum()
        dist.all_reduce(sq, group=engine.mpu.get_model_parallel_group())  # the stages of this pipeline
        torch._foreach_mul_(grads, min(1.0, C.CLIP / (sq.sqrt().item() + 1e-6)))
        return sq.sqrt()

    engine.clip_fp32_gradients = clip_global

    def run(i):
        ids = C.global_batch(size, i).to(args.dev)
        return float(engine.train_batch(data_iter=iter([(x, x) for x in ids.chunk(A)])))  # the micro-batches' mean

    return run


def _clip_global(params, world: int) -> None:
    """torch.nn.utils.clip_grad_norm_ over a model whose gradients mix DTensors (TP shards, FSDP2 shards, both) and
    plain tensors (replicated leaves): each element counted once, whatever its placement, one all-reduce."""
    import math

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads, sq = [], None
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):  # an element lives on world / (number of shards) ranks
            shards = math.prod(g.device_mesh.size(d) for d, pl in enumerate(g.placements) if pl.is_shard())
            g = g.to_local()
        else:
            shards = 1
        grads.append(g)
        part = g.double().pow(2).sum() * shards / world
        sq = part if sq is None else sq + part
    if world > 1:
        dist.all_reduce(sq)
    coef = min(1.0, C.CLIP / (sq.sqrt().item() + 1e-6))
    torch._foreach_mul_(grads, coef)


def _tensor_parallel(model, tp_mesh) -> None:
    """Megatron's layout with torch's parallelize_module: q/k/v, gate/up column-parallel, o/down row-parallel; the
    embedding split over the vocabulary and the head's logits left sharded over it (loss_parallel), as funcpar's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan |= {p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                 p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                 p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                 p + "mlp.down_proj": RowwiseParallel()}
    parallelize_module(model, tp_mesh, plan)


def build_torch(args, size, rank, world):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(C.backend(args.device))
    tp, dp = C.axis(args.mesh, "tp"), C.axis(args.mesh, "dp")
    dmesh = init_device_mesh(args.device, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _hf_model(args)
    if tp > 1:
        _tensor_parallel(model, dmesh["tp"])
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=dmesh["dp"])
        fully_shard(model, mesh=dmesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=C.LR, weight_decay=C.WD)

    def loss_of(ids):
        if tp == 1:  # transformers' own loss; FSDP2 averages the gradients over dp
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():  # cross-entropy over logits sharded by vocabulary; the shift as transformers does it
            logits = model(input_ids=ids).logits  # (B, T, V) DTensor, Shard(-1) over tp
            labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            loss.backward()
        return loss.full_tensor()

    def run(i):
        ids = C.local_rows(C.global_batch(size, i), args.mesh, rank).to(args.dev)
        loss = loss_of(ids)
        _clip_global(model.parameters(), world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return _mean_over_world(loss, world)

    return run


BUILDERS = {"funcpar": build_funcpar, "funcpar-lora": functools.partial(build_funcpar, lora=True),
            "funcpar-generic": functools.partial(build_funcpar, generic=True),
            "hf-eager": build_hf_eager, "ds-zero1": build_deepspeed,
            "ds-zero2": build_deepspeed, "ds-autotp": build_deepspeed, "ds-autotp-zero1": build_deepspeed,
            "torch-fsdp2": build_torch, "torch-tp": build_torch, "torch-tp-fsdp2": build_torch,
            "ds-pipe": build_ds_pipe}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _sync(args):
    """Waits for this rank's device work (CUDA kernels run after the host returns), so that a step's clock stops
    when its work is done; nothing on host tensors."""
    import torch

    return (lambda: torch.cuda.synchronize(args.dev)) if args.dev.type == "cuda" else (lambda: None)


def measure(args, rank: int, world: int) -> dict:
    import torch.distributed as dist

    size = C.SIZES[args.size]
    run = BUILDERS[args.impl](args, size, rank, world)
    sync, wait = _sync(args), dist.barrier if world > 1 else (lambda: None)

    def barrier():
        sync()
        wait()

    counter = getattr(run, "traffic", None)
    times, losses, before = [], [], {}
    for i in range(args.warmup + args.steps):
        if i == args.warmup and counter:
            before = counter()
        barrier()
        t = time.perf_counter()
        losses.append(run(i))
        barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    mine = {"rss_mb": _peak_mb()}
    if args.dev.type == "cuda":
        import torch

        mine["gpu_mb"] = torch.cuda.max_memory_allocated(args.dev) / 2**20
    if counter:  # bytes this rank sent per timed step, by axis
        mine["traffic"] = {a: (n - before.get(a, 0)) / args.steps for a, n in counter().items()}
    ranks = [mine]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    out = {"mesh": args.mesh, "impl": args.impl, "size": args.size, "times": times, "losses": losses,
           "rss_mb": [r["rss_mb"] for r in ranks], "world": world}
    if "gpu_mb" in mine:
        out["gpu_mb"] = [r["gpu_mb"] for r in ranks]
    if counter:
        out["traffic"] = [r["traffic"] for r in ranks]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="one benchmark job (under torchrun)")
    ap.add_argument("--mesh", required=True, choices=sorted(C.MESHES))
    ap.add_argument("--impl", required=True, choices=sorted(BUILDERS))
    ap.add_argument("--size", required=True, choices=sorted(C.SIZES))
    ap.add_argument("--weights", required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="auto", choices=C.DEVICES)
    ap.add_argument("--precision", default="fp32", choices=C.PRECISIONS)
    ap.add_argument("--compile", default="auto", choices=sorted(C.COMPILE), help="funcpar: compile_step's compile=")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    import torch

    torch.set_num_threads(C.MESHES[args.mesh]["threads"])
    try:
        setup_device(args)
        short = C.precision_short(args.impl, args.precision)
        if short:
            raise SystemExit(short)
        if world != C.MESHES[args.mesh]["nproc"]:
            raise SystemExit(f"mesh {args.mesh} runs {C.MESHES[args.mesh]['nproc']} ranks, got WORLD_SIZE={world}")
        out = measure(args, rank, world)
    except BaseException as e:  # noqa: BLE001 -- one line for the runner's table, the traceback on stderr
        msg = str(e).strip().splitlines()
        print("ERROR " + json.dumps({"rank": rank, "error": f"{type(e).__name__}: {msg[0] if msg else ''}"[:400]}),
              flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if world > 1 and args.impl != "funcpar":  # funcpar's Mesh tears its groups down at exit itself
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
