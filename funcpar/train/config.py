"""``compile_step``'s options as typed values: each group holds its fields, their defaults, their help and the
checks that need no mesh, so a reader finds an option's meaning, default and rules in one place.

``StepOptions`` is the whole: the step's own fields plus four groups, :class:`Parallel` (ZeRO, data axes, buckets,
offload), :class:`Pipelining` (the schedule on a ``pp`` mesh), :class:`Precision` (mixed precision and loss
scaling) and :class:`Guards` (checks and the policy for a step that is not finite). ``compile_step`` takes either a
``StepOptions`` or the same options as flat keywords (:meth:`StepOptions.of`: ``zero=3`` is
``parallel=Parallel(zero=3)``; a group may also be given whole by its name). Checks against the mesh (a data axis
the mesh has, pipeline stages that fit) happen when the step is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from funcpar.state import StepError

__all__ = ["StepOptions", "Parallel", "Pipelining", "Precision", "Guards"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallel:
    """How gradients and optimizer state are split over the data axes.

    Args:
        zero: the ZeRO stage, 0, 1 (the default), 2 or 3. ``0``: gradients all-reduced over ``data_axes``, every
            rank updates its whole local leaves; ``1``: the optimizer state partitioned over ``data_axes``,
            micro-batch gradients accumulated locally, then one reduce-scatter per bucket; ``2``: a reduce-scatter
            after every micro-batch, only the local part kept; ``3``: the parameters partitioned too, gathered block
            by block inside the loss (:mod:`funcpar.train.zero3`), for a loss with a staged model
            (``model.loss_fn(cfg, mesh)`` of llama, gpt2, ...); with mixed precision, offload and pipeline stages
            (not with ``pipeline="zb"``).
        data_axes: the mesh axes the batch is split over (default ``("dp",)``; never ``pp``): gradients are summed and
            ZeRO-partitioned over them. The mesh's other axes are model axes.
        bucket_mb: the largest gradient bucket, in MiB (default 64): leaves are packed into flat buckets up to this
            size (a larger leaf is a bucket of its own), each reduced by one collective; ``zero=3`` buckets by block.
        offload: ``None`` (the default) or ``"cpu"``: this rank's optimizer state and master parts live in host
            memory, pinned on CUDA, and the update runs there, as ZeRO-Offload does. On a CPU-only machine the host is
            the device: the same code path.
    """

    zero: int = 1
    data_axes: tuple[str, ...] = ("dp",)
    bucket_mb: float = 64
    offload: str | None = None

    def __post_init__(self):
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise StepError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if isinstance(self.data_axes, str) or not all(isinstance(a, str) for a in self.data_axes):
            raise StepError(f"data_axes must be a tuple of mesh axis names, got {self.data_axes!r}")
        object.__setattr__(self, "data_axes", tuple(self.data_axes))
        if not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise StepError(f"bucket_mb must be a number > 0, got {self.bucket_mb!r}")
        if self.offload not in (None, "cpu"):
            raise StepError(f"offload must be None or 'cpu', got {self.offload!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipelining:
    """The pipeline on a mesh with ``pp > 1``, where the model's staged form is cut into stages
    (:mod:`funcpar.pipeline.executor`) and the ``accum_steps`` micro-batches run through them; unused at ``pp=1``.

    Args:
        schedule: ``"1f1b"`` (the default), ``"gpipe"``, ``"interleaved"`` or ``"zb"`` (zero-bubble: each backward
            split into the input's gradient and the weights', the latter filling the bubble; not with remat). The
            flat keyword is ``pipeline=``.
        chunks: virtual stages per rank, for ``"interleaved"`` (default 2) or ``"zb"`` (default 1); the other
            schedules run one.
        parts: layers per virtual stage, in halves where the model's staged form has them: ``[2.5, 1.5]``; default
            ``None``: cut by the units' weights (:func:`funcpar.pipeline.schedule.assign_units`).
    """

    schedule: str = "1f1b"
    chunks: int | None = None
    parts: list[float] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """Mixed precision.

    Args:
        param_dtype: compute copies of the parameters in this floating dtype, fp32 masters as ZeRO parts in the
            optimizer state; default ``None``, everything in the parameters' own dtype.
        loss_scale: ``"dynamic"`` (the default for ``param_dtype=torch.float16``), a positive constant, or ``None``
            (no scaling; the default otherwise); needs ``param_dtype``. The optimizer is wrapped in
            :func:`funcpar.optim.apply_if_finite`, which skips a step that overflows on any rank and adapts the
            scale: ``"dynamic"`` starts at 2**16, halves on an overflow and doubles after ``growth_interval`` finite
            steps in a row; a constant stays as given.
        growth_interval: finite steps in a row after which a ``"dynamic"`` loss scale doubles (default 2000).
    """

    param_dtype: torch.dtype | None = None
    loss_scale: str | float | None = None
    growth_interval: int = 2000

    def __post_init__(self):
        if self.param_dtype is not None and not (isinstance(self.param_dtype, torch.dtype)
                                                 and self.param_dtype.is_floating_point):
            raise StepError(f"param_dtype must be a floating dtype, got {self.param_dtype}")
        if self.loss_scale is not None and self.param_dtype is None:
            raise StepError("loss_scale needs mixed precision: pass param_dtype=torch.float16 (or bfloat16)")
        if isinstance(self.loss_scale, str) and self.loss_scale != "dynamic":
            raise StepError(f"loss_scale must be 'dynamic', a number or None, got {self.loss_scale!r}")

    @property
    def scaling(self) -> str | float | None:
        """The loss scale the step uses: ``loss_scale``, or ``"dynamic"`` for float16 when none is given (float16
        gradients overflow without it)."""
        return "dynamic" if self.loss_scale is None and self.param_dtype == torch.float16 else self.loss_scale


@dataclasses.dataclass(frozen=True, kw_only=True)
class Guards:
    """What the step checks, and what it does with a step that is not finite.

    Args:
        check: default True: verify on the first step that the batch and the replicated leaves agree across ranks;
            a model's ``check_batch`` runs on every batch regardless.
        check_every: with ``check``, verify the batch again every this many steps (default 1: every step; 0: the
            first step only): two sums of each batch tensor, folded into the all-reduce the step makes for its
            gradient norm (:func:`funcpar.train.batching.batch_drift`), so a tp or pp group fed different batches stops
            at that step, before its update, instead of training on them.
        nonfinite: a step whose loss or gradient norm is not finite raises (``"error"``, the default; nothing
            updated, the state kept as the error's ``.state``) or is skipped (``"skip"``).
        max_skips: bounds the steps skipped in a row (an int >= 0, default 20), by the ``nonfinite`` policy or by
            loss scaling; one more raises as ``"error"`` does.
    """

    check: bool = True
    check_every: int = 1
    nonfinite: str = "error"
    max_skips: int = 20

    def __post_init__(self):
        if not isinstance(self.check_every, int) or isinstance(self.check_every, bool) or self.check_every < 0:
            raise StepError(f"check_every must be an int >= 0, got {self.check_every!r}")
        if self.nonfinite not in ("error", "skip") or not isinstance(self.max_skips, int) or self.max_skips < 0:
            raise StepError(f"nonfinite must be 'error' or 'skip' and max_skips an int >= 0, got "
                            f"{self.nonfinite!r}, {self.max_skips!r}")


_GROUPS = {"parallel": Parallel, "pipelining": Pipelining, "precision": Precision, "guards": Guards}
_ALIASES = {"pipeline": ("pipelining", "schedule")}  # flat keyword -> (group, field), where the names differ


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOptions:
    """Everything ``compile_step`` takes besides the loss and the specs.

    Args:
        mesh: the mesh to run on; default the mesh in scope (:meth:`funcpar.Mesh.current`: ``with mesh:``, else the
            only multi-process mesh built, else ``Mesh()`` in a one-process program).
        optimizer: a :class:`funcpar.optim.GradientTransformation`; default ``adamw(1e-3, weight_decay=0.01)``,
            torch's AdamW defaults (:func:`funcpar.train.step.default_optimizer`).
        accum_steps: micro-batches per step (a positive int); the rows of the global batch must divide by the
            data-parallel size x ``accum_steps``. Each micro-batch's loss is weighted by its share of the global
            batch's weight, so the step's loss is the global batch's.
        clip_norm: clip by the global gradient norm (every shard, each element counted once) to this value before the
            optimizer; default ``None``, no clipping.
        has_aux: the loss returns ``(loss, aux)``; the micro-batches' auxes come back as ``metrics["aux"]``. Not with
            pipeline stages.
        weight_fn: ``weight_fn(micro_batch) -> float``, a micro-batch's weight in the global mean; default the
            ``batch_weight`` the loss carries (:class:`funcpar.Loss`: target tokens for the models), else rows.
        compile: ``torch.compile`` the per-micro-batch gradient: ``True``, ``False``, or ``"auto"``, the default:
            compiled on a CUDA mesh whose only axes of size > 1 are data axes, without pipeline stages, ZeRO-3,
            offload or remat, eager elsewhere; under ``"auto"`` a compiler failure warns once and the eager gradient
            takes over; ``step.compiled`` and ``step.compile_reason`` say what was chosen
            (:func:`funcpar.train.options.resolve_compile`). ``True`` is refused with pipeline stages.
        donate: default True: the state passed to the step is consumed, its buffers updated in place, as JAX's
            ``donate_argnums``; a consumed state passed again raises. False: every call copies the state first and
            leaves the old one valid, at the memory of that copy. See :mod:`funcpar.train.buffers`.
        host_malloc: on a CPU mesh, ``"keep"`` (default) has glibc keep the memory a step frees for the next step
            instead of returning it to the kernel (:mod:`funcpar.train.hostmem`; process-wide, left alone where the
            environment configures malloc); ``"system"`` leaves malloc as it is.
        parallel, pipelining, precision, guards: the groups (:class:`Parallel`, :class:`Pipelining`,
            :class:`Precision`, :class:`Guards`).
    """

    mesh: Any = None
    optimizer: Any = None
    accum_steps: int = 1
    clip_norm: float | None = None
    has_aux: bool = False
    weight_fn: Callable[[Any], float] | None = None
    compile: bool | str = "auto"
    donate: bool = True
    host_malloc: str = "keep"
    parallel: Parallel = Parallel()
    pipelining: Pipelining = Pipelining()
    precision: Precision = Precision()
    guards: Guards = Guards()

    def __post_init__(self):
        if not isinstance(self.accum_steps, int) or isinstance(self.accum_steps, bool) or self.accum_steps < 1:
            raise StepError(f"accum_steps must be a positive int, got {self.accum_steps!r}")
        if self.host_malloc not in ("keep", "system"):
            raise StepError(f"host_malloc must be 'keep' or 'system', got {self.host_malloc!r}")
        if self.compile not in (True, False, "auto"):
            raise StepError(f"compile must be True, False or 'auto', got {self.compile!r}")
        for name, kind in _GROUPS.items():
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name}= takes a funcpar.{kind.__name__}, got {type(getattr(self, name)).__name__}")

    @classmethod
    def of(cls, options: "StepOptions | None" = None, **flat: Any) -> "StepOptions":
        """``options`` (default: all defaults) with ``flat`` keywords applied: a field of ``StepOptions``, a group
        given whole (``precision=Precision(...)``), or a field of one group by its own name (``zero=3``,
        ``param_dtype=torch.bfloat16``; ``pipeline=`` is :attr:`Pipelining.schedule`). An unknown name raises
        ``TypeError`` listing the names; a field set both flat and in a group given whole raises too."""
        base = options if options is not None else cls()
        if not isinstance(base, StepOptions):
            raise TypeError(f"compile_step: options must be a funcpar.StepOptions, got {type(base).__name__}")
        owner = {f.name: (g, f.name) for g, kind in _GROUPS.items() for f in dataclasses.fields(kind)} | _ALIASES
        top = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(flat) - top - set(owner))
        if unknown:
            raise TypeError(f"compile_step() got unknown option(s) {', '.join(unknown)}: it takes "
                            f"{', '.join(option_names())}")
        fields: dict[str, dict] = {g: {} for g in _GROUPS}
        for name, value in flat.items():
            if name not in top:
                group, field = owner[name]
                if group in flat:
                    raise TypeError(f"compile_step() got {name}= and {group}= together: set {field} in the "
                                    f"{_GROUPS[group].__name__} given")
                fields[group][field] = value
        # a group's fields are replaced together: its checks see the combination (loss_scale with param_dtype)
        groups = {g: dataclasses.replace(getattr(base, g), **kw) for g, kw in fields.items() if kw}
        return dataclasses.replace(base, **{k: v for k, v in flat.items() if k in top}, **groups)


def option_names() -> list[str]:
    """Every flat keyword ``compile_step`` takes, in the order the groups define them."""
    names = [f.name for f in dataclasses.fields(StepOptions) if f.name not in _GROUPS]
    for group, kind in _GROUPS.items():
        names += [next((a for a, (g, f) in _ALIASES.items() if (g, f) == (group, x.name)), x.name)
                  for x in dataclasses.fields(kind)]
    return names + list(_GROUPS)
