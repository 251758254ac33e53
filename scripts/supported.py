"""Which of the installed transformers' causal LMs the generic path trains exactly: the table in docs/SUPPORTED.md.

For every causal-LM ``model_type`` transformers defines (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; those funcpar has a
built-in model for too, run through the generic path as ``--generic`` runs them), a tiny random config (tests/generic_check.py ``tiny_config``) is trained 3 AdamW steps on each mesh
(default tp=2, tp=2 x dp=2 at ZeRO-3, pp=2) against transformers + ``torch.optim.AdamW`` on one process, and each
cell says ``exact`` (losses and gradient norms within 1e-5 relative, every leaf's update within 1e-4 of its size),
``refused`` (with the one-line reason funcpar gives before step 1) or ``failed`` (what differed, or the error).

    .venv/bin/python scripts/supported.py                      # every type; writes docs/SUPPORTED.md's table
    .venv/bin/python scripts/supported.py --types qwen3,olmo2 --no-write

Results are also written to benchmarks/results/supported.json (one entry per type, as they finish).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("FUNCPAR_FUSE", "off")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LIMIT = 400  # seconds for one type, its reference and every mesh
MAX_PARAMS = 5_000_000  # a small config's parameters (the typical one has about 0.2M)
BEGIN, END = "<!-- supported.py: begin -->", "<!-- supported.py: end -->"


def types_to_check() -> list[str]:
    import funcpar as fp

    return fp.model.generic_types()  # (the built-in models' types too: --generic runs them)


def one(mt: str, meshes: list[str]) -> dict:
    import generic_check as g
    from transformers import CONFIG_MAPPING

    try:
        plan = bool(getattr(CONFIG_MAPPING[mt](), "base_model_tp_plan", None))  # (as the type's default has it)
    except Exception:  # noqa: BLE001 - a default config that does not build
        plan = None
    try:
        hf = g.tiny_config(mt)
        size = small_size(hf)
        if size > MAX_PARAMS:  # (sub-configs the shrinking does not reach: a run would not be small)
            return {"plan": plan, **{m: f"failed: its small config still has {size:,} parameters (sub-configs "
                                        f"tiny_config does not shrink)" for m in meshes}}
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build small: reported as such
        return {"plan": plan, **{m: f"failed: tiny config: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                                 for m in meshes}}
    def late(*_):
        raise TimeoutError(f"over {LIMIT} s")
    signal.signal(signal.SIGALRM, late)
    signal.alarm(LIMIT)  # (transformers' own run of a type can be slow: bounded, as the meshes' runs are)
    try:
        res = g.check(mt, meshes, hf)
    except Exception as e:  # noqa: BLE001 - the reference itself failed
        return {"plan": plan, **{m: f"failed: transformers' own run: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:200] if str(e) else ''}" for m in meshes}}
    finally:
        signal.alarm(0)
    return {"plan": plan, **res}


def small_size(hf: dict) -> int:
    """The parameter count of ``hf``'s causal LM, built on meta (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(CONFIG_MAPPING[hf["model_type"]].from_dict(
            {k: v for k, v in hf.items() if k != "model_type"}))
    return sum(p.numel() for p in m.parameters())


def table(results: dict, meshes: list[str]) -> str:
    def cell(v: str) -> str:
        kind, _, why = v.partition(": ")
        return kind if not why else f"{kind}: {why.replace('|', '/')}"
    with_plan = {t: r for t, r in results.items() if r.get("plan")}
    exact = sum(r.get(meshes[0]) == "exact" for r in with_plan.values())
    lines = [f"{len(results)} causal-LM types checked, {len(with_plan)} with a tp plan; at {meshes[0]}: "
             f"**{exact} of {len(with_plan)} exact** ({100 * exact / max(1, len(with_plan)):.0f} %) of those "
             f"with a plan.", "",
             "| model_type | tp plan | " + " | ".join(meshes) + " |", "|---|---|" + "---|" * len(meshes)]
    for t in sorted(results):
        r = results[t]
        lines.append(f"| {t} | {'yes' if r.get('plan') else 'no'} | "
                     + " | ".join(cell(r.get(m, "")) for m in meshes) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated model types (default: every causal LM without a built-in)")
    ap.add_argument("--meshes", default="tp=2,tp=2 x dp=2 zero3,pp=2")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/supported.json"))
    ap.add_argument("--no-write", action="store_true", help="print the table; leave docs/SUPPORTED.md alone")
    args = ap.parse_args(argv)
    meshes = args.meshes.split(",")
    types = args.types.split(",") if args.types else types_to_check()
    out = Path(args.json)
    results = json.loads(out.read_text()) if out.exists() else {}  # (a run of some types updates theirs)
    t0 = time.time()
    for mt in types:
        t = time.time()
        results[mt] = one(mt, meshes)
        print(f"{mt:32s} {time.time() - t:6.1f}s  " + "  ".join(f"{m}: {results[mt][m][:90]}" for m in meshes),
              flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, sort_keys=True))
    text = table(results, meshes)
    print(f"\n{text}\n\n({len(types)} types in {time.time() - t0:.0f} s)")
    if not args.no_write:
        doc = ROOT / "docs/SUPPORTED.md"
        body = doc.read_text()
        block = f"{BEGIN}\n{text}\n{END}"
        body = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, body, flags=re.S) \
            if BEGIN in body else body.rstrip() + "\n\n" + block + "\n"
        doc.write_text(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
