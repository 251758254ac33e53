"""Experiment trackers beyond TensorBoard: ``funcpar train --track wandb,mlflow`` sends every metrics row (and the
run's options) to Weights & Biases and/or MLflow when their packages are installed (funcpar depends on neither).

A run has one tracker identity for its whole life: ``OUT/trackers.json`` keeps the run id (wandb's ``id``) and
MLflow's run id, so a resumed run (``--resume``, a restart after a lost rank) continues the same tracked run
instead of starting another. Only rank 0 tracks.
"""

from __future__ import annotations

import importlib
import json
import uuid
from pathlib import Path
from typing import Any

from funcpar.io.atomic import write_file

__all__ = ["TRACKERS", "parse", "check", "open_trackers", "FILE"]

TRACKERS = ("wandb", "mlflow")
FILE = "trackers.json"  # in the run folder: the ids that make a resumed run the same tracked run


def parse(text: str) -> list[str]:
    """``--track``: ``""`` (none) or a comma-separated list of :data:`TRACKERS`."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TRACKERS]
    if bad:
        raise ValueError(f"--track {text!r}: unknown tracker {bad[0]!r} (known: {', '.join(TRACKERS)})")
    return names


def check(text: str) -> None:
    """Refuse a ``--track`` whose package is not installed (before any rank starts)."""
    for name in parse(text):
        try:
            importlib.import_module(name)
        except ImportError:
            raise ValueError(f"--track {name} needs the {name} package, which is not installed: pip install "
                             f"{name} (or train without --track {name})") from None


class _Wandb:
    def __init__(self, ids: dict, opts: dict, out: Path, project: str):
        import wandb

        self.w = wandb
        self.run = wandb.init(project=project, id=ids["run_id"], name=out.name, resume="allow", config=opts,
                              dir=str(out))

    def log(self, step: int, row: dict) -> None:
        self.w.log(row, step=step)

    def close(self) -> None:
        self.w.finish()


class _Mlflow:
    def __init__(self, ids: dict, opts: dict, out: Path, project: str):
        import mlflow

        self.m = mlflow
        mlflow.set_experiment(project)
        resumed = ids.get("mlflow_run_id")
        run = mlflow.start_run(run_id=resumed, run_name=None if resumed else out.name)
        ids["mlflow_run_id"] = run.info.run_id
        if not resumed:  # (MLflow refuses a parameter logged twice with another value)
            mlflow.log_params({k: v for k, v in opts.items() if v != ""})
            mlflow.set_tag("funcpar.run_id", ids["run_id"])

    def log(self, step: int, row: dict) -> None:
        self.m.log_metrics(row, step=step)

    def close(self) -> None:
        self.m.end_run()


class Trackers:
    """The trackers of a run: :meth:`log` a metrics row to each, :meth:`close` at the end."""

    def __init__(self, names: list[str], opts: dict[str, Any], out: Path, resume: bool):
        path = out / FILE
        try:
            ids = json.loads(path.read_text()) if resume and path.is_file() else {}
        except ValueError:
            ids = {}
        ids = ids if isinstance(ids, dict) and isinstance(ids.get("run_id"), str) else {"run_id": uuid.uuid4().hex}
        kinds = {"wandb": _Wandb, "mlflow": _Mlflow}
        self.open = [kinds[n](ids, opts, out, opts.get("project") or "funcpar") for n in names]
        write_file(path, json.dumps(ids, indent=1) + "\n")  # (whole or not at all: the run's identity)
        self.run_id = ids["run_id"]

    def log(self, step: int, row: dict) -> None:
        numbers = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        for t in self.open:
            t.log(step, numbers)

    def close(self) -> None:
        for t in self.open:
            t.close()


def open_trackers(opts: dict[str, Any], out: Path) -> Trackers | None:
    """The run's trackers (rank 0), or None without ``--track``."""
    names = parse(opts["track"])
    return Trackers(names, opts, out, opts["resume"]) if names else None
