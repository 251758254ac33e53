"""Packing with document masks against its alternatives: the same model and step on the same samples, rows built
three ways, steps interleaved so each sees the same machine.

    python benchmarks/documents.py                        # llama-tiny on one process, the built-in task and a chat set
    python benchmarks/documents.py --seq-len 256 --steps 30

- ``documents``: packed rows, each sample attending only to itself (``position_ids``; funcpar train's default);
- ``across``: packed rows attending across samples (``--cross-document``, funcpar before it);
- ``padded``: one sample per row, padded to ``--seq-len`` (``--no-pack``; what a trainer without packing does).

For each: the median step time, the sample tokens per second (padding excluded: the work that trains), the share
of the rows that is padding, how many steps an epoch takes, and how many samples one-a-row cuts short. A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def chat_samples(n: int, seed: int = 0) -> list[tuple[dict, str]]:
    """``n`` conversations of one to three rounds, each turn 4 to 120 characters: lengths as uneven as a chat
    set's."""
    rnd = random.Random(seed)
    words = "the of a to in is it you that he was for on are with as his they be at one have this from".split()

    def text(lo, hi):
        out = ""
        while len(out) < rnd.randint(lo, hi):
            out += rnd.choice(words) + " "
        return out.strip()

    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Answer briefly."}]
        for _ in range(rnd.randint(1, 3)):
            msgs += [{"role": "user", "content": text(4, 60)}, {"role": "assistant", "content": text(4, 120)}]
        out.append(({"messages": msgs}, f"chat:{i}"))
    return out


def arithmetic_samples() -> list[tuple[dict, str]]:
    from funcpar.assets import ARITHMETIC
    from funcpar.data import load_samples

    return load_samples(ARITHMETIC)


def measure(samples, seq_len: int, global_batch: int, steps: int) -> dict[str, dict]:
    import funcpar as fp
    from funcpar.cli.options import BUILTIN_MODELS

    tok, mesh = fp.data.ByteTokenizer(), fp.Mesh()
    model = fp.get_model("llama")
    cfg = model.config(BUILTIN_MODELS["llama-tiny"], mesh)
    specs = model.specs(cfg, mesh)
    kinds = {"documents": dict(pack=True, documents=True), "across": dict(pack=True, documents=False),
             "padded": dict(pack=False)}
    runs = {}
    for name, kw in kinds.items():
        data = fp.data.Dataset.from_samples(samples, tok, seq_len, **kw)
        step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, optimizer=fp.optim.adamw(1e-4))
        loader = fp.data.Loader(fp.data.Mixture([data]), mesh, global_batch, seed=0)
        runs[name] = {"data": data, "step": step, "state": step.init(model.init(cfg, seed=0)), "loader": loader,
                      "times": [], "tokens": 0}
    for i in range(steps + 3):  # interleaved: each mode's step i beside the others'
        for r in runs.values():
            batch = next(r["loader"])
            t0 = time.perf_counter()
            r["state"], _ = r["step"](r["state"], batch)
            if i >= 3:  # (warm-up: first steps allocate)
                r["times"].append(time.perf_counter() - t0)
                r["tokens"] += int((batch["input_ids"] != tok.pad_id).sum())  # (padding excluded)
    out = {}
    for name, r in runs.items():
        d, total = r["data"], sum(r["times"])
        out[name] = {"step_ms": 1e3 * statistics.median(r["times"]), "sample_tokens_per_s": r["tokens"] / total,
                     "padding": 1 - r["tokens"] / (steps * global_batch * seq_len),
                     "steps_per_epoch": len(d) / global_batch, "truncated": d.truncated}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    results = {}
    for set_name, samples in (("built-in task", arithmetic_samples()), ("chat set", chat_samples(1500))):
        results[set_name] = measure(samples, args.seq_len, args.global_batch, args.steps)
    print(f"llama-tiny, one process, seq_len {args.seq_len}, global batch {args.global_batch}, {args.steps} steps "
          f"(median step; sample tokens/s excludes padding)\n")
    print("| data | rows | step (ms) | sample tokens/s | padding | steps per epoch | samples cut short |")
    print("|---|---|---|---|---|---|---|")
    for set_name, res in results.items():
        for name, r in res.items():
            print(f"| {set_name} | {name} | {r['step_ms']:.1f} | {r['sample_tokens_per_s']:,.0f} | "
                  f"{r['padding']:.0%} | {r['steps_per_epoch']:.0f} | {r['truncated']} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
