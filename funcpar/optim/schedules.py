"""Learning-rate schedules: functions of the step number (0 for the first update) returning a float."""

from __future__ import annotations

import math
from typing import Any, Callable

Schedule = Callable[[int], float]


def check_hyper(where: str, name: str, value: Any, lo: float = 0.0, hi: float = math.inf,
                hi_open: bool = False, lo_open: bool = False) -> None:
    """Raise a ValueError naming ``where``'s hyper-parameter unless ``value`` is a finite number in the range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        lo_s, hi_s = ("(" if lo_open else "[") + f"{lo:g}", f"{hi:g}" + (")" if hi_open or hi == math.inf else "]")
        raise ValueError(f"{where}: {name}={value!r} is not a finite number in {lo_s}, {hi_s}")


def constant(value: float) -> Schedule:
    check_hyper("constant", "value", value)
    return lambda step: float(value)


def warmup_cosine(peak: float, warmup: int, total: int, end: float = 0.0, start: float = 0.0) -> Schedule:
    """Linear warm-up from ``start`` to ``peak`` over ``warmup`` steps, then a cosine decay to ``end`` at ``total``."""
    for name, v in (("peak", peak), ("end", end), ("start", start), ("warmup", warmup)):
        check_hyper("warmup_cosine", name, v)
    if total <= warmup:
        raise ValueError(f"warmup_cosine: total={total} must exceed warmup={warmup}")

    def lr(step: int) -> float:
        if step < warmup:
            return start + (peak - start) * step / warmup
        t = min(step - warmup, total - warmup) / (total - warmup)
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))

    return lr


def warmup_linear_decay(
    peak: float, warmup: int, total: int, min_lr: float = 0.0, warmup_type: str = "log"
) -> Schedule:
    """DeepSpeed's WarmupDecayLR: warm-up from ``min_lr`` to ``peak`` over ``warmup`` steps (``"log"``: in proportion
    to ``log(step+1)/log(warmup)``, DeepSpeed's default; or ``"linear"``: ``step/warmup``), then linear decay of the
    factor to 0 at ``total``."""
    for name, v in (("peak", peak), ("min_lr", min_lr), ("warmup", warmup), ("total", total)):
        check_hyper("warmup_linear_decay", name, v)
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")

    def gamma(step: int) -> float:
        if step < warmup:
            if warmup_type == "log":
                return math.log(step + 1) / math.log(warmup) if warmup > 1 else 1.0
            return step / warmup
        return max(0.0, (total - step) / max(1.0, total - warmup))

    return lambda step: min_lr + (peak - min_lr) * gamma(step)
