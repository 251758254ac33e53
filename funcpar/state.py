"""The train step's data: its state, the mixed-precision optimizer state, and its error."""

from __future__ import annotations

from typing import Any, NamedTuple


__all__ = ["TrainState", "MixedState", "StepError", "Handoff"]


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



class Handoff:
    """A parameter tree handed to ``step.init`` with the caller's only reference (``step.init(Handoff(params))``):
    init takes the tree out, so its leaves are freed as soon as the step has copied them into its buffers, before
    the optimizer state is made. A tree passed directly can stay alive until init returns, because the interpreter
    may keep a call's arguments on the caller's stack: CPython 3.10 always does, and 3.11+ does once a
    ``torch.compile`` has failed in the process (the frame hook it leaves installed turns off its inlined calls).
    Init would then hold the whole tree beside the optimizer state."""

    __slots__ = ("_tree",)

    def __init__(self, tree: Any):
        self._tree = [tree]

    def take(self) -> Any:
        """The tree, once: the handoff is empty afterwards."""
        if not self._tree:
            raise StepError("this Handoff was taken already: hand each init a new one")
        return self._tree.pop()
