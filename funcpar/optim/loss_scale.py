"""Loss scaling and non-finite steps as an optimizer wrapper, in the spirit of optax's ``apply_if_finite``.

``apply_if_finite(inner, scale=..., dynamic=...)`` holds the loss scale in its state. The caller (the train step)
multiplies the loss by :func:`loss_scale` of the state, divides the gradients by it, and passes ``finite=`` (whether
every gradient element on every rank is finite; a sharded step reduces it over the mesh), so the wrapper is an
:class:`~funcpar.optim.base.InPlaceTransformation` whatever ``inner`` is. On a non-finite step it returns no updates
(every leaf :data:`~funcpar.optim.base.ABSENT`), keeps the inner state and, when ``dynamic``, halves the scale; after
``growth_interval`` finite steps in a row it doubles it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from funcpar.optim.base import (ABSENT, NOTHING, GradientTransformation, InPlace, InPlaceTransformation, leaves,
                                schedule_of, update_with)


class LossScaleState(NamedTuple):
    scale: torch.Tensor  # float32 scalar
    good_steps: torch.Tensor  # int64 scalar: finite steps since the scale last changed
    inner: Any


def loss_scale(state: Any) -> torch.Tensor:
    """The loss scale held by an :func:`apply_if_finite` state (1 for any other state)."""
    return state.scale if isinstance(state, LossScaleState) else torch.ones((), dtype=torch.float32)


def _all_finite(grads: Any) -> bool:
    xs = leaves(grads)
    return bool(torch.stack([torch.isfinite(x).all() for x in xs]).all()) if xs else True


def apply_if_finite(
    inner: GradientTransformation,
    scale: float = 2.0**16,
    dynamic: bool = True,
    growth_interval: int = 2000,
) -> InPlaceTransformation:
    """``inner`` on steps whose gradients are finite; skip (no update) the others and adapt the scale."""
    if not scale > 0 or scale != scale or scale == float("inf"):
        raise ValueError(f"apply_if_finite: scale must be a positive finite number, got {scale!r}")

    def init(params):
        return LossScaleState(torch.tensor(float(scale), dtype=torch.float32), torch.zeros((), dtype=torch.int64),
                              inner.init(params))

    def update(grads, state, params=None, *, finite=None, inplace: InPlace = NOTHING, **extra):
        if finite is None:
            finite = _all_finite(grads)
        if not finite:
            skipped = optree.tree_map(lambda _: ABSENT, grads)
            new_scale = state.scale * 0.5 if dynamic else state.scale
            return skipped, LossScaleState(new_scale, torch.zeros((), dtype=torch.int64), state.inner)
        # (never into the params: a skipped step's ABSENT updates are this update's to return)
        updates, new_inner = update_with(inner, grads, state.inner, params, inplace=inplace._replace(params=False),
                                         **extra)
        good, new_scale = state.good_steps + 1, state.scale
        if dynamic and int(good) >= growth_interval:
            new_scale, good = state.scale * 2.0, torch.zeros((), dtype=torch.int64)
        return updates, LossScaleState(new_scale, good, new_inner)

    def fresh(fresh_in: bool) -> bool:  # the inner update's outputs, or ABSENT leaves: private when the inner ones are
        return bool(isinstance(inner, InPlaceTransformation) and inner.fresh is not None and inner.fresh(fresh_in))

    return InPlaceTransformation(init, update, schedule=schedule_of(inner), fresh=fresh)
