"""The loss curve of a run: ``metrics.jsonl`` (one JSON object per step) drawn to a PNG with matplotlib."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["plot_metrics"]


def plot_metrics(metrics_file: str | os.PathLike, out_png: str | os.PathLike) -> None:
    """Draw the train loss of every row with ``loss`` and the eval loss of every row with ``eval_loss``
    (log scale, by step) to ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
