"""The train step's data: its state, the mixed-precision optimizer state, and its error."""

from __future__ import annotations

from typing import Any, NamedTuple


__all__ = ["TrainState", "MixedState", "StepError"]


class StepError(ValueError):
    """A train step that cannot run as asked: batch sizes, loss shape, specs, inconsistent data."""


class TrainState(NamedTuple):
    params: Any  # this rank's local shards, the structure of the model's params
    opt_state: Any  # the optimizer's state over this rank's ZeRO part of each leaf (1-D)
    step: int  # updates done


class MixedState(NamedTuple):
    """Optimizer state of a mixed-precision step: fp32 master weights (this rank's ZeRO parts, a params-shaped tree
    of 1-D tensors) and the optimizer's own state over them (which holds the loss scale, when there is one)."""

    master: Any
    inner: Any

