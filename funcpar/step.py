"""``compile_step``: the whole sharded train step from a pure per-shard loss function.

Per step: gradients with ``torch.func.grad_and_value`` over ``accum_steps`` micro-batches, each micro-batch's loss
weighted by its share of the global batch's target tokens (so the result is exactly the loss of the global batch,
as one process computing it would); the data-parallel reduction; the global gradient norm over every shard, each
element counted once; clipping; the optimizer update; and the new parameters.

ZeRO, bucketed. Leaves are grouped into flat buckets by dtype and by the mesh axes along which they are
*replicated* (an axis absent from the leaf's spec). A bucket is reduced over dp with one collective and, for
``zero >= 1``, partitioned over all of its replicated axes: a tp-sharded weight's bucket is split over dp, a
tp-replicated norm's bucket over dp x tp. Each rank keeps optimizer state only for its part, updates it, and the
parts are all-gathered back into whole (local) leaves. So optimizer state per rank is total/(tp*dp) up to
padding, and a step issues a handful of collectives whatever the number of leaves.

- ``zero=0``: all-reduce gradients over dp; every rank runs the optimizer on its whole local leaves.
- ``zero=1``: accumulate micro-batch gradients locally, then one reduce-scatter per bucket.
- ``zero=2``: reduce-scatter after every micro-batch and keep only the local part across micro-batches.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import optree
import torch

from . import collectives as C
from .mesh import Mesh
from .optim import GradientTransformation, chain, clip_by_global_norm
from .spec import SpecError, broadcast_specs
from .tree import path_str

__all__ = ["compile_step", "Step", "TrainState", "MixedState", "StepError"]


class StepError(ValueError):
    """A train step that cannot run as asked: batch sizes, loss shape, specs, inconsistent data."""


class MixedState(NamedTuple):
    """Optimizer state of a mixed-precision step: fp32 master weights (this rank's ZeRO parts, a params-shaped
    tree of 1-D tensors), the loss scale and the count of overflow-free steps since it last changed, and the
    optimizer's own state over the masters."""

    master: Any
    scale: torch.Tensor  # float32 scalar; 1 without loss scaling
    good_steps: torch.Tensor  # int64 scalar
    inner: Any


class TrainState(NamedTuple):
    params: Any  # this rank's local shards, the structure of the model's params
    opt_state: Any  # the optimizer's state over this rank's ZeRO part of each leaf (1-D)
    step: int  # updates done


@dataclass
class _Bucket:
    dtype: torch.dtype
    zero_axes: tuple[str, ...]  # axes this bucket's optimizer state is partitioned over (major first)
    leaves: list[int]  # indices into the flat leaf list
    offsets: list[int]
    sizes: list[int]
    length: int = 0
    padded: int = 0
    lo: int = 0  # this rank's part of the flat bucket: [lo, hi)
    hi: int = 0
    counted: bool = True  # whether this rank's part counts toward the global norm (zero=0 dedup)
    repl_only: tuple[str, ...] = ()  # replicated axes the optimizer state is not partitioned over (zero=0)
    ranges: list[tuple[int, int]] | None = None  # per leaf: this rank's part as a flat range of the local leaf


def _weight_default(mb: Any) -> float:
    if isinstance(mb, dict) and "input_ids" in mb:
        from .layers import count_targets

        return float(count_targets(mb))
    return float(_rows(mb))


def _rows(batch: Any) -> int:
    xs = [x for x in optree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    if not xs:
        raise StepError("the batch holds no tensors")
    n = xs[0].shape[0]
    for path, x in _batch_items(batch):
        if x.shape[0] != n:
            raise StepError(f"batch entries disagree on the batch dimension: {path} has {x.shape[0]} rows, not {n}")
    return n


def _batch_items(batch: Any) -> list[tuple[str, torch.Tensor]]:
    paths, leaves, _ = optree.tree_flatten_with_path(batch)
    return [(f"batch[{path_str(p)!r}]", x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]


def _split(batch: Any, n: int) -> list[Any]:
    treedef = optree.tree_structure(batch)
    cols = [x.chunk(n, 0) if isinstance(x, torch.Tensor) else [x] * n for x in optree.tree_leaves(batch)]
    return [optree.tree_unflatten(treedef, [c[i] for c in cols]) for i in range(n)]


class Step:
    """A compiled train step: ``state = step.init(params)``, ``state, metrics = step(state, batch)``."""

    def __init__(
        self,
        loss_fn: Callable,
        specs: Any,
        *,
        mesh: Mesh,
        optimizer: GradientTransformation,
        zero: int = 1,
        accum_steps: int = 1,
        clip_norm: float | None = None,
        has_aux: bool = False,
        check: bool = False,
        weight_fn: Callable[[Any], float] | None = _weight_default,
        bucket_mb: float = 1024,
        compile: bool = False,
        param_dtype: torch.dtype | None = None,
        loss_scale: str | float | None = None,
        growth_interval: int = 2000,
    ):
        if zero not in (0, 1, 2):
            raise StepError(f"zero must be 0, 1 or 2, got {zero!r}")
        if not isinstance(accum_steps, int) or accum_steps < 1:
            raise StepError(f"accum_steps must be a positive int, got {accum_steps!r}")
        if mesh.axis_size("pp") > 1:
            raise StepError(f"{mesh!r}: compile_step trains without pipeline stages (pp=1)")
        self.loss_fn, self.specs, self.mesh = loss_fn, specs, mesh
        self.zero, self.accum_steps, self.clip_norm = zero, accum_steps, clip_norm
        self.has_aux, self.check, self.weight_fn = has_aux, check, weight_fn
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.optimizer = chain(clip_by_global_norm(clip_norm), optimizer) if clip_norm else optimizer
        self.schedule = optimizer.schedule
        self._grad = torch.func.grad_and_value(self._scaled_loss, has_aux=True)
        if compile:  # one graph for forward + backward of a micro-batch; collectives stay custom Functions
            self._grad = torch.compile(self._grad)
        self._layout: tuple | None = None
        self._checked = False
        # mixed precision: compute in param_dtype, update fp32 masters; fp16 defaults to dynamic loss scaling
        if param_dtype is not None and not param_dtype.is_floating_point:
            raise StepError(f"param_dtype must be a floating dtype, got {param_dtype}")
        self.param_dtype = param_dtype
        if loss_scale is None and param_dtype == torch.float16:
            loss_scale = "dynamic"
        if loss_scale is not None and param_dtype is None:
            raise StepError("loss_scale needs mixed precision: pass param_dtype=torch.float16 (or bfloat16)")
        if isinstance(loss_scale, str) and loss_scale != "dynamic":
            raise StepError(f"loss_scale must be 'dynamic', a number or None, got {loss_scale!r}")
        self.loss_scale, self.growth_interval = loss_scale, growth_interval

    # ------------------------------------------------------------------------------------------- layout
    def _scaled_loss(self, params, batch, scale):
        out = self.loss_fn(params, batch)
        loss, aux = out if self.has_aux else (out, None)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise StepError(f"loss_fn must return a scalar tensor (use .mean() or .sum()); it returned {shape}")
        return loss * scale, ((loss.detach(), aux) if self.has_aux else loss.detach())

    def _build_layout(self, params: Any):
        matched = broadcast_specs(self.specs, params)
        mesh = self.mesh
        leaves = [x for _, _, x in matched]
        groups: dict[tuple, list[int]] = {}
        for i, (path, spec, x) in enumerate(matched):
            if not isinstance(x, torch.Tensor):
                raise StepError(f"leaf '{path}' is a {type(x).__name__}, not a tensor")
            if "dp" in spec.axes:
                raise SpecError(
                    f"leaf '{path}': spec {spec} shards over 'dp'; compile_step keeps parameters whole over dp and "
                    f"partitions their optimizer state instead (zero=1/2)"
                )
            if "pp" in spec.axes:
                raise SpecError(f"leaf '{path}': spec {spec} names 'pp', which compile_step does not use")
            repl = tuple(a for a in ("dp", "tp") if a not in spec.axes and mesh.axis_size(a) > 1)
            dtype = torch.float32 if self.param_dtype is not None else x.dtype  # masters are fp32
            groups.setdefault((dtype, x.device, repl), []).append(i)
        buckets = []
        for (dtype, _, repl), idx in groups.items():
            zero_axes = repl if self.zero >= 1 else ()
            parts = math.prod(mesh.axis_size(a) for a in zero_axes)
            cur: list[int] = []
            cur_bytes = 0
            chunks = []
            for i in idx:
                nb = leaves[i].numel() * leaves[i].element_size()
                if cur and cur_bytes + nb > self.bucket_bytes:
                    chunks.append(cur)
                    cur, cur_bytes = [], 0
                cur.append(i)
                cur_bytes += nb
            chunks.append(cur)
            for chunk in chunks:
                sizes = [leaves[i].numel() for i in chunk]
                offsets = [sum(sizes[:k]) for k in range(len(sizes))]
                length = sum(sizes)
                padded = -(-length // parts) * parts
                part = 0
                for a in zero_axes:
                    part = part * mesh.axis_size(a) + mesh.coord(a)
                n = padded // parts
                counted = self.zero >= 1 or all(mesh.coord(a) == 0 for a in repl)
                repl_only = tuple(a for a in repl if a not in zero_axes)
                lo, hi = part * n, (part + 1) * n
                ranges = [(min(max(lo - o, 0), k), min(max(hi - o, 0), k)) for o, k in zip(offsets, sizes)]
                buckets.append(
                    _Bucket(dtype, zero_axes, chunk, offsets, sizes, length, padded, lo, hi, counted, repl_only, ranges)
                )
        treedef = optree.tree_structure(params)
        shapes = [tuple(x.shape) for x in leaves]
        return treedef, shapes, buckets, [p for p, _, _ in matched]

    def _views(self, slices: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per leaf, this rank's part of it (1-D), as views into the bucket slices, in leaf order."""
        _, shapes, buckets, _ = self._layout
        out: list[torch.Tensor | None] = [None] * len(shapes)
        for b, s in zip(buckets, slices):
            for i, o, (a, z) in zip(b.leaves, b.offsets, b.ranges):
                out[i] = s[o + a - b.lo : o + z - b.lo] if a < z else s[:0]
        return out

    def _leaf_parts(self) -> list[tuple[int, int, tuple[str, ...]]]:
        """Per leaf: this rank's ZeRO part as a flat range ``[a, z)`` of the local leaf, and the axes the part is
        *not* split over although the leaf is replicated along them (copies of the same part live there)."""
        _, shapes, buckets, _ = self._layout
        out: list = [None] * len(shapes)
        for b in buckets:
            for i, (a, z) in zip(b.leaves, b.ranges):
                out[i] = (a, z, b.repl_only)
        return out

    def _param_slices(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each bucket's part (in the bucket's dtype) cut out of whole local leaves."""
        parts = [leaves[i].detach().reshape(-1)[a:z] for i, (a, z, _) in enumerate(self._leaf_parts())]
        return self._slices_of(parts)

    def _flat(self, b: _Bucket, leaves: list[torch.Tensor]) -> torch.Tensor:
        pieces = [leaves[i].reshape(-1).to(b.dtype) for i in b.leaves]
        if b.padded > b.length:
            pieces.append(pieces[0].new_zeros(b.padded - b.length))
        return torch.cat(pieces)

    def _reduce_part(self, b: _Bucket, flat: torch.Tensor) -> torch.Tensor:
        """The summed-over-dp gradient of this rank's part of bucket ``b`` (the whole bucket at zero=0)."""
        mesh = self.mesh
        if not b.zero_axes:
            return C._raw_all_reduce(flat, mesh, "dp") if mesh.axis_size("dp") > 1 else flat
        if "dp" in b.zero_axes:
            flat = C._raw_reduce_scatter(flat, mesh, "dp", 0)
        if "tp" in b.zero_axes:  # identical across tp already: keep this rank's block
            k = flat.numel() // mesh.axis_size("tp")
            flat = flat[mesh.coord("tp") * k : (mesh.coord("tp") + 1) * k]
        return flat

    def _slices_of(self, view_leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of ``_views``: each bucket's part rebuilt from its leaves' parts (plus zero padding)."""
        _, _, buckets, _ = self._layout
        out = []
        for b in buckets:
            pieces = [view_leaves[i].reshape(-1).to(b.dtype) for i in b.leaves if view_leaves[i].numel()]
            pad = (b.hi - b.lo) - sum(p.numel() for p in pieces)
            if pad:
                pieces.append(torch.zeros(pad, dtype=b.dtype, device=view_leaves[b.leaves[0]].device))
            out.append(torch.cat(pieces))
        return out

    def _gather_whole(self, b: _Bucket, part: torch.Tensor) -> torch.Tensor:
        mesh = self.mesh
        for a in reversed(b.zero_axes):  # minor axis first, as the parts were cut
            part = C._raw_all_gather(part, mesh, a, 0)
        return part

    # ----------------------------------------------------------------------------------------------- API
    def save(self, path, state: TrainState, extra: Any = None, keep: int | None = None) -> None:
        """:func:`funcpar.checkpoint.save` for a state of this step."""
        from . import checkpoint

        checkpoint.save(path, state, self.mesh, extra, step=self, keep=keep)

    def load(self, path) -> tuple[TrainState, Any]:
        """:func:`funcpar.checkpoint.load` onto this step's mesh and layout; returns ``(state, extra)``."""
        from . import checkpoint

        return checkpoint.load(path, self)

    def init(self, params: Any) -> TrainState:
        """The train state for this rank's local ``params``; optimizer state only for this rank's ZeRO parts."""
        self._layout = self._build_layout(params)
        leaves = optree.tree_leaves(params)
        views = self._views(self._param_slices(leaves))
        treedef = self._layout[0]
        opt_state = self.optimizer.init(optree.tree_unflatten(treedef, views))
        if self.param_dtype is None:
            return TrainState(params, opt_state, 0)
        scale = float(2.0**16 if self.loss_scale == "dynamic" else (self.loss_scale or 1.0))
        mixed = MixedState(optree.tree_unflatten(treedef, views), torch.tensor(scale, dtype=torch.float32),
                           torch.zeros((), dtype=torch.int64), opt_state)
        compute = optree.tree_map(lambda x: x.detach().to(self.param_dtype), params)
        return TrainState(compute, mixed, 0)

    def _check_consistency(self, params_leaves: list[torch.Tensor], batch: Any) -> None:
        """check=True: the batch agrees across tp, replicated leaves agree along their replicated axes."""
        mesh = self.mesh

        def sums(x):
            x = x.detach().double().reshape(-1)
            w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device).remainder_(7.0).add_(1.0)
            return torch.stack([x.sum(), (x * w).sum()])

        items = [(name, x, ("tp",)) for name, x in _batch_items(batch)]
        matched = broadcast_specs(self.specs, optree.tree_unflatten(self._layout[0], params_leaves))
        items += [(f"leaf '{p}'", x, tuple(a for a in ("tp", "dp") if a not in s.axes)) for p, s, x in matched]
        for axis in ("tp", "dp"):
            if mesh.axis_size(axis) == 1:
                continue
            sel = [(n, x) for n, x, axes in items if axis in axes]
            if not sel:
                continue
            v = torch.stack([sums(x) for _, x in sel])
            hi, lo = C.all_reduce(v, mesh, axis, "max"), C.all_reduce(v, mesh, axis, "min")
            bad = (hi != lo).any(-1).nonzero()
            if len(bad):
                name = sel[int(bad[0])][0]
                what = "Data inconsistency within the TP group" if axis == "tp" else "Replicas disagree over dp"
                raise StepError(
                    f"{what}: {name} differs across mesh axis '{axis}' (group ranks {mesh.group_ranks(axis)}); "
                    f"every rank of the group must hold the same values"
                    + (" (feed every tp rank the same batch)" if name.startswith("batch") else "")
                )

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        t0 = time.perf_counter()
        mesh, A = self.mesh, self.accum_steps
        if self._layout is None:
            raise StepError("call step.init(params) before the first step")
        treedef, shapes, buckets, _ = self._layout
        p_leaves = treedef.flatten_up_to(state.params)
        rows = _rows(batch)
        if rows % A:
            dp = mesh.axis_size("dp")
            raise StepError(
                f"the global batch of {rows * dp} rows ({rows} on this dp rank x dp={dp}) is not divisible by "
                f"dp x accum_steps = {dp * A}: make it a multiple of {dp * A}"
            )
        if self.check and not self._checked:
            self._check_consistency(p_leaves, batch)
            self._checked = True
        micro = _split(batch, A)
        # each micro-batch's loss weighted by its share of the global batch's targets -> the global mean exactly
        w = torch.tensor([self.weight_fn(mb) if self.weight_fn else 1.0 for mb in micro], dtype=torch.float64)
        total = C.all_reduce(w.sum(), mesh, "dp").item() if mesh.axis_size("dp") > 1 else w.sum().item()
        if total <= 0:
            raise StepError("the global batch has no targets to train on (every label is -100 or masked)")
        mixed = self.param_dtype is not None
        scale = state.opt_state.scale if mixed else torch.ones((), dtype=torch.float32)
        acc: list[torch.Tensor | None] = [None] * len(buckets)
        loss_sum = torch.zeros((), dtype=torch.float64)
        auxes = []
        for mb, wm in zip(micro, w.tolist()):
            # the weight as a tensor: a Python float would be a constant to torch.compile (a recompile per value)
            grads, (_, out) = self._grad(state.params, mb, torch.tensor(wm / total, dtype=torch.float32) * scale)
            loss, aux = out if self.has_aux else (out, None)
            auxes.append(aux)
            loss_sum += loss.detach().double().cpu() * (wm / total)
            g_leaves = treedef.flatten_up_to(grads)
            for k, b in enumerate(buckets):
                flat = self._flat(b, g_leaves)
                if self.zero == 2:
                    flat = self._reduce_part(b, flat)
                acc[k] = flat if acc[k] is None else acc[k].add_(flat)
        parts = acc if self.zero == 2 else [self._reduce_part(b, f) for b, f in zip(buckets, acc)]
        if mixed and self.loss_scale is not None:
            parts = [p / scale.to(p.device) for p in parts]
        # global norm: every element once (ZeRO parts are disjoint; at zero=0 only one replica counts)
        sq = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32) ** 2 if b.counted
                          else p.new_zeros((), dtype=torch.float32) for b, p in zip(buckets, parts)]).sum()
        first_tp = mesh.coord("tp") == 0
        scaling = mixed and self.loss_scale is not None
        # overflow check only under loss scaling (it costs a pass over the gradients)
        overflow = (torch.stack([(~torch.isfinite(p)).any() for p in parts]).any().double().cpu() if scaling
                    else torch.zeros((), dtype=torch.float64))
        stats = torch.stack([sq.double().cpu(), loss_sum if first_tp else torch.zeros((), dtype=torch.float64), overflow])
        stats = C.all_reduce(stats.to(mesh.device), mesh, ("dp", "tp"))
        grad_norm = stats[0].sqrt().float()
        loss_value = stats[1].item()
        if scaling and stats[2].item() > 0:
            # an overflow anywhere: skip the update everywhere, halve a dynamic scale
            new_scale = scale * 0.5 if self.loss_scale == "dynamic" else scale
            skipped = state.opt_state._replace(scale=new_scale, good_steps=torch.zeros((), dtype=torch.int64))
            metrics = {"loss": loss_value, "grad_norm": float("inf"), "lr": float("nan"), "tokens": 0,
                       "tokens_per_s": 0.0, "step": state.step, "skipped": True, "loss_scale": new_scale.item()}
            return TrainState(state.params, skipped, state.step), metrics
        # optimizer on this rank's parts
        g_views = optree.tree_unflatten(treedef, self._views(parts))
        if mixed:  # the fp32 masters, not the low-precision copies, are what the optimizer updates
            p_slices = self._slices_of(treedef.flatten_up_to(state.opt_state.master))
        else:
            p_slices = self._param_slices(p_leaves)
        p_views = optree.tree_unflatten(treedef, self._views(p_slices))
        inner = state.opt_state.inner if mixed else state.opt_state
        updates, opt_state = self.optimizer.update(g_views, inner, p_views, global_norm=grad_norm.to(parts[0].device))
        new_slices = [s.clone() for s in p_slices]
        new_views = self._views(new_slices)
        u_leaves = treedef.flatten_up_to(updates)
        pairs = [(v, u) for v, u in zip(new_views, u_leaves) if u is not None and v.numel()]
        if pairs:
            torch._foreach_add_([v for v, _ in pairs], [u.to(v.dtype) for v, u in pairs])
        new_leaves: list[torch.Tensor | None] = [None] * len(shapes)
        for b, s in zip(buckets, new_slices):
            whole = self._gather_whole(b, s.to(self.param_dtype) if mixed else s)
            for i, o, n in zip(b.leaves, b.offsets, b.sizes):
                new_leaves[i] = whole[o : o + n].view(shapes[i])
        new_params = optree.tree_unflatten(treedef, new_leaves)
        if mixed:
            good = state.opt_state.good_steps + 1
            new_scale = scale
            if self.loss_scale == "dynamic" and int(good) >= self.growth_interval:
                new_scale, good = scale * 2.0, torch.zeros((), dtype=torch.int64)
            opt_state = MixedState(optree.tree_unflatten(treedef, new_views), new_scale, good, opt_state)
        elapsed = time.perf_counter() - t0
        tokens = rows * mesh.axis_size("dp")
        if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor) and batch["input_ids"].ndim > 1:
            tokens *= batch["input_ids"].shape[1]
        metrics = {
            "loss": loss_value,
            "grad_norm": grad_norm.item(),
            "lr": self.schedule(state.step) if self.schedule else float("nan"),
            "tokens": tokens,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else float("inf"),
            "step": state.step + 1,
        }
        if mixed:
            metrics["loss_scale"] = float(opt_state.scale)
        if self.has_aux:
            metrics["aux"] = auxes
        return TrainState(new_params, opt_state, state.step + 1), metrics


def compile_step(loss_fn: Callable, specs: Any, *, mesh: Mesh, optimizer: GradientTransformation, **kwargs) -> Step:
    """Build the sharded train step for ``loss_fn(params, batch) -> scalar`` (this rank's shards and batch).

    Keyword options: ``zero`` (0, 1, 2; default 1), ``accum_steps`` (micro-batches per step), ``clip_norm``
    (clip by the global gradient norm), ``has_aux`` (``loss_fn`` returns ``(loss, aux)``), ``check`` (verify on the
    first step that batch and replicated leaves agree across ranks), ``weight_fn`` (a micro-batch's weight in the
    global mean; default: its number of causal-LM targets for ``{"input_ids", ...}`` batches, else its rows),
    ``bucket_mb`` (largest gradient bucket), ``compile`` (``torch.compile`` the per-micro-batch gradient function),
    ``param_dtype`` (mixed precision: compute with copies in this dtype, keep fp32 masters as ZeRO parts in the
    optimizer state), ``loss_scale`` (``"dynamic"`` (the default for float16): scale the loss, skip the update and
    halve the scale on an overflow on any rank, double it after ``growth_interval`` clean steps; or a constant).
    """
    return Step(loss_fn, specs, mesh=mesh, optimizer=optimizer, **kwargs)
