"""Two checkouts of funcpar paired on the same job: is the after-tree's step slower than the before-tree's?

    git worktree add --detach /tmp/before 527ddfd
    python benchmarks/paired_trees.py --before /tmp/before --after . --meshes 1,tp2dp2 --rounds 5 --warmup 2 --steps 6 \\
        --out /tmp/paired.json

For each mesh, ``--rounds`` rounds of one job per tree, the order alternating (before, after; after, before; ...),
each job a fresh torchrun job of that tree's own ``benchmarks/worker.py --impl funcpar`` launched as
``benchmarks/run.py`` launches its jobs (``run.launch``: threads per rank, environment, timeout), on one weights
folder (``run.write_weights``, the size's transformers Llama, seed 0) and so the same batches. The table: every timed
step's median per tree, their ratio after/before, the per-round ratios (a round's after median over its before
median: the pairs share the machine's state) as median [min, max], and the largest difference between the loss
curves of the two trees (the same weights, batches and math: 0 expected) next to the largest within each tree
across rounds (the noise floor that difference is read against). Exits 1 if a job failed or the losses differ.

How a tree is run. Each job runs this file under torchrun with ``PAIRED_TREE`` set; that copy puts a finder ahead of
the import system so that ``funcpar`` and ``funcpar.models`` come from the tree (an editable install of either
maps ``funcpar.models`` to its own ``models/``, which the other tree's ``funcpar`` would otherwise import), checks
where they came from, then runs the tree's ``worker.py`` as ``__main__`` (it puts its tree first on ``sys.path``,
so its ``benchmarks.common`` is its own).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

TREE_ENV = "PAIRED_TREE"


def run_tree_worker(tree: str) -> None:
    """Under torchrun: ``tree``'s ``benchmarks/worker.py`` on ``sys.argv``, funcpar imported from ``tree``."""
    import runpy

    tree = os.path.realpath(tree)
    where = {"funcpar": os.path.join(tree, "funcpar"), "funcpar.models": os.path.join(tree, "models")}

    class TreeFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name in where:
                return importlib.util.spec_from_file_location(
                    name, os.path.join(where[name], "__init__.py"), submodule_search_locations=[where[name]])
            return None

    sys.meta_path.insert(0, TreeFinder)
    import funcpar.models

    got = [os.path.realpath(m.__file__) for m in (funcpar, funcpar.models)]
    if not all(f.startswith(tree + os.sep) for f in got):
        print("ERROR " + json.dumps({"rank": os.environ.get("RANK"), "error": f"imported {got}, not from {tree}"}))
        os._exit(1)
    worker = os.path.join(tree, "benchmarks", "worker.py")
    sys.argv[0], sys.path[0] = worker, os.path.dirname(worker)
    runpy.run_path(worker, run_name="__main__")


def commit(tree: str) -> str:
    git = ["git", "-C", tree]
    sha = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--", "funcpar", "models", "benchmarks"],
                           capture_output=True, text=True).stdout.strip()
    return (sha or "unknown") + (" + uncommitted changes" if dirty else "")


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest |x - y| over every pair of loss curves from ``a`` and ``b`` (step by step)."""
    return max((abs(x - y) for p in a for q in b for x, y in zip(p, q, strict=True)), default=float("nan"))


def summarize(mesh: str, jobs: list[dict]) -> dict:
    by = {t: [j for j in jobs if j["tree"] == t] for t in ("before", "after")}
    med = {t: C.median([s for j in js for s in j["times"]]) for t, js in by.items()}
    rounds = sorted({j["round"] for j in jobs})
    per_round = [C.median(next(j for j in by["after"] if j["round"] == r)["times"])
                 / C.median(next(j for j in by["before"] if j["round"] == r)["times"]) for r in rounds]
    losses = {t: [j["losses"] for j in js] for t, js in by.items()}
    return {"mesh": mesh, "before_ms": 1e3 * med["before"], "after_ms": 1e3 * med["after"],
            "ratio": med["after"] / med["before"], "paired_median": C.median(per_round),
            "paired_min": min(per_round), "paired_max": max(per_round), "per_round": per_round,
            "loss_diff": max_diff(losses["before"], losses["after"]),
            "loss_diff_within": max(max_diff(losses[t], losses[t]) for t in losses),
            "load": C.median([j["load"] for j in jobs])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the before-tree's root (e.g. a git worktree)")
    ap.add_argument("--after", default=ROOT, help="the after-tree's root (default: this file's)")
    ap.add_argument("--meshes", default="1,tp2dp2", help="names in common.MESHES")
    ap.add_argument("--size", default="small", choices=sorted(C.SIZES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--device", default="cpu", choices=C.DEVICES, help="as benchmarks/run.py's")
    ap.add_argument("--out", help="write the rows and every job's record here (JSON)")
    args = ap.parse_args(argv)
    args.device, args.gpus = R.resolve_device(args.device)
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    meshes = args.meshes.split(",")
    R.WORKER = os.path.abspath(__file__)  # run.launch starts this file, which runs the tree in PAIRED_TREE
    weights = R.write_weights(C.SIZES[args.size])
    jobs: list[dict] = []
    try:
        for mesh in meshes:
            for r in range(args.rounds):
                for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    os.environ[TREE_ENV] = trees[name]
                    rec = {"tree": name, "round": r, **R.launch(mesh, "funcpar", args.size, weights, args)}
                    jobs.append(rec)
                    print(f"{mesh} round {r} {name}: " + (f"median {1e3 * C.median(rec['times']):.1f} ms/step, "
                          f"load {rec['load']:.1f}" if "times" in rec else rec.get("error", "?")), flush=True)
    finally:
        os.environ.pop(TREE_ENV, None)
        shutil.rmtree(weights, ignore_errors=True)
    failed = [j for j in jobs if "times" not in j]
    rows = [summarize(m, [j for j in jobs if j["mesh"] == m]) for m in meshes
            if not any(j["mesh"] == m for j in failed)]
    print(f"\nbefore {trees['before']} ({commit(trees['before'])}), after {trees['after']} "
          f"({commit(trees['after'])}); {args.size}, {args.device}, {args.rounds} rounds x {args.steps} timed steps")
    print("| mesh | before ms/step | after ms/step | after/before | paired ratio median [min, max] "
          "| loss max abs diff (within a tree) | load |")
    print("|---|---|---|---|---|---|---|")
    for w in rows:
        print(f"| {C.mesh_label(w['mesh'])} | {w['before_ms']:.1f} | {w['after_ms']:.1f} | {w['ratio']:.3f} "
              f"| {w['paired_median']:.3f} [{w['paired_min']:.3f}, {w['paired_max']:.3f}] "
              f"| {w['loss_diff']:.3g} ({w['loss_diff_within']:.3g}) | {w['load']:.1f} |")
    for j in failed:
        print(f"FAILED {j['mesh']} round {j['round']} {j['tree']}: {j.get('error')}")
    differ = [w["mesh"] for w in rows if w["loss_diff"] != 0]
    if differ:
        print(f"LOSSES DIFFER between the trees on {', '.join(differ)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join([sys.executable, *sys.argv]), "before": trees["before"],
                       "before_commit": commit(trees["before"]), "after": trees["after"],
                       "after_commit": commit(trees["after"]), "size": args.size, "device": args.device,
                       "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps, "rows": rows,
                       "jobs": jobs}, f, indent=1)
    return 1 if failed or differ else 0


if __name__ == "__main__" and os.environ.get(TREE_ENV):
    run_tree_worker(os.environ[TREE_ENV])
    sys.exit(0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common as C  # noqa: E402
from benchmarks import run as R  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
