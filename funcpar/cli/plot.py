"""The loss curve of a run: ``metrics.jsonl`` (one JSON object per step) drawn to a PNG with matplotlib."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from funcpar.io.atomic import write_file

__all__ = ["plot_metrics"]


def plot_metrics(metrics_file: str | os.PathLike, out_png: str | os.PathLike, title: str | None = None) -> dict:
    """Draw the train loss of every row with ``loss`` and the eval loss of every row with ``eval_loss`` (log scale,
    by step), the learning rate on a second axis, under ``title``, to ``out_png``; returns what it drew (the title and
    each line's label and number of points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    lrs = [(r["step"], r["lr"]) for r in rows if "lr" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = {"title": title, "lines": {}}
    for points, label, style in ((train, "train loss", "-"), (evals, "eval loss", "o-")):
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label, lw=1)
            drawn["lines"][label] = len(points)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if lrs:
        right = ax.twinx()
        right.plot(*zip(*lrs, strict=True), ":", color="gray", lw=1, label="learning rate")
        right.set_ylabel("learning rate")
        drawn["lines"]["learning rate"] = len(lrs)
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        ax.legend(handles, labels, loc="upper right")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    write_file(out_png, buf.getvalue())  # (whole or not at all; never through a link planted where the plot goes)
    plt.close(fig)
    return drawn
