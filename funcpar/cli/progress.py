"""How ``funcpar train`` shows a run as it goes: ``metrics.jsonl``, a progress bar on a terminal, and every
``--log-every`` steps (and at each evaluation) one line with the loss, held-out loss, gradient norm, learning rate,
tokens/s, an MFU estimate, peak memory and the time left: printed above the bar on a terminal, plain otherwise.
With ``tensorboard`` installed (``pip install funcpar[tensorboard]``) the same numbers go to TensorBoard event files
in ``OUT/tensorboard``.

MFU (model FLOPs utilisation) counts ``6·N + 12·L·h·s`` FLOPs per token (N parameters, L layers, width h, sequence
length s: the matmuls of the forward and backward passes, attention included) against the matmul throughput every
rank measures for itself at the start, all ranks at once (so ranks sharing cores count what they really get).
The line's tokens/s and MFU are over the steps since the previous line (one step's rate swings with the machine's
other work), and the time left follows the pace of the last :data:`PACE_STEPS` steps, the first step of the process
(start-up) left out.
"""

from __future__ import annotations

import collections
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

import funcpar as fp
from funcpar.io.atomic import open_own

__all__ = ["Progress", "flops_per_token", "measure_peak_flops", "eta_seconds"]


def flops_per_token(n_params: int, layers: int, hidden: int, seq_len: int) -> float:
    return 6.0 * n_params + 12.0 * layers * hidden * seq_len


def measure_peak_flops(mesh, dtype: torch.dtype = torch.float32, seconds: float = 0.2) -> float:
    """The matmul FLOP/s of the whole mesh: each rank times square matmuls on its device; collective."""
    n = 512
    a = torch.randn(n, n, device=mesh.device, dtype=dtype)
    b = torch.randn(n, n, device=mesh.device, dtype=dtype)
    sync = torch.cuda.synchronize if mesh.device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
        if mesh.device.type == "cuda" and count % 64 == 0:
            sync()
    sync()
    mine = torch.tensor([2.0 * n**3 * count / (time.perf_counter() - t0)], dtype=torch.float64, device=mesh.device)
    return fp.collectives.all_reduce(mine, mesh, mesh.axis_names).item()


def eta_seconds(elapsed: float, done_here: int, remaining: int) -> float:
    """Time left, from the steps this process has taken (not those a resumed run inherited)."""
    return elapsed / max(1, done_here) * remaining


PACE_STEPS = 50  # the steps whose pace the time left follows


def interval_rate(rates: list[float]) -> float:
    """Tokens/s over steps of equal tokens whose own rates are ``rates``: their harmonic mean (all tokens over all
    the time), not the last step's."""
    rates = [r for r in rates if r > 0]
    return len(rates) / sum(1.0 / r for r in rates) if rates else 0.0


def _peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return f"{rss / 2**30:.2f} GiB rss"


class Progress:
    """Rank 0's account of the run (the other ranks' calls do nothing)."""

    def __init__(self, rank0: bool, metrics_file: Path, steps: int, log_every: int, start_step: int,
                 flops_token: float, peak_flops: float, device: torch.device, trackers: Any = None):
        self.rank0, self.metrics_file, self.steps, self.log_every = rank0, metrics_file, steps, log_every
        self.start_step, self.flops_token, self.peak, self.device = start_step, flops_token, peak_flops, device
        self.t_start, self.bar = time.time(), None
        self.rates: list[float] = []  # tokens/s of the steps since the last line
        self.paces: collections.deque = collections.deque(maxlen=PACE_STEPS + 1)  # (time, step) after each step
        self.board = _board(metrics_file.parent, start_step) if rank0 else None
        self.trackers = trackers  # (funcpar.cli.trackers.Trackers: wandb, MLflow)
        if rank0 and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=start_step, desc="train", dynamic_ncols=True)

    def line(self, step: int, row: dict[str, Any]) -> str:
        """The interval line for ``row`` (a metrics.jsonl row): rates over the steps since the last line."""
        tok_s = interval_rate(self.rates or [row.get("tokens_per_s", 0.0)])
        mfu = tok_s * self.flops_token / self.peak if self.peak > 0 else math.nan
        ev = f"  eval {row['eval_loss']:.4f} (ppl {row['eval_ppl']:.2f})" if "eval_loss" in row else ""
        return (f"step {step:5d}/{self.steps}  loss {row['loss']:.4f}{ev}  grad_norm {row['grad_norm']:.3f}  "
                f"lr {row['lr']:.2e}  {tok_s:.0f} tok/s  MFU {mfu:.0%}  mem {_peak_memory(self.device)}  "
                f"eta {self.eta(step):.0f}s")

    def eta(self, step: int) -> float:
        """Seconds left at ``step``: the pace of the last steps (the process's first step, start-up, left out once
        there are later ones), else of every step taken here."""
        if len(self.paces) >= 2:
            (t0, s0), (t1, s1) = self.paces[0], self.paces[-1]
            return eta_seconds(t1 - t0, s1 - s0, self.steps - step)
        return eta_seconds(time.time() - self.t_start, step - self.start_step, self.steps - step)

    def log(self, step: int, row: dict[str, Any]) -> None:
        """Append ``row`` to metrics.jsonl; print the interval line when due (above the bar on a terminal)."""
        if not self.rank0:
            return
        with open_own(self.metrics_file, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.board is not None:
            for key in ("loss", "eval_loss", "grad_norm", "lr", "tokens_per_s", "loss_scale", "bubble"):
                if key in row:
                    self.board.add_scalar(f"train/{key}" if key != "eval_loss" else "eval/loss", row[key], step)
        if self.trackers is not None:
            self.trackers.log(step, row)
        self.rates.append(row.get("tokens_per_s", 0.0))
        self.paces.append((time.time(), step))  # (after the first step: its end is the window's first mark)
        due = step % self.log_every == 0 or step == self.steps or "eval_loss" in row
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}")
            self.bar.update(1)
            if due:
                self.bar.write(self.line(step, row))
        elif due:
            print(self.line(step, row), flush=True)
        if due:
            self.rates = []

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.board is not None:
            self.board.close()
        if self.trackers is not None:
            self.trackers.close()


def _board(out: Path, start_step: int):
    """A TensorBoard writer into ``out/tensorboard`` when ``tensorboard`` is installed, else None (a resumed run
    drops the events after its checkpoint's step, as metrics.jsonl does)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the optional extra is not installed
        return None
    return SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)
