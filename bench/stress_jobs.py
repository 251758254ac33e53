"""Repeat short multi-process jobs and count the ones that die: the stress test for rank aborts (issue 16).

    python bench/stress_jobs.py --jobs 40 --parallel 2        # 40 torchrun jobs of `funcpar train`, two at a time
    python bench/stress_jobs.py --minimal --ranks 2 --jobs 200   # 200 jobs of a mesh + one all-reduce + exit

Each job is a real ``torchrun --nproc-per-node 4 -m funcpar train`` (Mesh(tp=2, dp=2): mesh construction, a few
steps, a checkpoint, an HF export, process-group teardown), the way a user runs it. A job that fails is kept whole:
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
    args = ap.parse_args()
    failed = 0
    with ThreadPoolExecutor(args.parallel) as pool:
        for i, rc, log in pool.map(lambda i: job(i, args), range(args.jobs)):
            if rc == 0:
                continue
            failed += 1
            os.makedirs(args.keep, exist_ok=True)
            with open(os.path.join(args.keep, f"job-{i}.log"), "w") as f:
                f.write(log)
            lines = [ln for ln in log.splitlines() if "terminate" in ln or "what()" in ln or "SIGABRT" in ln]
            print(f"job {i}: exit {rc}: " + (" | ".join(lines[:3]) or log.strip().splitlines()[-1]), flush=True)
    print(f"{args.jobs} jobs, {failed} failed ({args.parallel} at a time, {args.ranks} ranks, mesh {args.mesh})")


if __name__ == "__main__":
    main()
