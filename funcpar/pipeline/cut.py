"""Cutting a model's layers into pipeline stages: contiguous runs of blocks (or half-blocks), evenly or by weight.

:func:`assign_layers` splits whole layers evenly (or by given sizes); :func:`assign_units` cuts *units* (layers, or
halves of layers: attention, MLP) by given sizes in layers or so that the stages' summed unit weights balance.
:mod:`funcpar.pipeline.schedule` re-exports both with :class:`PipelineError`. Only the standard library is imported
here.
"""

from __future__ import annotations

import itertools
import numbers
from typing import Sequence

__all__ = ["PipelineError", "assign_layers", "assign_units"]


class PipelineError(ValueError):
    """A pipeline plan that cannot work: bad sizes, an incomplete or misordered schedule, a deadlock."""


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def assign_layers(n_layers: int, stages: int, parts: list[int] | None = None) -> list[range]:
    """The block indices each (virtual) stage holds, contiguous and in order.

    By default the split is balanced, earlier stages taking the extra layer (10 layers over 4 stages: 3, 3, 2, 2).
    ``parts`` gives the sizes instead: ``stages`` entries of at least 1 summing to ``n_layers``.
    """
    if stages < 1:
        raise PipelineError(f"a pipeline needs at least 1 stage, got {stages}")
    if stages > n_layers:
        raise PipelineError(f"{plural(stages, 'pipeline stage')} but the model has only "
                            f"{plural(n_layers, 'layer')}: each stage needs at least one")
    if parts is None:
        base, extra = divmod(n_layers, stages)
        sizes = [base + (1 if s < extra else 0) for s in range(stages)]
    else:
        sizes = list(parts)
        if len(sizes) != stages:
            raise PipelineError(f"parts has {plural(len(sizes), 'entry', 'entries')} for {plural(stages, 'stage')}")
        for s, size in enumerate(sizes):
            if size < 1:
                raise PipelineError(f"parts[{s}] is {size}: stage {s} needs at least one layer (parts {sizes})")
        if sum(sizes) != n_layers:
            raise PipelineError(f"parts {sizes} sum to {sum(sizes)} but the model has "
                                f"{plural(n_layers, 'layer')}")
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def assign_units(n_layers: int, stages: int, costs: Sequence[float] | None = None, parts: list | None = None,
                 halves: bool = False) -> list[range]:
    """The *units* each (virtual) stage holds, contiguous and in order: a unit is a layer or, with ``halves``, half of
    one (unit ``2 i`` is layer ``i``'s first half, ``2 i + 1`` its second).

    ``parts`` gives each stage's size in layers (with ``halves`` in steps of 0.5: ``[2.5, 1.5]``). Otherwise, given
    ``costs`` (one per unit, the last including what comes after the blocks, such as the LM head), the split balances
    them: cut ``k`` falls at the unit boundary whose running cost is nearest ``k / stages`` of the total, every stage
    keeping at least one unit. Without costs (or with none positive), :func:`assign_layers`'s even split.
    """
    n = n_layers * (2 if halves else 1)
    if stages < 1:
        raise PipelineError(f"a pipeline needs at least 1 stage, got {stages}")
    if 1 <= n < stages:
        what = f"{plural(n_layers, 'layer')}" + (f" ({n} halves)" if halves else "")
        raise PipelineError(f"{plural(stages, 'pipeline stage')} but the model has only {what}: each stage needs "
                            f"at least one" + (" half" if halves else ""))
    if parts is not None and halves:
        units = []
        for s, size in enumerate(parts):
            if not isinstance(size, numbers.Real) or not float(size * 2).is_integer():
                raise PipelineError(f"parts[{s}] is {size!r}: a stage holds whole layers or halves of them "
                                    f"(parts {list(parts)})")
            units.append(int(size * 2))
        if len(units) == stages and sum(units) == n and min(units) < 1:
            s = units.index(min(units))
            raise PipelineError(f"parts[{s}] is {parts[s]}: stage {s} needs at least one layer or half of one "
                                f"(parts {list(parts)})")
        if len(units) == stages and sum(units) != n:
            raise PipelineError(f"parts {list(parts)} sum to {sum(parts)} but the model has "
                                f"{plural(n_layers, 'layer')}")
        return assign_layers(n, stages, units)
    if parts is not None:
        for s, size in enumerate(parts):
            if not isinstance(size, numbers.Real) or not float(size).is_integer():
                raise PipelineError(f"parts[{s}] is {size!r}: this model's stages hold whole layers (its staged "
                                    f"form has no halves) (parts {list(parts)})")
        return assign_layers(n_layers, stages, [int(x) for x in parts])
    if costs is None or len(costs) != n or not sum(costs) > 0:
        return assign_layers(n, stages)
    cum = list(itertools.accumulate(costs))
    bounds = [0]
    for k in range(1, stages):
        target = cum[-1] * k / stages
        options = range(bounds[-1] + 1, n - (stages - k) + 1)  # units before cut k; later stages keep one each
        bounds.append(min(options, key=lambda c: (abs(cum[c - 1] - target), c)))
    bounds.append(n)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]
