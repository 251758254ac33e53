"""The step's gradient phase, one implementation per mode: :class:`Plain` (ZeRO 0-2), :class:`Zero3`,
:class:`Pipelined` and :class:`StagedZero3` (ZeRO-3 on pipeline stages). The step picks one at ``init`` and from
then on reads every mode alike.

Each mode takes this rank's micro-batches with their shares of the global batch and returns this rank's gradient
parts, one per ZeRO bucket of the layout and summed over the data axes, with the weighted loss and the auxiliary
outputs. Each also says how the step, in that mode, differentiates (the parameters it hands the gradient), counts the
gradient norm, evaluates a loss and gathers whole parameters. Private to :mod:`funcpar.train.step`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from funcpar.parallel.layout import ZeroLayout
from funcpar.state import TrainState
from funcpar.train.zero3 import gather_params


class Mode:
    """What every mode shares: the layout, the per-micro-batch gradient ``grad(params, batch, weight) -> (grads,
    (loss, aux))`` (aux only where ``has_aux``) and the objective it differentiates, ``objective(params, batch)``."""

    per_leaf_norm = False  # the gradient norm counted per leaf (True), or per bucket (each element once either way)

    def __init__(self, layout: ZeroLayout, objective: Callable, grad: Callable, has_aux: bool):
        self.layout, self.objective, self.grad, self.has_aux = layout, objective, grad, has_aux

    def params(self, buffers) -> Any:
        """What the gradient differentiates, from the step's buffers: the parameter tree."""
        return buffers.params_tree()

    def replicated(self, state: TrainState) -> Any:
        """The parameters the first step's consistency check compares across the model axes (None: none)."""
        return state.params

    def whole(self, state: TrainState) -> Any:
        """Whole local leaves of ``state``'s parameters (for export and evaluation)."""
        return state.params

    def evaluate(self, state: TrainState, batch: Any, requires_grad: bool) -> torch.Tensor:
        """The objective on ``state``'s parameters and ``batch``; the graph kept where ``requires_grad``."""
        params = self.layout.unflatten(_leaves(self.layout.treedef.flatten_up_to(state.params), requires_grad))
        return self._objective_loss(params, batch, requires_grad)

    def _objective_loss(self, params, batch, requires_grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(requires_grad):
            out = self.objective(params, batch)
        return out[0] if self.has_aux else out

    def _micro_batches(self, params, micro: list, shares: list[float], scale: torch.Tensor, add: Callable):
        """Run the gradient on each micro-batch (the objective scaled by its share), handing each result to
        ``add`` in a list it empties (so that nothing else holds the gradients while ``add`` frees them); returns
        the weighted loss (float64, on the host) and the auxiliary outputs."""
        loss_sum, auxes = torch.zeros((), dtype=torch.float64), []
        for mb, share in zip(micro, shares, strict=True):
            # the weight as a tensor: a Python float would be a constant to torch.compile (a recompile per value)
            grads, (_, out) = self.grad(params, mb, torch.tensor(share, dtype=torch.float32) * scale)
            loss, aux = out if self.has_aux else (out, None)
            auxes.append(aux)
            loss_sum += loss.detach().double().cpu() * share
            box = [grads]
            del grads
            add(box)
        return loss_sum, auxes


class Plain(Mode):
    """ZeRO 0-2: each micro-batch's gradient tree copied into the buckets; the buckets reduced over the data axes as
    soon as they are full where ``eager`` (ZeRO-2, or ZeRO-1 with one micro-batch: reducing before or after a loop
    of one is the same sum), else once after the last micro-batch."""

    def __init__(self, layout: ZeroLayout, objective: Callable, grad: Callable, has_aux: bool, eager: bool):
        super().__init__(layout, objective, grad, has_aux)
        self.eager = eager

    def accumulate(self, params, micro: list, shares: list[float], scale: torch.Tensor):
        lay = self.layout
        acc: list = [None] * len(lay.buckets)

        def add(box):
            g_leaves = lay.treedef.flatten_up_to(box.pop())  # each leaf's gradient is dropped once in its bucket
            flats = [  # (reduced from the leaves where they lie: no flat copy on host)
                lay.reduce_leaves(b, g_leaves) if self.eager else lay.flat(b, g_leaves, free=True) for b in lay.buckets]
            acc[:] = [f if a is None else a.add_(f) for a, f in zip(acc, flats, strict=True)]

        loss_sum, auxes = self._micro_batches(params, micro, shares, scale, add)
        parts = acc if self.eager else [lay.reduce(b, f) for b, f in zip(lay.buckets, acc, strict=True)]
        return parts, loss_sum, auxes


class _Parts:
    """What the ZeRO-3 modes share: the step hands the gradient this rank's parts, one per unit (float32 ones under
    mixed precision or offload, so the gathers' backward hands back float32 gradients: :mod:`funcpar.train.zero3`), the
    gathers' backward sums them over the data axes, and the norm is counted per leaf (a unit mixes leaves sharded
    and replicated over the model axes)."""

    per_leaf_norm = True

    def params(self, buffers) -> Any:
        if not buffers.mixed:
            return buffers.params
        return [m if m.device == p.device else p.float() for p, m in zip(buffers.params, buffers.masters, strict=True)]

    def replicated(self, state: TrainState) -> Any:
        return None  # (the parts differ across the data axes)

    def parts(self, state: TrainState) -> list[torch.Tensor]:
        """``state``'s parts, one per unit, each in its leaves' dtype (a mixed layout's buckets are float32)."""
        leaves, lay = self.layout.treedef.flatten_up_to(state.params), self.layout
        return [p.to(leaves[b.leaves[0]].dtype) for b, p in zip(lay.buckets, lay.slices_of(leaves), strict=True)]

    def whole(self, state: TrainState) -> Any:
        return gather_params(self.layout, self.parts(state))


class Zero3(_Parts, Mode):
    """ZeRO-3: the objective (a :class:`funcpar.train.zero3.Zero3Loss`) takes this rank's parts and gathers each unit's
    leaves as it needs them; its gradients are the parts' own."""

    def evaluate(self, state: TrainState, batch: Any, requires_grad: bool) -> torch.Tensor:
        return self._objective_loss(_leaves(self.parts(state), requires_grad), batch, requires_grad)

    def accumulate(self, params, micro: list, shares: list[float], scale: torch.Tensor):
        acc: list = []

        def add(box):
            grads = box.pop()
            acc[:] = grads if not acc else [a.add_(g) for a, g in zip(acc, grads, strict=True)]

        loss_sum, auxes = self._micro_batches(params, micro, shares, scale, add)
        return acc, loss_sum, auxes


class Pipelined(Mode):
    """A ``pp`` mesh: every micro-batch through the pipeline's schedule (:class:`funcpar.pipeline.executor.Executor`),
    then one reduction per bucket. The norm is counted per leaf: a tied leaf counts on one stage."""

    per_leaf_norm = True

    def __init__(self, layout: ZeroLayout, objective: Callable, pipe, has_aux: bool):
        super().__init__(layout, objective, None, has_aux)
        self.pipe = pipe

    def evaluate(self, state: TrainState, batch: Any, requires_grad: bool) -> torch.Tensor:
        return self.pipe.evaluate(state.params, batch)  # forward through every stage; the loss on every rank

    def accumulate(self, params, micro: list, shares: list[float], scale: torch.Tensor):
        g_leaves, loss_sum = self.pipe.run(params, micro, shares, scale)
        return [self.layout.reduce_leaves(b, g_leaves) for b in self.layout.buckets], loss_sum, []


class StagedZero3(_Parts, Pipelined):
    """ZeRO-3 on a pipeline stage: the executor takes this stage's parts and gathers each unit as it runs it
    (:class:`funcpar.train.zero3.StageGather`); its gradients are the parts' own, a tied unit's summed over the first
    and last stage."""

    def evaluate(self, state: TrainState, batch: Any, requires_grad: bool) -> torch.Tensor:
        return self.pipe.evaluate(self.parts(state), batch)

    def accumulate(self, params, micro: list, shares: list[float], scale: torch.Tensor):
        grads, loss_sum = self.pipe.run(params, micro, shares, scale)
        return grads, loss_sum, []


def _leaves(leaves: list, requires_grad: bool) -> list:
    """``leaves`` detached, as leaves of a new graph where ``requires_grad`` (floating point ones only)."""
    return [x.detach().requires_grad_(requires_grad and x.is_floating_point()) for x in leaves]
