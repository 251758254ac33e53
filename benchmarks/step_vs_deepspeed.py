"""Step time side by side: funcpar ``compile_step`` vs DeepSpeed, ZeRO-1, same model, batch and ranks, one run.

    pip install deepspeed            # into the environment that has funcpar (not a funcpar dependency)
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/step_vs_deepspeed.py
    torchrun --nproc-per-node 8 benchmarks/step_vs_deepspeed.py --hidden 2048 --layers 8 --seq 2048    # on GPUs

Both train the same Llama (transformers' for DeepSpeed, funcpar's for funcpar) from the same weights with AdamW
and clipping, data-parallel over every rank. Timed blocks alternate (funcpar, DeepSpeed, funcpar, ...) so that
load on the machine hits both alike; the first-step losses are compared as a sanity check. Prints one JSON line.
"""

import argparse
import functools
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import funcpar as fp
from funcpar.models import llama

ap = argparse.ArgumentParser()
ap.add_argument("--hidden", type=int, default=256)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--vocab", type=int, default=512)
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--global-batch", type=int, default=16)
ap.add_argument("--steps", type=int, default=8, help="timed steps per block")
ap.add_argument("--blocks", type=int, default=3)
ap.add_argument("--compile", action="store_true", help="funcpar: torch.compile the gradient function")
args = ap.parse_args()

mesh = fp.Mesh(dp=int(os.environ.get("WORLD_SIZE", "1")))
dp, rank = mesh.axis_size("dp"), mesh.rank
heads = max(1, args.hidden // 64)
cfg = llama.Config.from_hf(dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                                model_type="llama"))
params = llama.init(cfg, seed=0)
g = torch.Generator().manual_seed(0)
data = [torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=g) for _ in range(4)]


def local(i):
    return data[i % len(data)].chunk(dp)[mesh.coord("dp")].to(mesh.device)


def timed(fn, n, offset):
    out = []
    for i in range(n):
        dist.barrier()
        t = time.perf_counter()
        fn(offset + i)
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        out.append(time.perf_counter() - t)
    return out


# ------------------------------------------------------------------------------------------------- funcpar
specs = llama.specs(cfg, mesh)
step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), specs, mesh=mesh,
                       optimizer=fp.optim.adamw(1e-4), zero=1, clip_norm=1.0, compile=args.compile)
fstate = {"s": step.init(fp.shard(params, specs, mesh))}
first = {}


def fp_step(i):
    fstate["s"], m = step(fstate["s"], {"input_ids": local(i)})
    first.setdefault("funcpar", m["loss"])


# ----------------------------------------------------------------------------------------------- DeepSpeed
import deepspeed  # noqa: E402
import transformers  # noqa: E402

folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fp-bench-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
if rank == 0:
    fp.hf.save(folder, params, llama, cfg)
dist.barrier()
model = transformers.AutoModelForCausalLM.from_pretrained(folder).to(mesh.device)
ds_config = {
    "train_batch_size": args.global_batch,
    "train_micro_batch_size_per_gpu": args.global_batch // dp,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
    "gradient_clipping": 1.0,
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)


def ds_step(i):
    ids = local(i)
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    if "deepspeed" not in first:  # DeepSpeed reports this rank's loss: average over dp, as funcpar does
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        first["deepspeed"] = loss.item() / dp


# ---------------------------------------------------------------------------------------------------- run
times = {"funcpar": [], "deepspeed": []}
offset = 0
timed(fp_step, 2, 0)  # warm-up
timed(ds_step, 2, 0)
for _ in range(args.blocks):
    times["funcpar"] += timed(fp_step, args.steps, offset)
    times["deepspeed"] += timed(ds_step, args.steps, offset)
    offset += args.steps
if rank == 0:
    f, d = statistics.median(times["funcpar"]), statistics.median(times["deepspeed"])
    print(json.dumps({
        "mesh": repr(mesh), "device": mesh.device.type, "params": sum(x.numel() for x in params_list)
        if (params_list := [x for _, x in fp.tree.leaves_with_path(params)]) else 0,
        "global_batch": args.global_batch, "seq": args.seq, "compile": args.compile,
        "funcpar_s": round(f, 4), "deepspeed_s": round(d, 4), "ratio_funcpar_over_deepspeed": round(f / d, 3),
        "first_loss": {k: round(v, 6) for k, v in first.items()},
    }), flush=True)
dist.destroy_process_group()
