"""The step's modes, one class each: :class:`Plain` (ZeRO 0-2), :class:`Zero3`, :class:`Pipelined` and
:class:`StagedZero3` (ZeRO-3 on pipeline stages). :func:`choose` picks one when the step is built; from then on the
step reads every mode alike, and every branch on ZeRO-3 or pipeline stages lives here.

A mode owns the objective it differentiates and its per-micro-batch gradient, the rank's share of the parameters
(a pipeline stage's tree), the layout's units (ZeRO-3's blocks), and then, once :meth:`Mode.bind` hands it the
layout: the gradient phase (this rank's micro-batches in, its gradient parts out, one per ZeRO bucket, summed over
the data axes, with the weighted loss and the auxiliary outputs), how the gradient norm counts each leaf, how a loss
is evaluated and whole parameters gathered, what a checkpoint must know of the stages, and its metrics.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from funcpar.model import Loss
from funcpar.parallel.layout import ZeroLayout
from funcpar.spec import broadcast_specs
from funcpar.state import StepError, TrainState
from funcpar.train.config import StepOptions
from funcpar.train.options import Gradient, check_zero3, pipeline_executor
from funcpar.train.zero3 import StageGather, Zero3Loss, gather_params, stage_units, units_of
from funcpar.tree import leaves_with_path


def choose(loss: Loss, mesh, options: StepOptions, compile) -> "Mode":
    """The mode of a step of ``loss`` on ``mesh`` with ``options`` (its options refused here where the mode cannot
    take them); ``compile`` as :func:`funcpar.train.options.resolve_compile` resolved it."""
    zero, o = options.parallel.zero, options
    check_zero3(loss, zero)
    if loss.model is not None and loss.model.check_run is not None:  # (what the model refuses, before step 1)
        loss.model.check_run(loss.cfg, mesh, staged=zero == 3 or mesh.axis_size("pp") > 1 or loss.remat)
    pipe = pipeline_executor(loss, mesh, zero, o.accum_steps, o.has_aux, compile, o.pipelining)
    if pipe is not None:
        return (StagedZero3 if zero == 3 else Pipelined)(loss, mesh, options, compile, pipe)
    if zero == 3:
        return Zero3(loss, mesh, options, compile)
    return Plain(loss, mesh, options, compile)


class Mode:
    """What every mode shares: the loss, the objective it differentiates (``objective(params, batch)``) and the
    per-micro-batch gradient ``grad(params, batch, weight) -> (grads, (loss, aux))`` (aux only where ``has_aux``)."""

    per_leaf_norm = False  # the gradient norm counted per leaf (True), or per bucket (each element once either way)
    executor = None  # the pipeline executor of a pp mesh

    def __init__(self, loss: Loss, mesh, options: StepOptions, compile):
        self.loss, self.mesh, self.options, self.has_aux = loss, mesh, options, options.has_aux
        self.objective = loss.fn  # (ZeRO-3 replaces it with the gathering loss once the layout exists)
        self.gradient = Gradient.of(compile, self.scaled_loss)
        self.grad: Callable = self.gradient
        self.layout: ZeroLayout | None = None

    def scaled_loss(self, params, batch, scale):
        """The objective times ``scale`` (a micro-batch's share, times the loss scale), and its value detached."""
        out = self.objective(params, batch)
        loss, aux = out if self.has_aux else (out, None)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise StepError(f"loss_fn must return a scalar tensor (use .mean() or .sum()); it returned {shape}")
        return loss * scale, ((loss.detach(), aux) if self.has_aux else loss.detach())

    # ------------------------------------------------------------------------------ before the layout exists
    def select(self, params: Any) -> Any:
        """This rank's parameter tree, from the local leaves it was given (a pipeline stage keeps its own)."""
        return params

    def units(self, params: Any, specs: Any) -> list[list[int]] | None:
        """The layout's units (lists of leaf indices, gathered together), or ``None``: buckets by size."""
        return None

    def bind(self, layout: ZeroLayout) -> None:
        """Take the step's layout (built from :meth:`select` and :meth:`units`)."""
        self.layout = layout

    # -------------------------------------------------------------------------------------------- counting
    def counted(self, params: Any) -> list[bool]:
        """Per leaf of the layout, whether this rank counts its gradient in the global norm: the rank at
        coordinate 0 of every axis the leaf's part is copied over."""
        return [all(self.mesh.coord(a) == 0 for a in copies) for _, _, copies in self.layout.leaf_parts()]

    def uncounted(self, params: Any) -> list[bool] | None:
        """Per leaf, whether another stage writes it to a checkpoint (a tied leaf), or ``None``: none."""
        return None

    def known_paths(self) -> list[str] | None:
        """The paths of the whole model's leaves where this rank holds only some (a pipeline stage), else None."""
        return None

    def holds(self, path: str) -> bool:
        """Whether this rank holds the parameter at ``path``."""
        return True

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes besides the model axes whose ranks are fed the same batch."""
        return ()

    def bubble(self) -> float:
        """This rank's share of the last step's time spent waiting for a peer."""
        return 0.0

    def metrics(self, bubble: float) -> dict:
        """The mode's own metrics of a step, given the mean ``bubble`` over ranks."""
        return {}

    # ------------------------------------------------------------------------------------------- the phases
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

    def __init__(self, loss: Loss, mesh, options: StepOptions, compile):
        super().__init__(loss, mesh, options, compile)
        zero = options.parallel.zero
        self.eager = zero == 2 or (zero == 1 and options.accum_steps == 1)

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
    """What the ZeRO-3 modes share: the layout's units are the model's blocks, the step hands the gradient this
    rank's parts, one per unit (float32 ones under mixed precision or offload, so the gathers' backward hands back
    float32 gradients: :mod:`funcpar.train.zero3`), the gathers' backward sums them over the data axes, and the norm
    is counted per leaf (a unit mixes leaves sharded and replicated over the model axes)."""

    per_leaf_norm = True

    def _paths(self, params: Any, specs: Any) -> list[str]:
        return [p for p, _, _ in broadcast_specs(specs, params)]

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

    def units(self, params: Any, specs: Any) -> list[list[int]]:
        units, self._blocks = units_of(self._paths(params, specs), self.loss.stages, self.loss.cfg)
        return units

    def bind(self, layout: ZeroLayout) -> None:
        super().bind(layout)
        o = self.options
        self.objective = Zero3Loss(layout, self.loss.stages, self.loss.cfg, self.loss.mesh, o.parallel.data_axes,
                                   self._blocks, o.precision.param_dtype)

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
    then one reduction per bucket. The norm is counted per leaf: a tied leaf counts on the first stage only."""

    per_leaf_norm = True

    def __init__(self, loss: Loss, mesh, options: StepOptions, compile, executor):
        super().__init__(loss, mesh, options, compile)
        self.executor = executor

    def select(self, params: Any) -> Any:
        return self.executor.plan.select(params)  # None for the leaves other stages hold

    def counted(self, params: Any) -> list[bool]:
        return [c and not u for c, u in zip(super().counted(params), self.uncounted(params), strict=True)]

    def uncounted(self, params: Any) -> list[bool]:
        return self.executor.uncounted(params)

    def known_paths(self) -> list[str]:
        return [p for p, _ in leaves_with_path(self.executor.plan.shapes)]

    def holds(self, path: str) -> bool:
        return self.executor.plan.holds_path(path)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return ("pp",)

    def bubble(self) -> float:
        return self.executor.metrics["bubble"]

    def metrics(self, bubble: float) -> dict:
        """The share of rank-time spent waiting for a peer (the mean over ranks); micro-batches held at once."""
        return {"bubble": bubble, "in_flight": self.executor.metrics["in_flight"]}

    def evaluate(self, state: TrainState, batch: Any, requires_grad: bool) -> torch.Tensor:
        return self.executor.evaluate(state.params, batch)  # forward through every stage; the loss on every rank

    def accumulate(self, params, micro: list, shares: list[float], scale: torch.Tensor):
        g_leaves, loss_sum = self.executor.run(params, micro, shares, scale)
        return [self.layout.reduce_leaves(b, g_leaves) for b in self.layout.buckets], loss_sum, []


class StagedZero3(_Parts, Pipelined):
    """ZeRO-3 on a pipeline stage: the executor takes this stage's parts and gathers each unit as it runs it
    (:class:`funcpar.train.zero3.StageGather`); its gradients are the parts' own, a tied unit's summed over the first
    and last stage."""

    def units(self, params: Any, specs: Any) -> list[list[int]]:
        plan = self.executor.plan
        units, self._roles = stage_units(self._paths(params, specs), self.loss.stages, self.loss.cfg, plan.tied)
        return units

    def bind(self, layout: ZeroLayout) -> None:
        super().bind(layout)
        o = self.options
        self.executor.zero3 = StageGather(layout, self.loss.stages, self.loss.cfg, self.loss.mesh,
                                          o.parallel.data_axes, self._roles, o.precision.param_dtype)

    def evaluate(self, state: TrainState, batch: Any, requires_grad: bool) -> torch.Tensor:
        return self.executor.evaluate(self.parts(state), batch)

    def accumulate(self, params, micro: list, shares: list[float], scale: torch.Tensor):
        grads, loss_sum = self.executor.run(params, micro, shares, scale)
        return grads, loss_sum, []


def _leaves(leaves: list, requires_grad: bool) -> list:
    """``leaves`` detached, as leaves of a new graph where ``requires_grad`` (floating point ones only)."""
    return [x.detach().requires_grad_(requires_grad and x.is_floating_point()) for x in leaves]
