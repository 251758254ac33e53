"""Donated train state: the step's persistent flat buffers, as JAX's ``donate_argnums``.

The parameters of a train state live in one flat buffer per ZeRO bucket (the leaves are views into it), and under
mixed precision (or with the optimizer offloaded to the host) this rank's master parts in one flat buffer per bucket
too. A step updates these in place (the
optimizer its state as well) and all-gathers the new parameters straight into them, so a step holds no second copy
of the parameters, the masters or the optimizer state.

The state a step is given is therefore **consumed**: the step returns the new state, and the old one's tensors now
hold the new values. Passing a consumed state to the step again raises :class:`~funcpar.state.StepError` rather
than training on from numbers that are no longer what they were. A state the step did not produce (one built by
hand, loaded, or from another step) is copied into fresh buffers on first use. With ``donate=False`` every call
copies the state it is given first, so the old state stays valid (at the cost of that copy).
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from funcpar.parallel.layout import ZeroLayout
from funcpar.state import MixedState, StepError, TrainState

__all__ = ["StateBuffers"]


class StateBuffers:
    """The flat buffers behind the live train state of one step (see the module docstring)."""

    def __init__(self, layout: ZeroLayout, compute_dtype: torch.dtype | None, masters_on: torch.device | None):
        """``masters_on``: keep this rank's parts as separate master buffers on that device (mixed precision: fp32
        masters; offload: on the host), or ``None`` (the optimizer updates the parameter buffers' parts)."""
        self.layout, self.compute_dtype, self.masters_on = layout, compute_dtype, masters_on
        self.mixed = masters_on is not None  # whether the optimizer state is a MixedState(masters, inner)
        self.params: list[torch.Tensor] = []  # per bucket: whole local leaves, padded
        self.masters: list[torch.Tensor] = []  # per bucket, with masters: this rank's part (fp32 under mixed)
        self.views: list[torch.Tensor] = []  # per leaf: a view into `params`
        self.live: TrainState | None = None

    # --------------------------------------------------------------------------------------------- owning
    def own_params(self, leaves: list[torch.Tensor], whole: bool = True) -> None:
        """Copy local leaves into fresh parameter buffers (in the compute dtype). Where the layout holds parts
        (ZeRO-3) the buffers hold only this rank's parts (``whole``: the leaves given are whole local leaves, else
        their 1-D parts)."""
        lay = self.layout
        if lay.holds_parts:  # (the parts in the compute dtype: a mixed layout's buckets are its fp32 masters')
            parts = lay.param_slices(leaves) if whole else lay.slices_of(leaves)
            self.params = [p.to(self.compute_dtype) for p in parts] if self.compute_dtype else parts
            self.views = lay.views(self.params)
            return
        self.params = [lay.flat(b, leaves, self.compute_dtype or leaves[b.leaves[0]].dtype) for b in lay.buckets]
        self.views = [None] * len(lay.shapes)
        for b, buf in zip(lay.buckets, self.params, strict=True):
            for i, v in zip(b.leaves, lay.unpack(b, buf), strict=True):
                self.views[i] = v

    def own_masters(self, parts: list[torch.Tensor]) -> None:
        """Copy per-leaf master parts (1-D) into fresh per-bucket buffers on the masters' device (pinned host
        memory when they are offloaded from a GPU)."""
        pin = self.masters_on.type == "cpu" and torch.cuda.is_available()
        self.masters = [m.to(self.masters_on, copy=True).pin_memory() if pin else m.to(self.masters_on, copy=True)
                        for m in self.layout.slices_of(parts)]

    def params_tree(self) -> Any:
        return self.layout.unflatten(list(self.views))

    def masters_tree(self) -> Any:
        return self.layout.unflatten(self.layout.views(self.masters))

    def init(self, params: Any) -> tuple[Any, Any]:
        """Buffers for ``params`` (whole local leaves); returns ``(params tree, masters tree or None)``."""
        leaves = self.layout.treedef.flatten_up_to(params)
        if self.mixed:  # the masters from the given (fp32) values, before any rounding to the compute dtype
            parts = zip(leaves, self.layout.leaf_parts(), strict=True)
            self.own_masters([x.detach().reshape(-1)[a:z] for x, (a, z, _) in parts])
        self.own_params([x.detach() for x in leaves])
        return self.params_tree(), (self.masters_tree() if self.mixed else None)

    # ---------------------------------------------------------------------------------------------- using
    def _ours(self, leaves: list) -> bool:
        ptrs = {b.untyped_storage().data_ptr() for b in self.params}
        return any(isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in ptrs for x in leaves)

    def take(self, state: TrainState, donate: bool) -> Any:
        """Make the buffers hold ``state`` for an in-place step; returns the optimizer state to update in place."""
        leaves = self.layout.treedef.flatten_up_to(state.params)
        live = self.live is not None and state.params is self.live.params
        if donate and not live and self._ours(leaves):
            raise StepError(
                f"this train state (step {state.step}) was consumed by an earlier call of the step, which updated "
                f"its tensors in place: pass the state the step returned (`state, metrics = step(state, batch)`), "
                f"or build the step with donate=False to keep old states valid"
            )
        opt_state = state.opt_state
        if not donate:
            opt_state = optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, opt_state)
        if not (donate and live):
            self.own_params(leaves, whole=not self.layout.holds_parts)
        if self.mixed:
            masters = self.layout.treedef.flatten_up_to(opt_state.master)
            mine = {m.untyped_storage().data_ptr() for m in self.masters}
            if not donate or not all(x.untyped_storage().data_ptr() in mine and x.device == self.masters_on
                                     for x in masters if x.numel()):
                self.own_masters(masters)
            opt_state = opt_state.inner
        return opt_state

    def part_slices(self) -> list[torch.Tensor]:
        """Per bucket, this rank's part of the weights the optimizer updates (views, updated in place)."""
        if self.mixed:
            return self.masters
        if self.layout.holds_parts:
            return self.params
        return [buf[b.lo : b.hi] for b, buf in zip(self.layout.buckets, self.params, strict=True)]

    def publish(self) -> None:
        """After the update: the new parameters in every rank's buffers (compute copies of the masters, gathered)."""
        lay = self.layout
        if lay.holds_parts:  # the parts are the parameters, gathered block by block inside the loss: only new copies
            for buf, master in zip(self.params, self.masters if self.mixed else (), strict=False):
                buf.copy_(master)
            return
        for k, (b, buf) in enumerate(zip(lay.buckets, self.params, strict=True)):
            if self.mixed:
                buf[b.lo : b.hi].copy_(self.masters[k])
            lay.gather_into(b, buf)

    def state(self, opt_inner: Any, step: int) -> TrainState:
        """The new live state: fresh trees over the same buffers."""
        opt_state = MixedState(self.masters_tree(), opt_inner) if self.mixed else opt_inner
        self.live = TrainState(self.params_tree(), opt_state, step)
        return self.live
