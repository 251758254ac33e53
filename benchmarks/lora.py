"""LoRA against full fine-tuning: funcpar on the same weights, mesh and batch, step time and peak memory per rank.

    python benchmarks/lora.py [--size small] [--meshes tp2dp2,1] [--repeats 2] [--out benchmarks/LORA.md]

Each (mesh, full | LoRA) is its own torchrun job of ``worker.py`` (``--impl funcpar`` and ``--impl funcpar-lora``:
adapters ``common.LORA`` on the base frozen outside the step's state, AdamW + clipping as in RESULTS.md), the order
reversed every other repeat; the figure is the median step. Writes a small Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common as C  # noqa: E402
from benchmarks import run as R  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(C.SIZES))
    ap.add_argument("--meshes", default="tp2dp2,1")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--device", default="auto", choices=C.DEVICES, help="as benchmarks/run.py's")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "LORA.md"))
    args = ap.parse_args(argv)
    args.device, args.gpus = R.resolve_device(args.device)
    meshes = args.meshes.split(",")
    short = {m: C.devices_short(m, args.device, args.gpus) for m in meshes}  # as run.py: listed as not run
    jobs = [(m, i) for m in meshes if not short[m] for i in ("funcpar", "funcpar-lora")]
    weights = R.write_weights(C.SIZES[args.size]) if jobs else None
    recs: dict = {}
    try:
        for r in range(args.repeats):
            for mesh, impl in jobs if r % 2 == 0 else jobs[::-1]:
                rec = R.launch(mesh, impl, args.size, weights, args)
                print(f"{C.mesh_label(mesh)} {impl}: " + (f"median {C.median(rec['times']):.3f} s/step, peak RSS "
                      f"{max(rec['rss_mb']):.0f} MB" if "times" in rec else rec.get("error", "?")), flush=True)
                recs.setdefault((mesh, impl), []).append(rec)
    finally:
        if weights:
            shutil.rmtree(weights, ignore_errors=True)
    size = C.SIZES[args.size]
    lines = [f"# LoRA ({C.LORA}) against full fine-tuning", "",
             f"`python benchmarks/lora.py {' '.join(sys.argv[1:] if argv is None else argv)}`: funcpar, Llama "
             f"hidden {size['hidden']}, {size['layers']} layers, vocab {size['vocab']}, seq {size['seq']}, global "
             f"batch {size['global_batch']}, AdamW + clipping, ZeRO-1; {args.repeats} repeats of {args.steps} timed "
             f"steps, the median; peak RSS per rank (max over ranks and repeats).", "",
             "| mesh | full s/step | LoRA s/step | LoRA / full | full peak RSS MB | LoRA peak RSS MB |",
             "|---|---|---|---|---|---|"]
    for mesh in meshes:
        full, lora = recs.get((mesh, "funcpar"), []), recs.get((mesh, "funcpar-lora"), [])
        if short[mesh]:
            lines.append(f"| {C.mesh_label(mesh)} | not run: {short[mesh]} |")
            continue
        if not all("times" in x for x in full + lora) or not full or not lora:
            lines.append(f"| {C.mesh_label(mesh)} | failed: "
                         + "; ".join(x.get("error", "") for x in full + lora if "error" in x) + " |")
            continue
        tf = C.median([t for x in full for t in x["times"]])
        tl = C.median([t for x in lora for t in x["times"]])
        mf, ml = max(max(x["rss_mb"]) for x in full), max(max(x["rss_mb"]) for x in lora)
        lines.append(f"| {C.mesh_label(mesh)} | {tf:.3f} | {tl:.3f} | {tl / tf:.2f} | {mf:.0f} | {ml:.0f} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))


if __name__ == "__main__":
    main()
