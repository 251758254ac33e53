"""Long sequences: activation memory and step time per rank for tp=2 with and without sequence parallelism, and for
context parallelism on cp=1/2/4, with the plan's prediction beside each measurement.

    python bench/long_sequences.py                          # seq 4096 and 8192 measured, 16384 planned
    python bench/long_sequences.py --seqs 4096 --measure 4096

The model is the benchmarks' small Llama (hidden 512, 4 layers, 8 heads / 4 kv heads, vocab 4096), one row per step,
AdamW, float32, on the CPU. Each measured configuration runs in fresh processes under torchrun (one per rank), two
steps after one warm-up step, with ``MALLOC_MMAP_THRESHOLD_=131072`` so that the resident peak follows what is live;
it reports the largest rank's peak resident set (``ru_maxrss``) and its median s/step. The plan traces the same step
on meta tensors (:func:`funcpar.planning.trace_step`): activations of a micro-batch and the step's peak, per rank. A
benchmark, not a test: nothing is asserted. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # name: (mesh axes, sequence_parallel)
    "tp=2": ({"tp": 2}, False), "tp=2 + SP": ({"tp": 2}, True),
    "cp=1": ({}, False), "cp=2": ({"cp": 2}, False), "cp=4": ({"cp": 4}, False),
}
SMALL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)


def _build(mesh, seq: int, sp: bool):
    import funcpar as fp
    from funcpar.models import llama

    cfg = llama.Config(**SMALL, max_position_embeddings=max(seq, 2048), sliding_windows=(None,) * 4).with_mesh(mesh)
    data_axes = ("dp", "cp") if "cp" in mesh.axis_names else ("dp",)
    step = fp.compile_step(llama.MODEL.loss_fn(cfg, mesh, sequence_parallel=sp), llama.specs(cfg, mesh), mesh=mesh,
                           optimizer=fp.optim.adamw(1e-4), data_axes=data_axes, check=False)
    return step, cfg


def plan(axes: dict, sp: bool, seq: int) -> dict:
    import funcpar as fp
    from funcpar.models import llama
    from funcpar.planning import local_params, trace_step
    import torch

    mesh = fp.Mesh.abstract(device="cpu", **axes)
    step, cfg = _build(mesh, seq, sp)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    r = trace_step(step, local_params(llama.init(cfg, device="meta"), step.specs, mesh), {"input_ids": ids})
    return {"activations": r["activations"], "peak": r["step_peak"]}


def worker(seq: int, sp: bool, axes: dict, out: str) -> None:
    """One rank of a measured configuration (under torchrun): 1 warm-up step, 2 timed; writes a JSON file in
    ``out``."""
    import funcpar as fp
    from funcpar.models import llama
    import torch

    mesh = fp.Mesh(device="cpu", **axes)
    step, cfg = _build(mesh, seq, sp)
    state = step.init(fp.shard(llama.init(cfg, seed=0), step.specs, mesh))
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    times = []
    for k in range(3):
        t0 = time.perf_counter()
        state, m = step(state, {"input_ids": ids})
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(out, f"rank{mesh.rank}.json"), "w") as f:
        json.dump({"rank": mesh.rank, "peak": peak, "s_per_step": sorted(times[1:])[0], "loss": m["loss"]}, f)


def measure(axes: dict, sp: bool, seq: int, timeout: float) -> dict | None:
    import tempfile

    n = 1
    for v in axes.values():
        n *= v
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    with tempfile.TemporaryDirectory() as out:
        spec = json.dumps({"seq": seq, "sp": sp, "axes": axes, "out": out})
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
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        w = json.loads(args.worker)
        return worker(w["seq"], w["sp"], w["axes"], w["out"])
    measured = {int(s) for s in args.measure.split(",") if s}
    gib = 2.0**30
    print("| seq | mesh | planned activations / rank | planned step peak / rank | measured peak RSS / rank "
          "| s/step |\n|---|---|---|---|---|---|")
    for seq in (int(s) for s in args.seqs.split(",")):
        for name, (axes, sp) in CONFIGS.items():
            p = plan(axes, sp, seq)
            m = measure(axes, sp, seq, args.timeout) if seq in measured else None
            got = ("not run" if m is None else m["error"] if "error" in m else f"{m['peak'] / gib:.2f} GiB")
            secs = f"{m['s_per_step']:.2f}" if m and "s_per_step" in m else ""
            print(f"| {seq} | {name} | {p['activations'] / gib:.2f} GiB | {p['peak'] / gib:.2f} GiB | {got} | {secs} |",
                  flush=True)


if __name__ == "__main__":
    main()
