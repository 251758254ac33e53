"""Pipeline parallelism side by side: funcpar ``Mesh(pp=2)`` (1F1B, interleaved) vs funcpar ``Mesh(dp=2)`` vs
DeepSpeed's pipe engine (``deepspeed.pipe.PipelineModule``, 2 stages), the same Llama, weights, batch and optimizer.

    .venv/bin/python benchmarks/pipeline_vs_deepspeed.py --quick     # a small model, a few steps: does it all run (~1-2 min)
    .venv/bin/python benchmarks/pipeline_vs_deepspeed.py             # hidden 512, 8 layers, seq 256, batch 16 (~10-15 min)
    .venv/bin/python benchmarks/pipeline_vs_deepspeed.py --runs fp-pp-1f1b,ds-pipe --repeats 3 --steps 20

(``pip install deepspeed`` into the environment that has funcpar; it is not a funcpar dependency.)

What runs. The driver (this script, plain ``python``) writes one transformers ``LlamaForCausalLM`` checkpoint
(``save_pretrained``, fp32, untied head) into a temporary folder, then launches every configuration as its own
``torchrun --standalone --nproc-per-node 2`` job of this same script (``--only KIND``), one after the other, with
``OMP_NUM_THREADS=1`` per rank, ``HF_HUB_OFFLINE=1`` and ``DS_ACCELERATOR=cpu``. The order of the jobs alternates
from repeat to repeat (A B C D, D C B A, ...) so that a drift in the machine's load hits every configuration alike.

    fp-pp-1f1b         funcpar Mesh(pp=2), pipeline="1f1b", zero=1 (a no-op at dp=1)
    fp-pp-interleaved  funcpar Mesh(pp=2), pipeline="interleaved", chunks=2 (needs layers >= 4)
    fp-dp              funcpar Mesh(dp=2), zero=1, each rank half of the global batch
    ds-pipe            DeepSpeed PipelineModule, 2 stages (gloo), dp=1, ZeRO stage 0 (the pipe engine refuses 2/3)
    ds-dp              (only with --runs) DeepSpeed ZeRO-1, dp=2: the data-parallel peer of fp-dp

Every configuration trains the same global batch (``--global-batch`` rows of ``--seq`` tokens, ``labels`` =
``input_ids``), cut into the same number of micro-batches (``--micro-batches``: funcpar's ``accum_steps``,
DeepSpeed's ``gradient_accumulation_steps``; DeepSpeed pipe: ``train_micro_batch_size_per_gpu`` = global batch /
micro-batches, ``train_batch_size`` = global batch), fp32, with AdamW(lr 1e-3, weight decay 0.01, torch's betas
and eps) and clipping of the global gradient norm at 1.0. Each job runs ``--warmup`` untimed steps, then
``--steps`` timed ones (rank 0's clock between a barrier before and one after each step: the slower rank's time).

The DeepSpeed pipeline is built from the checkpoint's transformers modules, one pipe layer per piece, each reading
only its own tensors from the safetensors file (``LayerSpec``, so a stage never holds the other stage's weights):
``embed_tokens`` | ``LlamaDecoderLayer`` x N (a wrapper computes the rotary cos/sin from positions 0..T-1 with
transformers' ``LlamaRotaryEmbedding``, so the only activation between stages is the hidden-state tensor; no
attention mask is passed: transformers' SDPA attention is then causal) | final ``LlamaRMSNorm`` + ``lm_head``,
with ``loss_fn`` transformers' shifted causal-LM loss (pad the labels with -100, shift by one, mean cross-entropy
over the tokens). ``partition_method="uniform"`` splits the N + 2 layers evenly (stage 0: embedding + the first N/2
blocks, stage 1: the rest + norm + head), DeepSpeed's best whole-layer split here ("parameters", its default, gives
the same: the embedding weighs as much as the head); funcpar's default cut weighs the head and, for Llama, may end a
stage between a layer's attention and its MLP. The pipe engine averages the
micro-batch losses; as every micro-batch has the same number of target tokens (no -100 labels in the data) that
is the global token mean, as transformers' loss of the whole batch and funcpar's token-weighted mean are.

Printed: one table, per configuration, of the median s/step over all timed steps of all repeats; each job's own
median with, in parentheses, the machine's 1-minute load average over the second half of that job (about 2 is this
benchmark alone; more means something else competed for the cores and that job's times are inflated: a warning is
printed, and the per-job medians of quiet jobs are the ones to compare); tokens/s (global batch tokens / median
s/step); the peak RSS of each rank in MB (``ru_maxrss``, the largest over the repeats); the first-step loss (the
loss of the initial weights on batch 0, so it must agree across implementations: a relative difference above
``--tol``, default 1e-4, is flagged MISMATCH); and for funcpar pp the measured bubble (``metrics["bubble"]``: the
share of rank-time spent waiting for the peer stage, the median over the timed steps). Then the losses of every
step of each configuration's first job, and one JSON line with everything. A benchmark, not a test: nothing is
asserted; a configuration that fails is reported with the tail of its stderr and the others still run.

DeepSpeed's gradient clipping under the pipe engine (0.19.8) is not by the global norm: ``clip_fp32_gradients``
calls ``deepspeed.runtime.utils.clip_grad_norm_`` with ``mpu`` = the pipe grid, which counts a parameter only on
model-parallel rank 0 (unless the parameter is marked ``model_parallel``), and the grid's model-parallel group spans
the pipeline stages: only stage 0's gradients enter the norm, and both stages are scaled by that. The first-step
loss is not affected (it precedes any update); the later losses drift slightly (Adam is nearly invariant to a
per-step gradient scale). The script prints, for the warm-up steps, the global gradient norm next to the norm the
clipping used (funcpar: ``metrics["grad_norm"]``, which is both), and how far the first step's norms of the
configurations are apart (they are the norm of the same gradient); ``--ds-global-clip`` replaces DeepSpeed's
clipping of ``ds-pipe`` by one over the global norm (the sum of squares all-reduced over the stages), after which
its losses follow funcpar's step for step.

DeepSpeed on CPU, notes (no workaround was needed with deepspeed 0.19.8 and torch 2.13).
``deepspeed.init_distributed(dist_backend="gloo")`` (the CPU accelerator would pick oneCCL if installed). The pipe
engine's point-to-point messages are blocking ``dist.send``/``dist.recv``, which gloo supports. Its ``train_batch``
returns the loss already averaged over the micro-batches and broadcast from the last stage to every rank.
``steps_per_print`` is set very large so that its logging does not run inside timed steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {
    "fp-pp-1f1b": "funcpar pp=2 1F1B",
    "fp-pp-interleaved": "funcpar pp=2 interleaved x2",
    "fp-dp": "funcpar dp=2 zero=1",
    "ds-pipe": "DeepSpeed pipe 2 stages",
    "ds-dp": "DeepSpeed dp=2 ZeRO-1",
}
DEFAULT_RUNS = ["fp-pp-1f1b", "fp-pp-interleaved", "fp-dp", "ds-pipe"]
LR, WD, CLIP = 1e-3, 0.01, 1.0
DATA_BATCHES = 4  # distinct global batches, cycled; batch 0 is the first step of every configuration


# --------------------------------------------------------------------------------------------- model & data


def hf_config(args) -> dict:
    heads = max(1, args.hidden // 64)
    inter = (args.hidden * 8 // 3 + 63) // 64 * 64
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=inter,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=max(2048, args.seq), rms_norm_eps=1e-6, tie_word_embeddings=False)


def global_batch(args, i: int):
    import torch

    g = torch.Generator().manual_seed(1000 + i % DATA_BATCHES)
    return torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=g)


def _read_prefix(folder: str, prefix: str) -> dict:
    """The tensors of the checkpoint in ``folder`` whose names start with ``prefix`` (the prefix removed)."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for k in f.keys():
                if k.startswith(prefix):
                    out[k[len(prefix):]] = f.get_tensor(k)
    return out


def _count_params(folder: str) -> int:
    from safetensors import safe_open

    n = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for k in f.keys():
                    shape = f.get_slice(k).get_shape()
                    n += math.prod(shape)
    return n


def _ds_layers():
    """The DeepSpeed pipe layers (classes built lazily: torch and transformers are imported by the workers only)."""
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers.models.llama import modeling_llama as ml

    def config(folder):
        cfg = transformers.LlamaConfig.from_pretrained(folder)
        cfg._attn_implementation = "sdpa"  # with no mask, transformers' SDPA attention is causal
        if cfg.tie_word_embeddings:
            raise SystemExit("this benchmark builds an untied head; the checkpoint ties it")
        return cfg

    def load(module, folder, prefix):
        missing, unexpected = module.load_state_dict(_read_prefix(folder, prefix), strict=False)
        missing = [m for m in missing if "inv_freq" not in m]
        if missing or unexpected:
            raise RuntimeError(f"{prefix}: missing {missing}, unexpected {unexpected}")

    class Embed(torch.nn.Module):
        def __init__(self, folder):
            super().__init__()
            cfg = config(folder)
            self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            load(self.embed_tokens, folder, "model.embed_tokens.")

        def forward(self, input_ids):
            return self.embed_tokens(input_ids)  # (B, T) -> (B, T, d)

    class Block(torch.nn.Module):
        def __init__(self, folder, i):
            super().__init__()
            cfg = config(folder)
            self.layer = ml.LlamaDecoderLayer(cfg, i)
            self.rotary = ml.LlamaRotaryEmbedding(cfg)
            load(self.layer, folder, f"model.layers.{i}.")

        def forward(self, x):
            pos = torch.arange(x.shape[1], device=x.device)[None]  # (1, T)
            return self.layer(x, position_embeddings=self.rotary(x, pos))  # (B, T, d) -> (B, T, d)

    class Head(torch.nn.Module):
        def __init__(self, folder):
            super().__init__()
            cfg = config(folder)
            self.norm = ml.LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            load(self.norm, folder, "model.norm.")
            load(self.lm_head, folder, "lm_head.")

        def forward(self, x):
            return self.lm_head(self.norm(x))  # (B, T, d) -> (B, T, V)

    def causal_lm_loss(logits, labels):
        """transformers' ForCausalLMLoss: labels padded with -100 and shifted; mean over the counted tokens."""
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100)

    return Embed, Block, Head, causal_lm_loss


# --------------------------------------------------------------------------------------------- one job


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(kind: str, args) -> None:
    """One configuration, under torchrun: build, warm up, time; rank 0 prints one JSON line."""
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit(f"this benchmark runs 2 ranks, got WORLD_SIZE={world}")
    A = args.micro_batches
    losses, bubbles, norms = [], [], []  # norms: the gradient norm of the first steps (what clipping used)

    if kind.startswith("fp-"):
        import funcpar as fp

        mesh = fp.Mesh(pp=2) if kind.startswith("fp-pp") else fp.Mesh(dp=2)
        model = fp.get_model("llama")
        params, cfg = fp.hf.load(args.weights, mesh=mesh)
        opts = {}
        if kind == "fp-pp-1f1b":
            opts = {"pipeline": "1f1b"}
        elif kind == "fp-pp-interleaved":
            opts = {"pipeline": "interleaved", "chunks": 2}
        step = fp.compile_step(model.loss_fn(cfg, mesh), model.specs(cfg, mesh), mesh=mesh,
                               optimizer=fp.optim.adamw(LR, weight_decay=WD), zero=1, accum_steps=A,
                               clip_norm=CLIP, **opts)
        box = {"state": step.init(params)}
        del params
        dp = mesh.axis_size("dp")

        def run(i):
            ids = global_batch(args, i)
            if dp > 1:
                ids = ids.chunk(dp)[mesh.coord("dp")]
            box["state"], m = step(box["state"], {"input_ids": ids, "labels": ids})
            if i < args.warmup:
                norms.append({"clip_norm_used": m["grad_norm"], "global_norm": m["grad_norm"]})
            return m["loss"], m.get("bubble")

    elif kind == "ds-pipe":
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule

        deepspeed.init_distributed(dist_backend="gloo")
        Embed, Block, Head, causal_lm_loss = _ds_layers()
        layers = ([LayerSpec(Embed, args.weights)] + [LayerSpec(Block, args.weights, i) for i in range(args.layers)]
                  + [LayerSpec(Head, args.weights)])
        module = PipelineModule(layers=layers, num_stages=2, loss_fn=causal_lm_loss, partition_method="uniform",
                                activation_checkpoint_interval=0)
        config = {
            "train_batch_size": args.global_batch,
            "train_micro_batch_size_per_gpu": args.global_batch // A,
            "gradient_accumulation_steps": A,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 0},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()],
                                          config=config)

        from deepspeed.runtime import engine as ds_engine

        def clip_and_record():  # engine.clip_fp32_gradients, plus the norms it sees (warm-up steps only)
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            sq = torch.stack([g.float().norm() ** 2 for g in grads]).sum().reshape(1)
            dist.all_reduce(sq)  # every stage's gradients: the global norm (dp=1: the world is the pipeline)
            used = clip_global() if args.ds_global_clip else ds_engine.clip_grad_norm_(
                parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)
            norms.append({"clip_norm_used": float(used), "global_norm": float(sq.sqrt())})

        def clip_global():  # --ds-global-clip: clip by the norm over every stage's gradients, as torch would
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            sq = torch.stack([g.float().norm() ** 2 for g in grads]).sum()
            dist.all_reduce(sq, group=engine.mpu.get_model_parallel_group())  # the stages of this pipeline
            norm = sq.sqrt()
            coef = torch.clamp(CLIP / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
            return norm

        def run(i):
            ids = global_batch(args, i)
            micro = iter([(x, x) for x in ids.chunk(A)])  # (inputs, labels) per micro-batch, in row order
            engine.__dict__.pop("clip_fp32_gradients", None)
            if args.ds_global_clip:
                engine.clip_fp32_gradients = clip_global
            if i < args.warmup:
                engine.clip_fp32_gradients = clip_and_record
            return engine.train_batch(data_iter=micro).item(), None

    elif kind == "ds-dp":
        import deepspeed
        import transformers

        deepspeed.init_distributed(dist_backend="gloo")
        model = transformers.LlamaForCausalLM.from_pretrained(args.weights, attn_implementation="sdpa")
        config = {
            "train_batch_size": args.global_batch,
            "train_micro_batch_size_per_gpu": args.global_batch // (2 * A),
            "gradient_accumulation_steps": A,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 1},
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def run(i):
            ids = global_batch(args, i).chunk(2)[rank]
            total = torch.zeros(())
            for x in ids.chunk(A):
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
                total += loss.detach()
            dist.all_reduce(total)  # the mean over micro-batches and ranks (equal token counts)
            if i < args.warmup:
                g = engine.get_global_grad_norm()
                norms.append({"clip_norm_used": float(g) if g is not None else float("nan"),
                              "global_norm": float(g) if g is not None else float("nan")})
            return total.item() / (2 * A), None

    else:
        raise SystemExit(f"unknown kind {kind!r}")

    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t = time.perf_counter()
        loss, bubble = run(i)
        dist.barrier()
        dt = time.perf_counter() - t
        losses.append(loss)
        if i >= args.warmup:
            times.append(dt)
            if bubble is not None:
                bubbles.append(bubble)
    peaks = [None] * world
    dist.all_gather_object(peaks, _peak_mb())
    if rank == 0:
        print("RESULT " + json.dumps({"kind": kind, "times": times, "losses": losses, "bubbles": bubbles,
                                      "rss_mb": peaks, "norms": norms}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- the driver


def launch(kind: str, args, env: dict) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.abspath(__file__), "--only", kind, "--weights", args.weights] + [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("hidden", "layers", "vocab", "seq", "global_batch", "micro_batches", "steps", "warmup")] + (
        ["--ds-global-clip"] if args.ds_global_clip else [])
    loads, done = [], threading.Event()

    def sample():  # the machine's 1-minute load average while the job runs (the job itself adds about 2)
        while not done.wait(2.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        return {"kind": kind, "error": f"timed out after {args.timeout} s\n{(e.stderr or b'')[-2000:]!s}"}
    finally:
        done.set()
        sampler.join()
    wall = time.perf_counter() - t
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"kind": kind, "error": f"exit {p.returncode}\n" + (p.stderr[-3000:] or p.stdout[-3000:])}
    out = json.loads(lines[-1][len("RESULT "):])
    out["wall_s"] = wall
    out["load"] = statistics.mean(loads[len(loads) // 2:]) if loads else os.getloadavg()[0]  # its second half
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model, a few steps, one repeat")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per job")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per job (the first gives the first loss)")
    ap.add_argument("--repeats", type=int, default=2, help="jobs per configuration, in alternating order")
    ap.add_argument("--runs", default=None, help=f"comma-separated, of {', '.join(KINDS)} "
                                                 f"(default {','.join(DEFAULT_RUNS)})")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative first-step loss difference flagged")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per job")
    ap.add_argument("--weights", help="an HF Llama folder to use (default: a fresh one in a temporary folder)")
    ap.add_argument("--ds-global-clip", action="store_true",
                    help="ds-pipe: clip by the norm over both stages' gradients instead of DeepSpeed's own clipping "
                         "(which counts stage 0's only; see the docstring)")
    ap.add_argument("--only", choices=sorted(KINDS), help=argparse.SUPPRESS)  # one job, here, under torchrun
    if ap.parse_known_args()[0].quick:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(hidden=128, layers=4, vocab=1024, seq=64, steps=3, warmup=1, repeats=1)
    args = ap.parse_args()
    if args.only:
        worker(args.only, args)
        return
    if args.global_batch % args.micro_batches:
        sys.exit(f"--global-batch {args.global_batch} must be a multiple of --micro-batches {args.micro_batches}")
    runs = (args.runs or ",".join(DEFAULT_RUNS)).split(",")
    for k in runs:
        if k not in KINDS:
            sys.exit(f"unknown run {k!r}; known: {', '.join(KINDS)}")
    notes = []
    if "fp-pp-interleaved" in runs and args.layers < 4:
        runs.remove("fp-pp-interleaved")
        notes.append(f"fp-pp-interleaved skipped: chunks=2 over pp=2 needs >= 4 layers, the model has {args.layers}")
    for k in ("fp-dp", "ds-dp"):
        if k in runs and args.global_batch % (2 * args.micro_batches):
            runs.remove(k)
            notes.append(f"{k} skipped: the global batch {args.global_batch} is not divisible by dp=2 x "
                         f"{args.micro_batches} micro-batches")
    created = args.weights is None
    if created:
        import torch
        import transformers

        args.weights = tempfile.mkdtemp(prefix="funcpar-pipe-bench-")
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(args))).save_pretrained(args.weights)
    n_params = _count_params(args.weights)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false"}
    tokens = args.global_batch * args.seq
    print(f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} ({n_params / 1e6:.1f}M params, fp32), "
          f"seq={args.seq}, global batch={args.global_batch} ({tokens} tokens), {args.micro_batches} micro-batches, "
          f"AdamW lr={LR} wd={WD}, clip {CLIP}; {args.warmup} warm-up + {args.steps} timed steps x {args.repeats} "
          f"repeats per configuration; 2 ranks, OMP_NUM_THREADS=1; weights {args.weights}"
          + (" (temporary)" if created else ""), flush=True)
    results: dict[str, list[dict]] = {k: [] for k in runs}
    for r in range(args.repeats):
        for kind in (runs if r % 2 == 0 else runs[::-1]):
            out = launch(kind, args, env)
            results[kind].append(out)
            if "error" in out:
                lines = out["error"].strip().splitlines()
                why = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1])
                print(f"  [{r + 1}/{args.repeats}] {kind}: FAILED ({why.strip()[:200]})", flush=True)
            else:
                print(f"  [{r + 1}/{args.repeats}] {kind}: median {statistics.median(out['times']):.3f} s/step, "
                      f"first loss {out['losses'][0]:.6f}, job {out['wall_s']:.0f} s, load {out['load']:.1f}",
                      flush=True)
    report(results, runs, args, tokens, notes)
    if created:
        shutil.rmtree(args.weights, ignore_errors=True)


def report(results: dict, runs: list[str], args, tokens: int, notes: list[str]) -> None:
    rows, firsts = [], {}
    for kind in runs:
        ok = [o for o in results[kind] if "error" not in o]
        row = {"kind": kind, "name": KINDS[kind], "jobs": len(results[kind]), "failed": len(results[kind]) - len(ok)}
        if ok:
            times = [t for o in ok for t in o["times"]]
            med = statistics.median(times)
            job_meds = [statistics.median(o["times"]) for o in ok]
            bubbles = [b for o in ok for b in o["bubbles"]]
            row |= {"s_per_step": med, "job_medians": job_meds, "job_loads": [o["load"] for o in ok],
                    "tokens_per_s": tokens / med,
                    "rss_mb": [max(o["rss_mb"][i] for o in ok) for i in range(len(ok[0]["rss_mb"]))],
                    "first_loss": ok[0]["losses"][0], "first_loss_repeats": [o["losses"][0] for o in ok],
                    "losses": ok[0]["losses"], "bubble": statistics.median(bubbles) if bubbles else None,
                    "warmup_grad_norms": ok[0].get("norms", [])}
            firsts[kind] = row["first_loss"]
        else:
            row["error"] = results[kind][0]["error"]
        rows.append(row)
    ref_kind = next(iter(firsts), None)
    ref = firsts.get(ref_kind)
    print()
    print(f"| configuration | s/step (median) | per-job medians (load) | tokens/s | peak RSS MB r0 / r1 | "
          f"first-step loss | rel. diff vs {ref_kind} | bubble |")
    print("|---|---|---|---|---|---|---|---|")
    mismatch = []
    for row in rows:
        if "error" in row:
            print(f"| {row['name']} | FAILED | | | | | | |")
            continue
        rel = abs(row["first_loss"] - ref) / abs(ref)
        spread = max(row["first_loss_repeats"]) - min(row["first_loss_repeats"])
        flag = ""
        if rel > args.tol or spread > args.tol * abs(ref):
            flag = " MISMATCH"
            mismatch.append(row["kind"])
        bubble = f"{row['bubble']:.1%}" if row["bubble"] is not None else "-"
        per_job = ", ".join(f"{m:.3f} ({x:.1f})" for m, x in zip(row["job_medians"], row["job_loads"]))
        print(f"| {row['name']} | {row['s_per_step']:.3f} | {per_job} | "
              f"{row['tokens_per_s']:.0f} | {' / '.join(f'{x:.0f}' for x in row['rss_mb'])} | "
              f"{row['first_loss']:.6f} | {rel:.1e}{flag} | {bubble} |")
    print()
    if len(firsts) > 1:
        vals = list(firsts.values())
        worst = (max(vals) - min(vals)) / abs(ref)
        verdict = (f"MISMATCH in {', '.join(mismatch)} (tolerance {args.tol:.0e} relative)" if mismatch
                   else f"all agree within {args.tol:.0e}")
        print(f"first-step losses: max relative spread {worst:.2e}: {verdict}")
        ref_losses = next(r["losses"] for r in rows if r["kind"] == ref_kind)
        later = [abs(a - b) / abs(b) for r in rows if "losses" in r for a, b in zip(r["losses"], ref_losses)]
        print(f"losses of every step (after the updates too) vs {ref_kind}: max relative difference {max(later):.2e} "
              "(informational: the same optimizer from the same state should keep them close)")
    for row in rows:
        if "losses" in row:
            print(f"  losses {row['kind']:<18} " + " ".join(f"{x:.4f}" for x in row["losses"]))
    print("gradient norm of the warm-up steps (before clipping at 1.0): global / the one clipping used")
    off = []
    for row in rows:
        if row.get("warmup_grad_norms"):
            print(f"  {row['kind']:<18} " + "  ".join(f"{n['global_norm']:.6f} / {n['clip_norm_used']:.6f}"
                                                    for n in row["warmup_grad_norms"]))
            if any(abs(n["clip_norm_used"] - n["global_norm"]) > 1e-4 * n["global_norm"]
                   for n in row["warmup_grad_norms"]):
                off.append(row["kind"])
    norms0 = {r["kind"]: r["warmup_grad_norms"][0]["global_norm"] for r in rows if r.get("warmup_grad_norms")}
    if len(norms0) > 1:
        mid = statistics.median(norms0.values())
        odd = {k: v / mid - 1 for k, v in norms0.items() if abs(v / mid - 1) > args.tol}
        spread = (max(norms0.values()) - min(norms0.values())) / mid
        print(f"first-step global gradient norms: max relative spread {spread:.2e}"
              + ("; off the median by more than the tolerance: "
                 + ", ".join(f"{k} {d:+.1e}" for k, d in odd.items()) if odd else ""))
    if off:
        print(f"note: {', '.join(off)} clipped by a norm other than the global one. For ds-pipe this is DeepSpeed's "
              "clip_grad_norm_ (runtime/utils.py) with mpu = the pipe grid: it counts a parameter only on "
              "model-parallel rank 0 unless the parameter is marked model-parallel, and the grid's model-parallel "
              "group spans the pipeline stages, so only stage 0's gradients enter the norm. The updates then differ "
              "(slightly: Adam is nearly invariant to a per-step gradient scale) and the later losses drift; "
              "--ds-global-clip clips ds-pipe by the global norm instead")
    for row in rows:
        if "error" in row:
            print(f"\n{row['kind']} failed:\n{row['error']}")
    cores = os.cpu_count() or 1
    busy = [(k, o["load"]) for k in runs for o in results[k] if "load" in o and o["load"] > max(2, cores) + 1]
    if busy:
        print(f"WARNING: the machine was busy during {len(busy)} job(s) (1-minute load average up to "
              f"{max(x for _, x in busy):.1f} on {cores} cores; the benchmark itself accounts for 2): their timings "
              "include waiting for the CPU; compare the per-job medians of quiet jobs, or rerun on an idle machine")
    for n in notes:
        print(f"note: {n}")
    print(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "only"}, "rows": rows}))


if __name__ == "__main__":
    main()
