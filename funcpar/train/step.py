"""``compile_step``: the whole sharded train step from a pure per-shard loss function.

The state lives in the step's flat buffers and a call consumes the state it is given (:mod:`funcpar.train.buffers`):
``state, metrics = step(state, batch)`` keeps the functional form at the memory of an in-place loop.

A step reads as accumulate -> reduce -> update -> gather:

- **accumulate**: gradients (:func:`funcpar.nn.remat.grad_and_value`) over ``accum_steps`` micro-batches, each
  micro-batch's loss weighted by its share of the global batch's weight (``weight_fn``: by default the weight the loss
  function carries, e.g. a language model's target-token count, else rows), so the result is exactly the loss of the
  global batch as one process would compute it;
- **reduce**: per ZeRO bucket (:mod:`funcpar.parallel.layout`), the sum over the data axes; the global gradient norm
  over every shard, each element counted once;
- **update**: the optimizer (clipping, loss scaling as wrappers) on this rank's part, fused where it can be (AdamW);
- **gather**: the updated parts all-gathered back into whole local leaves.

The step's branches live in its mode (:mod:`funcpar.train.modes`, chosen once when the step is built), one class each:
``Plain`` for ``zero`` 0-2 (``zero=0``: all-reduce over the data axes, every rank updates its whole local leaves;
``zero=1``: micro-batch gradients accumulated locally, then one reduce-scatter per bucket; ``zero=2``:
reduce-scatter after every micro-batch, only the local part kept), ``Zero3`` (the parts gathered unit by unit,
:mod:`funcpar.train.zero3`), ``Pipelined`` (a ``pp`` mesh, :mod:`funcpar.pipeline.executor`) and ``StagedZero3``.
Each returns the same bucket parts, so reduce, update and gather read every mode alike; each phase returns what the
next one reads. The non-finite policy is :class:`funcpar.train.options.NonfinitePolicy`, which takes values and owns
its count of skipped steps.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Callable, NamedTuple

import optree
import torch

from funcpar.io import checkpoint
from funcpar.io.atomic import agree
from funcpar.model import Loss
from funcpar.optim import (ABSENT, EVERYTHING, WRITTEN, GradientTransformation, adamw, masked, schedule_of,
                           update_with)
from funcpar.optim.loss_scale import loss_scale
from funcpar.parallel import collectives as C
from funcpar.parallel.layout import ZeroLayout
from funcpar.parallel.mesh import Mesh
from funcpar.state import Handoff, MixedState, StepError, TrainState
from funcpar.train import hostmem
from funcpar.train.batching import batch_drift, batch_items, check_consistency, drifted, rows as _rows, split as _split
from funcpar.train.buffers import StateBuffers
from funcpar.train.config import StepOptions
from funcpar.train.modes import choose
from funcpar.train.norms import sums_of_squares
from funcpar.train.options import NonfinitePolicy, check_data_axes, resolve_compile, wrapped_optimizer
from funcpar.train.zero3 import gather_params

__all__ = ["compile_step", "Step", "TrainState", "MixedState", "StepError", "default_optimizer"]


def default_optimizer() -> GradientTransformation:
    """The optimizer ``compile_step`` uses when given none: ``adamw(1e-3, weight_decay=0.01)``, the defaults of
    ``torch.optim.AdamW`` (every leaf decayed, as torch's single parameter group)."""
    return adamw(1e-3, weight_decay=0.01)


class Statistics(NamedTuple):
    """What the reduce phase knows of a step, alike on every rank: the global gradient norm, the global loss,
    whether every gradient is finite, the pipeline's bubble (the mean over ranks), and whether a model-axis group's
    batches differ."""

    norm: torch.Tensor
    loss: float
    finite: bool
    bubble: float
    drifted: bool


class Step:
    """A compiled train step: ``state = step.init(params)``, ``state, metrics = step(state, batch)``.

    A call consumes the state it is given (``donate=True``, the default: its buffers are updated in place, and the
    consumed state passed again raises) and returns the new one; ``donate=False`` copies the state first and leaves
    the old one valid. See :func:`compile_step` for the options, kept as :attr:`options`.
    """

    def __init__(self, loss_fn: Callable, specs: Any, options: StepOptions | None = None):
        o = self.options = options if options is not None else StepOptions()
        self.mesh = mesh = o.mesh if o.mesh is not None else Mesh.current()
        self.loss_fn = loss = Loss.of(loss_fn)  # what the loss carries (model, remat, batch weight, check), as fields
        self.specs = specs
        par = o.parallel
        check_data_axes(mesh, par.data_axes)
        compile, reason = resolve_compile(o.compile, mesh, par.zero, par.offload, loss, par.data_axes)
        self.nonfinite = NonfinitePolicy(o.guards, scaled=o.precision.scaling is not None)
        self.weight_fn = o.weight_fn if o.weight_fn is not None else loss.batch_weight
        self.model_axes = tuple(a for a in mesh.axis_names if a != "pp" and a not in par.data_axes)
        base = o.optimizer if o.optimizer is not None else default_optimizer()
        self.schedule = schedule_of(base)  # (the learning rate the metrics report; None: none reported)
        if loss.frozen is not None and any(optree.tree_leaves(loss.frozen)):  # (leaves no gradient reaches: left
            base = masked(base, optree.tree_map(lambda f: not f, loss.frozen))  # alone, as torch's optimizers do)
        self.optimizer = wrapped_optimizer(base, o.clip_norm, o.precision)
        self.mode = choose(loss, mesh, o, compile)  # the one dispatch on the mode: every branch on it lives there
        self.mode.gradient.reason = reason
        self.layout: ZeroLayout | None = None
        self.buffers: StateBuffers | None = None
        self._checks_values = not mesh.simulated  # (a plan's meta batch holds no values to check)
        self._checked = False  # the first step's consistency check done
        self.run_id: str | None = None  # the run its checkpoints belong to (see funcpar.io.checkpoint.save)
        # on the CPU, the memory a step frees is kept for the next one (funcpar.train.hostmem): process-wide, so only
        # once every option has been accepted
        self.host_malloc = hostmem.keep_freed_memory() if o.host_malloc == "keep" and mesh.device.type == "cpu" \
            else "system"

    @property
    def compiled(self):
        """Whether the gradient is compiled: True, False, or ``"auto"`` while compiled under ``compile="auto"``
        (False after a compiler failure)."""
        return self.mode.gradient.compiled

    @property
    def compile_reason(self) -> str:
        """Why :attr:`compiled` is what it is."""
        return self.mode.gradient.reason

    @property
    def executor(self):
        """The pipeline executor of this rank's stage on a ``pp`` mesh, else ``None``."""
        return self.mode.executor

    # ----------------------------------------------------------------------------------------------- API
    def save(self, path, state: TrainState, extra: Any = None, keep: int | None = None, overwrite: bool = False,
             latest: bool = True) -> None:
        """:func:`funcpar.io.checkpoint.save` of a state of this step: its layout, its run (a new id on the first save
        of a run not loaded from a checkpoint) and, on a pipeline stage, the tied leaves another stage writes."""
        self.run_id = self.run_id or uuid.uuid4().hex
        checkpoint.save(path, state, self.layout, run=self.run_id, extra=extra,
                        uncounted=self.mode.uncounted(state.params), keep=keep, overwrite=overwrite, latest=latest)

    def load(self, path, restore_rng: bool = True, stats: dict | None = None) -> tuple[TrainState, Any]:
        """:func:`funcpar.io.checkpoint.load` onto this step's mesh and layout (call :meth:`init` first); returns
        ``(state, extra)``, and saving on continues the checkpoint's run."""
        state, extra, self.run_id = checkpoint.load(path, self.layout, self.init, known=self.mode.known_paths(),
                                                    restore_rng=restore_rng, stats=stats)
        return state, extra

    def init(self, params: Any) -> TrainState:
        """The train state for this rank's local ``params``; optimizer state only for this rank's ZeRO parts.
        The parameters are copied into the step's flat buffers (see :mod:`funcpar.train.buffers`); handed in a
        :class:`funcpar.Handoff`, they are freed then, before the optimizer state is made."""
        o, mode = self.options, self.mode
        if isinstance(params, Handoff):
            params = params.take()
        mixed = o.precision.param_dtype is not None
        params = mode.select(params)
        self.layout = lay = ZeroLayout.build(params, self.specs, self.mesh, zero=o.parallel.zero,
                                             data_axes=o.parallel.data_axes,
                                             bucket_bytes=int(o.parallel.bucket_mb * 2**20),
                                             master_dtype=torch.float32 if mixed else None,
                                             units=mode.units(params, self.specs))
        mode.bind(lay)
        # the fp32 masters live where the parameters do (the host under offload)
        first = next((x for x in optree.tree_leaves(params) if isinstance(x, torch.Tensor)), None)
        masters_on = (torch.device("cpu") if o.parallel.offload else
                      (first.device if mixed and first is not None else None))
        self._counted = mode.counted(params)
        self.buffers = bufs = StateBuffers(lay, o.precision.param_dtype, masters_on)
        tree, masters = bufs.init(params)
        del params, first  # copied into the buffers: the caller's leaves may go before the optimizer state comes
        opt_state = self.optimizer.init(masters if bufs.mixed else lay.unflatten(lay.views(bufs.part_slices())))
        bufs.live = TrainState(tree, MixedState(masters, opt_state) if bufs.mixed else opt_state, 0)
        return bufs.live

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """One step: returns ``(new state, metrics)``. ``state`` is consumed (donated) unless ``donate=False``.
        accumulate -> reduce -> update -> gather, in that order (see the module docstring)."""
        t0 = time.perf_counter()
        if self.layout is None:
            raise StepError("call step.init(params) before the first step")
        o = self.options
        rows, drift = self._check_batch(state, batch)
        inner = self.buffers.take(state, o.donate)
        scale = loss_scale(inner)
        # accumulate
        parts, loss_sum, auxes = self._accumulate(self.mode.params(self.buffers), batch, scale)
        if o.precision.scaling is not None:
            parts = [p.div_(scale.to(p.device)) for p in parts]
        # reduce
        stats = self._statistics(parts, loss_sum, drift)
        if stats.drifted:  # a group's batches differ (every rank is here): name it, and every rank stops
            self._drift_error(batch)
        lr = self.schedule(state.step) if self.schedule else 0.0
        skip = self.nonfinite.check(state.step, lr, stats.loss, stats.norm.item(), stats.finite,
                                    kept=lambda: self.buffers.state(inner, state.step),
                                    scale=lambda: loss_scale(inner).item())
        if skip is not None:
            return skip
        # update
        inner = self._update(parts, stats, inner)
        del parts
        metrics = {"loss": stats.loss, "step": state.step}
        if not stats.finite:  # an overflow anywhere: no update anywhere (the wrapper adapted the scale)
            metrics |= {"grad_norm": float("inf"), "lr": float("nan"), "tokens": 0, "tokens_per_s": 0.0,
                        "skipped": True, "loss_scale": loss_scale(inner).item()}
            return self.buffers.state(inner, state.step), metrics
        self.nonfinite.updated()
        # gather
        self.buffers.publish()
        tokens = self._tokens(batch, rows)
        elapsed = time.perf_counter() - t0
        metrics |= {"grad_norm": stats.norm.item(), "lr": lr if self.schedule else float("nan"),
                    "tokens": tokens, "tokens_per_s": tokens / elapsed if elapsed > 0 else float("inf"),
                    "step": state.step + 1}
        if o.precision.param_dtype is not None:
            metrics["loss_scale"] = float(loss_scale(inner))
        if o.parallel.offload:
            metrics["offload"] = o.parallel.offload
        metrics |= self.mode.metrics(stats.bubble)
        if o.has_aux:
            metrics["aux"] = auxes
        return self.buffers.state(inner, state.step + 1), metrics

    # --------------------------------------------------------------------------------------------- phases
    def _data_size(self) -> int:
        return math.prod(self.mesh.axis_size(a) for a in self.options.parallel.data_axes)

    def _check_batch(self, state: TrainState, batch: Any) -> tuple[int, torch.Tensor | None]:
        """This rank's rows, checked against the micro-batches, and the batch's checksums to compare in the
        statistics' all-reduce on the steps the consistency check runs (``None`` on the others)."""
        o = self.options
        rows, A, dp = _rows(batch), o.accum_steps, self._data_size()
        if rows % A:
            d = "x".join(o.parallel.data_axes)
            raise StepError(
                f"the global batch of {rows * dp} rows ({rows} on this {d} rank x {d}={dp}) is not divisible by "
                f"{d} x accum_steps = {dp * A}: make it a multiple of {dp * A}"
            )
        if not (o.guards.check and self._checks_values):
            return rows, None
        same = self.model_axes + self.mode.batch_axes
        if not self._checked:  # the first step: the batch and the replicated leaves
            check_consistency(self.mesh, self.specs, self.mode.replicated(state), batch, same,
                              self.model_axes + o.parallel.data_axes)
            self._checked = True
        elif o.guards.check_every and state.step % o.guards.check_every == 0:  # then the batch, in the statistics'
            return rows, batch_drift(self.mesh, batch, same)  # all-reduce (no collective more)
        return rows, None

    def _accumulate(self, params: Any, batch: Any, scale: torch.Tensor):
        """Accumulate: this rank's bucket gradients over the micro-batches, each weighted by its share of the
        global batch's weight (checked here, on every data rank alike), in the step's mode."""
        micro = _split(batch, self.options.accum_steps)
        w = torch.tensor([self.weight_fn(mb) if self.weight_fn else float(_rows(mb)) for mb in micro],
                         dtype=torch.float64)
        check = self.loss_fn.check_batch
        problems = check(batch) if check and self._checks_values else []
        # the batch's problems ride on the weights' all-reduce: every data rank hears of any
        total, bad = C.all_reduce(torch.stack([w.sum(), torch.tensor(float(len(problems)), dtype=torch.float64)]),
                                  self.mesh, self.options.parallel.data_axes).tolist()
        if bad:
            raise StepError(problems[0] if problems else f"{int(bad)} problem(s) in another data-parallel rank's "
                            f"batch (its error names them)")
        if total <= 0:
            raise StepError("the global batch has no targets to train on (every label is -100 or masked)")
        return self.mode.accumulate(params, micro, [wm / total for wm in w.tolist()], scale)

    def _statistics(self, parts: list[torch.Tensor], loss_sum: torch.Tensor, drift: torch.Tensor | None) \
            -> Statistics:
        """Reduce: the global gradient norm (every element once), the global loss, whether all is finite, the
        pipeline's bubble and, with ``drift``, whether the batch checksums differ: one all-reduce."""
        mesh, lay = self.mesh, self.layout
        if self.mode.per_leaf_norm:  # (see the mode: a leaf counted on one rank only)
            sq = sums_of_squares([v for v, c in zip(lay.views(parts), self._counted, strict=True) if c]).sum()
        else:  # (float64 on the host, one device sync)
            sq = sums_of_squares([p for b, p in zip(lay.buckets, parts, strict=True) if b.counted]).sum()
        # the loss is replicated over the model axes: count it on one rank of each
        loss_owner = all(mesh.coord(a) == 0 for a in self.model_axes) and mesh.coord("pp") == mesh.axis_size("pp") - 1
        # the finiteness check only under loss scaling (it costs a pass over the gradients)
        overflow = (torch.stack([(~torch.isfinite(p)).any() for p in parts]).any().double().cpu()
                    if self.options.precision.scaling is not None else torch.zeros((), dtype=torch.float64))
        bubble = torch.tensor(self.mode.bubble(), dtype=torch.float64)
        stats = torch.stack([sq.double().cpu(), loss_sum if loss_owner else torch.zeros((), dtype=torch.float64),
                             overflow, bubble])
        stats = torch.cat([stats.to(mesh.device)] + ([drift.to(mesh.device)] if drift is not None else []))
        stats = C.all_reduce(stats, mesh, self.options.parallel.data_axes + self.model_axes + ("pp",)).cpu()
        return Statistics(stats[0].sqrt().float(), stats[1].item(), not stats[2].item() > 0,
                          stats[3].item() / mesh.size, drift is not None and drifted(stats[4:]))

    def _drift_error(self, batch: Any) -> None:
        """Raise on every rank the first failing rank's message of the precise batch check (collective)."""
        error = None
        try:
            check_consistency(self.mesh, self.specs, None, batch, self.model_axes + self.mode.batch_axes, ())
        except StepError as e:
            error = e
        said = agree(error, self.mesh)
        raise StepError(said or "the batch's checksums differ across a model axis of the mesh though no group's "
                                "batches did when compared: feed every rank of a tp or pp group the same batch")

    def _update(self, parts: list[torch.Tensor], stats: Statistics, inner: Any) -> Any:
        """Update: the optimizer on this rank's parts, in place in the step's buffers (written into them by the
        optimizer's fused kernel where it has one that takes these leaves: ``WRITTEN``); returns the new optimizer
        state."""
        lay, slices = self.layout, self.buffers.part_slices()
        parts = [p.to(s.device) for p, s in zip(parts, slices, strict=True)]  # offload: the gradient parts to the host
        g_views, p_views = lay.unflatten(lay.views(parts)), lay.unflatten(lay.views(slices))
        extra = {"global_norm": stats.norm.to(parts[0].device)}
        extra |= {"finite": stats.finite} if self.options.precision.scaling is not None else {}
        updates, inner = update_with(self.optimizer, g_views, inner, p_views, inplace=EVERYTHING, **extra)
        if updates is not WRITTEN and stats.finite:
            self._apply(slices, updates)
        return inner

    def _apply(self, slices: list[torch.Tensor], updates: Any) -> None:
        """Update: this rank's parts += updates, in place in the step's buffers (an ``ABSENT`` update, a frozen
        leaf's or a skipped step's, adds nothing)."""
        us = self.layout.treedef.flatten_up_to(updates)
        pairs = [(v, u) for v, u in zip(self.layout.views(slices), us, strict=True) if u is not ABSENT and v.numel()]
        if pairs:
            torch._foreach_add_([v for v, _ in pairs], [u.to(v.dtype) for v, u in pairs])

    def loss(self, state: TrainState, batch: Any, requires_grad: bool = False) -> torch.Tensor:
        """The loss the step differentiates, on ``state``'s parameters and this rank's ``batch`` (at ``zero=3``
        gathering block by block as the step does): for evaluation. ``requires_grad``: keep the autograd graph (its
        saved tensors are the step's activations; :func:`funcpar.cli.planning.trace_step` measures them)."""
        if self.layout is None:
            raise StepError("call step.init(params) before step.loss")
        return self.mode.evaluate(state, batch, requires_grad)

    def held_out(self, state: TrainState, batch: Any) -> torch.Tensor:
        """``[weighted loss, weight]`` (float64, on the host) of this rank's ``batch`` on ``state``'s parameters, for
        a held-out mean: :meth:`loss` times the batch's weight (``batch_weight``: this rank's targets, on a cp mesh
        those of its pieces of each sequence; else rows). Summed over the data axes (every rank of a data axis
        fed its own rows; every cp rank the same rows, its pieces), the two give the global mean exactly as one
        process computes it, on every mesh, mode and pipeline."""
        weight = float(self.weight_fn(batch)) if self.weight_fn else float(_rows(batch))
        loss = self.loss(state, batch).double().cpu()  # (on every rank: tp, cp and pp ranks run it together)
        return torch.tensor([loss.item() * weight if weight else 0.0, weight], dtype=torch.float64)

    def holds(self, path: str) -> bool:
        """Whether this rank holds the parameter at ``path`` (a pipeline stage holds its layers' only; for
        ``fp.hf.load(..., keep=step.holds)``)."""
        return self.mode.holds(path)

    def gather_params(self, state: TrainState) -> Any:
        """Whole local leaves of ``state``'s parameters: ``state.params`` itself, except at ``zero=3``, where they are
        all-gathered from the parts (collective; for export and evaluation: ``fp.hf.save(out,
        step.gather_params(state), ...)``)."""
        if self.layout is None:
            raise StepError("call step.init(params) before step.gather_params")
        return self.mode.whole(state)

    def gather_masters(self, state: TrainState) -> Any:
        """Whole local leaves of the float32 masters mixed precision keeps, all-gathered from every rank's parts
        (collective): the weights to export in float32, which the low-precision compute copies only round. Without
        masters (float32 training) the parameters themselves, as :meth:`gather_params`."""
        if self.layout is None:
            raise StepError("call step.init(params) before step.gather_masters")
        if not isinstance(state.opt_state, MixedState):
            return self.gather_params(state)
        lay = self.layout
        parts = lay.slices_of(lay.treedef.flatten_up_to(state.opt_state.master))
        return gather_params(lay, [p.to(self.mesh.device) for p in parts])

    def _tokens(self, batch: Any, rows: int) -> int:
        """Elements of the global batch's first tensor (B x T for token batches): this rank's over the data axes
        that split the rows (every ``cp`` rank is fed the same rows, its pieces of each)."""
        first = batch_items(batch)[0][1]
        splitting = math.prod(self.mesh.axis_size(a) for a in self.options.parallel.data_axes if a != "cp")
        return rows * splitting * (first.numel() // max(1, first.shape[0]) if first.ndim > 1 else 1)


def compile_step(loss_fn: Callable, specs: Any, options: StepOptions | None = None, **flat: Any) -> Step:
    """Build the sharded train step for ``loss_fn(params, batch) -> scalar`` (this rank's shards and batch).

    The step runs accumulate -> reduce -> update -> gather (see :mod:`funcpar.train.step`): use it as
    ``state = step.init(params)``, then ``state, metrics = step(state, batch)``.

    Args:
        loss_fn: ``loss_fn(params, batch)``, the loss of this rank's parameter shards on this rank's batch, a scalar
            tensor (or ``(loss, aux)`` with ``has_aux``); a :class:`funcpar.Loss` carries what the step uses beyond
            the function (``model.loss_fn(cfg, mesh)`` builds one), a bare function carries nothing
            (:meth:`funcpar.Loss.of`).
        specs: the :class:`funcpar.P` specs of the parameters: the tree of ``params`` or a prefix of it
            (:func:`funcpar.spec.broadcast_specs`).
        options: a :class:`funcpar.StepOptions` (default: every default), the options in their groups, each
            documented with its fields: :class:`funcpar.Parallel` (``zero``, ``data_axes``, ``bucket_mb``,
            ``offload``), :class:`funcpar.Pipelining` (``pipeline``, ``chunks``, ``parts``),
            :class:`funcpar.Precision` (``param_dtype``, ``loss_scale``, ``growth_interval``),
            :class:`funcpar.Guards` (``check``, ``nonfinite``, ``max_skips``), and the step's own (``mesh``,
            ``optimizer``, ``accum_steps``, ``clip_norm``, ``has_aux``, ``weight_fn``, ``compile``, ``donate``,
            ``host_malloc``).
        **flat: the same options as keywords, applied over ``options``: ``zero=3``, ``param_dtype=torch.bfloat16``,
            or a group whole, ``precision=fp.Precision(...)`` (:meth:`funcpar.StepOptions.of`).

    Returns:
        The :class:`Step`; call its :meth:`Step.init` on the parameters before the first step.

    Raises:
        StepError: an invalid option or combination of options (a value out of range, a ``data_axes`` name not a
            data axis of the mesh, ``loss_scale`` without ``param_dtype``, ``zero=3`` or pipeline stages on a loss
            without a staged model, a pipeline schedule that does not fit ``accum_steps``, ...).
        TypeError: an option that is not one of the above.
        MeshError: ``mesh`` not given and no mesh in scope can be chosen (:meth:`funcpar.Mesh.current`).
    """
    return Step(loss_fn, specs, StepOptions.of(options, **flat))
