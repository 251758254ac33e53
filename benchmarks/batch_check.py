"""What the every-step batch check costs: the same train step with ``check_every=1`` (the default: the batch's two
sums per tensor folded into the step's own statistics all-reduce, every step) and ``check_every=0`` (the first step
only),
steps interleaved so both see the same machine, on a tp x dp mesh of local CPU processes.

    python benchmarks/batch_check.py                     # llama-tiny, tp=2 x dp=2, 40 steps each
    python benchmarks/batch_check.py --mesh tp=2 --steps 60
    python benchmarks/batch_check.py --direct            # the check's own work per step, timed alone

Prints the median step time of each and the difference (on a shared machine the medians of identical runs move by
several percent: ``--direct`` times what the check adds, ``batch_drift`` and ``drifted``, by itself; the all-reduce
it rides on carries six float64 more). A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(mesh_text: str, steps: int) -> None:
    import torch

    import funcpar as fp
    from funcpar.cli.options import BUILTIN_MODELS, parse_mesh

    mesh = fp.Mesh(**parse_mesh(mesh_text))
    model = fp.get_model("llama")
    cfg = model.config(BUILTIN_MODELS["llama-tiny"], mesh)
    specs = model.specs(cfg, mesh)
    params = model.init(cfg, seed=0)
    runs = {}
    for every in (1, 0):
        step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, optimizer=fp.optim.adamw(1e-4),
                               check_every=every)
        runs[every] = [step, step.init(fp.shard(params, specs, mesh)), []]
    g = torch.Generator().manual_seed(0)
    dp, c = mesh.axis_size("dp"), mesh.coord("dp")
    for k in range(steps + 2):
        ids = torch.randint(0, 259, (8, 64), generator=g)
        for every in ((1, 0) if k % 2 else (0, 1)):
            step, state, times = runs[every]
            t0 = time.perf_counter()
            state, _ = step(state, {"input_ids": ids.chunk(dp)[c]})
            if k >= 2:  # (the first steps: warm-up, and the first one checks the leaves too)
                times.append(time.perf_counter() - t0)
            runs[every][1] = state
    if mesh.rank == 0:
        on, off = statistics.median(runs[1][2]), statistics.median(runs[0][2])
        print(f"| {mesh_text} | {steps} | {off * 1e3:.2f} | {on * 1e3:.2f} | {(on - off) * 1e3:+.2f} ms "
              f"({(on - off) / off:+.1%}) |", flush=True)


def direct() -> None:
    """The check's own work on a rank of tp=2 x dp=2, for two batch shapes, timed over 2,000 steps."""
    import torch

    from funcpar.train.batching import batch_drift, drifted

    class Rank:  # (a rank's coordinates: all batch_drift reads of the mesh)
        axis_names, coords = ("pp", "dp", "tp"), {"pp": 0, "dp": 1, "tp": 1}

        def axis_size(self, a):
            return {"pp": 1, "dp": 2, "tp": 2}[a]

    print("| batch (rows x tokens) | check's own work per step |")
    print("|---|---|")
    for shape in ((4, 64), (8, 4096)):
        batch = {"input_ids": torch.randint(0, 50000, shape)}
        for _ in range(20):
            drifted(batch_drift(Rank(), batch, ("tp",)))
        t0 = time.perf_counter()
        for _ in range(2000):
            drifted(batch_drift(Rank(), batch, ("tp",)))
        print(f"| {shape[0]} x {shape[1]} | {(time.perf_counter() - t0) / 2000 * 1e6:.0f} us |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="tp=2,dp=2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--direct", action="store_true", help="time the check's own work alone")
    a = ap.parse_args()
    if a.direct:
        direct()
        return
    if a.worker:
        worker(a.mesh, a.steps)
        return
    n = 1
    for part in a.mesh.split(","):
        n *= int(part.split("=")[1])
    print("| mesh | steps | check_every=0: ms/step | check_every=1: ms/step | cost |")
    print("|---|---|---|---|---|", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                    __file__, "--worker", "--mesh", a.mesh, "--steps", str(a.steps)], check=True, env=env)


if __name__ == "__main__":
    main()
