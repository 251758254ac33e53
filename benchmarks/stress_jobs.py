"""Repeat short multi-process jobs and count the ones that die: the stress test for rank aborts (issue 16).

    python benchmarks/stress_jobs.py --jobs 40 --parallel 2        # 40 torchrun jobs of `funcpar train`, two at a time
    python benchmarks/stress_jobs.py --minimal --ranks 2 --jobs 200   # 200 jobs of a mesh + one all-reduce + exit
    python benchmarks/stress_jobs.py --resume --jobs 200 --parallel 1 # 50 chains of the user flow below, 4 jobs each

Each job is a real ``torchrun --nproc-per-node 4 -m funcpar train`` (Mesh(tp=2, dp=2): mesh construction, a few
steps, a checkpoint, an HF export, process-group teardown), the way a user runs it. ``--resume`` runs the flow of
issue 16 as a user scripts it, as chains of four torchrun jobs: ``fp.hf.load`` of a tiny transformers Llama at
Mesh(tp=2, dp=2), 3 steps of ``compile_step(zero=1, clip_norm=1.0)``, ``step.save``; then fresh jobs that
``step.init`` + ``step.load`` at Mesh(tp=2, dp=2), Mesh(dp=2) and Mesh(tp=2) and train 3 more steps (a resumed
job on the mesh it was saved on must reproduce the first job's continuation bit for bit; the script checks that
each resumed job's losses agree within 1e-5 of it). A job that fails is kept whole:
its stdout and stderr go to ``--keep`` (default ``stress-failures/``), and the C++ ``terminate`` / ``what()`` line
gloo prints on an abort is shown. Not part of the test suite: it takes minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


MINIMAL = """
import funcpar as fp
import torch
mesh = fp.Mesh(dp=int(__import__("os").environ["WORLD_SIZE"]))
fp.collectives.all_reduce(torch.ones(3), mesh, "dp")
"""


USER_FLOW = """
import sys, torch, funcpar as fp
mode, hf_dir, ckpt, axes = sys.argv[1], sys.argv[2], sys.argv[3], dict(
    (k, int(v)) for k, v in (kv.split("=") for kv in sys.argv[4].split(",")))
mesh = fp.Mesh(**axes)
llama = fp.get_model("llama")
params, cfg = fp.hf.load(hf_dir, llama, mesh)
step = fp.compile_step(llama.loss_fn(cfg, mesh), llama.specs(cfg, mesh), mesh=mesh,
                       optimizer=fp.optim.adamw(1e-2), zero=1, clip_norm=1.0)
state = step.init(params)
g = torch.Generator().manual_seed(0)
batches = [{"input_ids": (ids := torch.randint(0, 128, (4, 16), generator=g)), "labels": ids} for _ in range(6)]
if mode == "resume":
    state, _ = step.load(ckpt)
losses = []
for b in batches[3:] if mode == "resume" else batches:
    state, m = step(state, {k: v.chunk(mesh.axis_size("dp"))[mesh.coord("dp")] for k, v in b.items()})
    losses.append(float(m["loss"]))
    if mode == "first" and state.step == 3:
        step.save(ckpt, state)
if mesh.rank == 0:
    print("LOSSES", " ".join(repr(x) for x in losses[-3:]))
"""


def _losses(log: str) -> list[float]:
    return [float(x) for ln in log.splitlines() if ln.startswith("LOSSES") for x in ln.split()[1:]]


def chain(i: int, args) -> list[tuple[str, int, str]]:
    """One user flow: the first job, then fresh jobs resuming its checkpoint on three meshes."""
    out = tempfile.mkdtemp(prefix=f"stress-{i}-")
    script = os.path.join(out, "job.py")
    with open(script, "w") as f:
        f.write(USER_FLOW)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    results, ref = [], None
    for mode, axes in [("first", "tp=2,dp=2"), ("resume", "tp=2,dp=2"), ("resume", "dp=2"), ("resume", "tp=2")]:
        n = 1
        for kv in axes.split(","):
            n *= int(kv.split("=")[1])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", script,
               mode, args.hf, os.path.join(out, "ckpt"), axes]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        log, rc = p.stdout + p.stderr, p.returncode
        got = _losses(log)
        if rc == 0 and mode == "first":
            ref = got
        elif rc == 0 and (ref is None or len(got) != 3 or max(abs(a - b) for a, b in zip(got, ref)) > 1e-5):
            rc, log = 99, log + f"\nresumed losses {got} differ from the first job's {ref}"
        results.append((f"{mode}@{axes}", rc, log))
        if rc != 0 and mode == "first":
            break
    return results


def job(i: int, args) -> tuple[int, int, str]:
    out = tempfile.mkdtemp(prefix=f"stress-{i}-")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
    if args.minimal:  # a mesh, one collective, exit: the shortest job that exercises process-group teardown
        script = os.path.join(out, "job.py")
        with open(script, "w") as f:
            f.write(MINIMAL)
        cmd = run + [script]
    else:
        cmd = run + ["-m", "funcpar", "train", "--model", "llama-micro", "--mesh", args.mesh, "--steps",
                     str(args.steps), "--global-batch", "8", "--seq-len", "32", "--eval-every", "0", "--save-every", "2",
                     "--out", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return i, p.returncode, p.stdout + p.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mesh", default="tp=2,dp=2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--keep", default="stress-failures")
    ap.add_argument("--minimal", action="store_true", help="a mesh and one all-reduce per job, not `funcpar train`")
    ap.add_argument("--resume", action="store_true", help="the user flow of issue 16: HF load, save, resume elsewhere")
    args = ap.parse_args()
    if args.resume:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from hf_fixtures import make_checkpoint

        args.hf = tempfile.mkdtemp(prefix="stress-hf-")
        make_checkpoint("llama", args.hf)
        args.mesh, args.ranks = "tp=2,dp=2 then dp=2, tp=2", "4/2/2"

    def jobs(i):
        return chain(i, args) if args.resume else [(f"job {i}", *job(i, args)[1:])]

    failed = total = 0
    with ThreadPoolExecutor(args.parallel) as pool:
        for i, runs in enumerate(pool.map(jobs, range(-(-args.jobs // 4) if args.resume else args.jobs))):
          for name, rc, log in runs:
            total += 1
            if rc == 0:
                continue
            failed += 1
            os.makedirs(args.keep, exist_ok=True)
            with open(os.path.join(args.keep, f"job-{i}-{name.replace('@', '-')}.log"), "w") as f:
                f.write(log)
            lines = [ln for ln in log.splitlines() if "terminate" in ln or "what()" in ln or "SIGABRT" in ln]
            print(f"{i} {name}: exit {rc}: " + (" | ".join(lines[:3]) or log.strip().splitlines()[-1]), flush=True)
    print(f"{total} jobs, {failed} failed ({args.parallel} at a time, {args.ranks} ranks, mesh {args.mesh})")


if __name__ == "__main__":
    main()
