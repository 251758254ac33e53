"""Issue 56, item 1: no rank aborts at or after exit, whatever order a user starts and ends the world in.

Runs scripts/exit_user.py under torchrun ``--runs`` times per start-up/tear-down order, beside ``--load`` busy
processes (an abort at exit is a race with gloo's threads: a loaded machine makes it likelier), and counts the jobs
in which a rank died of SIGABRT ("terminate called without an active exception") or that ended otherwise than the
order should (0; 1 for ``-raise``, whose rank 1 raises).

    .venv/bin/python scripts/exit_stress.py --runs 50 --world 8 --mesh pp=2,tp=2,dp=2 --load 2

Prints one line per order and exits 1 if any job aborted or ended wrongly.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDERS = ("user-destroy", "user", "funcpar", "funcpar-destroy", "user-raise", "funcpar-raise")
ABORT = ("terminate called", "exitcode: -6", "Fatal Python error: Aborted", "SIGABRT")


def _busy(stop) -> None:
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1000003


def one(order: str, world: int, mesh: str, timeout: float) -> tuple[bool, int, str]:
    """One torchrun job: (a rank aborted, its exit code, its whole log)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--standalone", str(ROOT / "scripts" / "exit_user.py"), order,  # (a free port: torchrun's own pick)
               mesh, str(Path(tmp) / "out")]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            log, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            return False, -999, f"timed out after {timeout} s: {(e.stderr or b'')[-500:]!r}"
    return any(a in log for a in ABORT), rc, log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50, help="jobs per order")
    ap.add_argument("--orders", default=",".join(ORDERS))
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--mesh", default="pp=2,tp=2,dp=2")
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the jobs")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args(argv)
    stop = mp.Event()
    busy = [mp.Process(target=_busy, args=(stop,), daemon=True) for _ in range(args.load)]
    for b in busy:
        b.start()
    bad = 0
    try:
        for order in args.orders.split(","):
            t0, aborted, wrong = time.time(), 0, []
            want = 1 if order.endswith("-raise") else 0
            for _ in range(args.runs):
                ab, rc, log = one(order, args.world, args.mesh, args.timeout)
                aborted += ab
                # (the whole log: at 8 ranks torchrun's failure summary pushes the rank's error out of any tail)
                if rc != want or ab or (want and "the user's own error on rank 1" not in log):
                    wrong.append((rc, log[-6000:]))
            bad += len(wrong)
            print(f"{order:16s} {args.runs} jobs of {args.world} ranks ({args.mesh}), {args.load} busy processes: "
                  f"{aborted} aborted, {len(wrong)} ended otherwise than exit {want} ({time.time() - t0:.0f} s)",
                  flush=True)
            for rc, tail in wrong[:2]:
                print(f"  exit {rc}:\n" + "\n".join("    " + ln for ln in tail.splitlines()[-15:]), flush=True)
    finally:
        stop.set()
        for b in busy:
            b.join()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
