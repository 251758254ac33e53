"""Long sequences: activation memory and step time per rank for tp=2 with and without sequence parallelism, and for
context parallelism on cp=1/2/4, with the plan's prediction beside each measurement.

    python benchmarks/long_sequences.py                          # seq 4096 and 8192 measured, 16384 planned
    python benchmarks/long_sequences.py --seqs 4096 --measure 4096
    python benchmarks/long_sequences.py --seqs 16384 --measure 16384 --steps 1 --longest 22   # and the longest that fits

The model is the benchmarks' small Llama (hidden 512, 4 layers, 8 heads / 4 kv heads, vocab 4096), one row per step,
AdamW, float32, on the CPU. Each measured configuration runs in fresh processes under torchrun (one per rank), two
steps after one warm-up step, with ``MALLOC_MMAP_THRESHOLD_=131072`` so that the resident peak follows what is live;
it reports the largest rank's peak resident set (``ru_maxrss``) and its fastest timed step (``--steps`` of them, after
one warm-up step). The plan traces the same step on meta tensors (:func:`funcpar.cli.planning.trace_step`): activations
of a micro-batch and the step's peak, per rank. ``--longest GiB`` adds, per configuration, the longest sequence (a
multiple of 1024) whose planned peak plus the runtime, times the ranks on this one machine, fits in GiB. A benchmark,
not a test: nothing is asserted. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # name: (mesh axes, sequence_parallel, cp layout)
    "tp=2": ({"tp": 2}, False, "zigzag"), "tp=2 + SP": ({"tp": 2}, True, "zigzag"),
    "cp=1": ({}, False, "zigzag"), "cp=2": ({"cp": 2}, False, "zigzag"), "cp=4": ({"cp": 4}, False, "zigzag"),
    "cp=2 contiguous": ({"cp": 2}, False, "contiguous"), "cp=4 contiguous": ({"cp": 4}, False, "contiguous"),
}
SMALL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)


def _build(mesh, seq: int, sp: bool, layout: str):
    import funcpar as fp
    from funcpar.models import llama

    mesh = mesh.with_context_layout(layout)
    cfg = llama.Config(**SMALL, max_position_embeddings=max(seq, 2048), sliding_windows=(None,) * 4).with_mesh(mesh)
    data_axes = ("dp", "cp") if "cp" in mesh.axis_names else ("dp",)
    step = fp.compile_step(llama.MODEL.loss_fn(cfg, mesh, sequence_parallel=sp), llama.specs(cfg, mesh), mesh=mesh,
                           optimizer=fp.optim.adamw(1e-4), data_axes=data_axes, check=False)
    return step, cfg


def plan(axes: dict, sp: bool, layout: str, seq: int) -> dict:
    import funcpar as fp
    from funcpar.models import llama
    from funcpar.cli.planning import local_params, trace_step
    import torch

    mesh = fp.Mesh.abstract(device="cpu", **axes)
    step, cfg = _build(mesh, seq, sp, layout)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    r = trace_step(step, local_params(llama.init(cfg, device="meta"), step.specs, mesh), {"input_ids": ids})
    return {"activations": r["activations"], "peak": r["step_peak"]}


def worker(seq: int, sp: bool, layout: str, axes: dict, steps: int, out: str) -> None:
    """One rank of a measured configuration (under torchrun): 1 warm-up step, ``steps`` timed; writes a JSON file
    in ``out``."""
    import funcpar as fp
    from funcpar.models import llama
    import torch

    mesh = fp.Mesh(device="cpu", **axes)
    step, cfg = _build(mesh, seq, sp, layout)
    state = step.init(fp.shard(llama.init(cfg, seed=0), step.specs, mesh))
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    times = []
    for k in range(1 + steps):
        t0 = time.perf_counter()
        state, m = step(state, {"input_ids": ids})
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(out, f"rank{mesh.rank}.json"), "w") as f:
        json.dump({"rank": mesh.rank, "peak": peak, "s_per_step": sorted(times[1:])[0], "loss": m["loss"]}, f)


def measure(axes: dict, sp: bool, layout: str, seq: int, steps: int, timeout: float) -> dict | None:
    import tempfile

    n = _ranks(axes)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    with tempfile.TemporaryDirectory() as out:
        spec = json.dumps({"seq": seq, "sp": sp, "layout": layout, "axes": axes, "steps": steps, "out": out})
        launch = [sys.executable] + (["-m", "torch.distributed.run", "--nproc-per-node", str(n)] if n > 1 else [])
        try:
            p = subprocess.run([*launch, os.path.abspath(__file__), "--worker", spec], env=env, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        rows = [json.load(open(os.path.join(out, f))) for f in os.listdir(out)]
    if p.returncode or len(rows) != n:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:80]}
    return {"peak": max(r["peak"] for r in rows), "s_per_step": max(r["s_per_step"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--measure", default="4096,8192", help="the sequence lengths also run for real")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--longest", type=float, help="GiB of this machine: the longest sequence each configuration fits")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which of them, by name")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        w = json.loads(args.worker)
        return worker(w["seq"], w["sp"], w["layout"], w["axes"], w["steps"], w["out"])
    configs = {n: CONFIGS[n] for n in args.configs.split(",")}
    measured = {int(s) for s in args.measure.split(",") if s}
    gib = 2.0**30
    print("| seq | mesh | planned activations / rank | planned step peak / rank | measured peak RSS / rank "
          "| s/step |\n|---|---|---|---|---|---|")
    for seq in (int(s) for s in args.seqs.split(",")):
        for name, (axes, sp, layout) in configs.items():
            p = plan(axes, sp, layout, seq)
            m = measure(axes, sp, layout, seq, args.steps, args.timeout) if seq in measured else None
            got = ("not run" if m is None else m["error"] if "error" in m else f"{m['peak'] / gib:.2f} GiB")
            secs = f"{m['s_per_step']:.2f}" if m and "s_per_step" in m else ""
            print(f"| {seq} | {name} | {p['activations'] / gib:.2f} GiB | {p['peak'] / gib:.2f} GiB | {got} | {secs} |",
                  flush=True)
    if args.longest:
        longest(configs, args.longest * gib)


def longest(configs: dict, memory: float) -> None:
    """The longest sequence (a multiple of 1024, bisected on the plan) each configuration fits in ``memory`` bytes:
    of this one machine (every rank's planned peak plus the runtime (python, torch), times the ranks), and with
    ``memory`` for each rank (as on one GPU per rank)."""
    from funcpar.cli.planning import runtime_bytes

    gib, runtime = 2.0**30, runtime_bytes()
    print(f"\n| mesh | longest seq, {memory / gib:g} GiB for all ranks | longest seq, {memory / gib:g} GiB per rank |"
          f"\n|---|---|---|")
    for name, (axes, sp, layout) in configs.items():
        rank = functools.lru_cache(lambda seq: plan(axes, sp, layout, seq)["peak"] + runtime)
        fits = [_bisect(lambda seq: _ranks(axes) * rank(seq) <= memory), _bisect(lambda seq: rank(seq) <= memory)]
        print(f"| {name} | {fits[0]} | {fits[1]} |", flush=True)


def _bisect(fits) -> int:
    """The largest multiple of 1024 that ``fits`` (a monotone test), 0 if not even 1024."""
    lo, hi = 0, 1024
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _ranks(axes: dict) -> int:
    n = 1
    for v in axes.values():
        n *= v
    return n


if __name__ == "__main__":
    main()
