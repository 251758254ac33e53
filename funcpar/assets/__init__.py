"""Data shipped with funcpar, made by the project (nothing downloaded)."""

from __future__ import annotations

import json
import random
from pathlib import Path

ARITHMETIC = Path(__file__).with_name("arithmetic.jsonl")


def arithmetic_facts(limit: int = 10) -> list[tuple[int, int]]:
    return [(a, b) for a in range(limit) for b in range(limit)]


def make_arithmetic(path: str | Path = ARITHMETIC, limit: int = 10, copies: int = 32, seed: int = 0) -> Path:
    """Write the built-in task: ``{"type": "instruct", "instruct": "a+b=", "output": "c"}`` for all a, b < limit,
    each fact ``copies`` times in a shuffled order. Answers are checkable, so a trained model can be graded."""
    facts = arithmetic_facts(limit) * copies
    random.Random(seed).shuffle(facts)
    with open(path, "w") as fh:
        for a, b in facts:
            fh.write(json.dumps({"type": "instruct", "instruct": f"{a}+{b}=", "output": str(a + b)}) + "\n")
    return Path(path)


if __name__ == "__main__":  # python funcpar/assets/__init__.py regenerates the shipped file
    print(make_arithmetic())
