"""The ZeRO bucket layout of a train step: which part of which leaf each rank keeps, and how parts move.

Leaves are grouped into flat buckets by dtype and by the mesh axes along which they are *replicated* (axes absent
from the leaf's spec). A bucket's gradient is summed over the replicated *data* axes (where ranks saw different
examples) and, with ``zero >= 1``, partitioned over all its replicated axes, data axes major: a tp-sharded weight's
bucket is split over dp, a tp-replicated norm's bucket over dp x tp. Each rank keeps optimizer state only for its
part; after the update the parts are all-gathered back into whole local leaves.

A :class:`ZeroLayout` is immutable and public: :mod:`funcpar.io.checkpoint` reads it to know which flat range of which
leaf this rank's optimizer state covers (:meth:`ZeroLayout.leaf_parts`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import optree
import torch

from funcpar.parallel import collectives as C
from funcpar.spec import P, SpecError, broadcast_specs
from funcpar.state import StepError

if TYPE_CHECKING:  # pragma: no cover
    from funcpar.parallel.mesh import Mesh

__all__ = ["ZeroLayout", "Bucket"]


@dataclasses.dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    zero_axes: tuple[str, ...]  # axes this bucket's optimizer state is partitioned over (major first)
    sum_axes: tuple[str, ...]  # data axes the gradient is summed over (the replicated ones)
    leaves: tuple[int, ...]  # indices into the flat leaf list
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    length: int
    padded: int
    lo: int  # this rank's part of the flat bucket: [lo, hi)
    hi: int
    counted: bool  # whether this rank's part counts toward the global norm (one replica at zero=0)
    ranges: tuple[tuple[int, int], ...]  # per leaf: this rank's part as a flat range of the local leaf


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    mesh: "Mesh"
    zero: int
    data_axes: tuple[str, ...]
    treedef: Any
    paths: tuple[str, ...]
    specs: tuple[P, ...]
    shapes: tuple[tuple[int, ...], ...]
    buckets: tuple[Bucket, ...]

    @classmethod
    def build(cls, params: Any, specs: Any, mesh: "Mesh", *, zero: int, data_axes: tuple[str, ...],
              bucket_bytes: int, master_dtype: torch.dtype | None = None,
              units: list[list[int]] | None = None) -> "ZeroLayout":
        """The layout for this rank's local ``params``; ``master_dtype`` overrides the leaves' dtype (fp32 masters).

        ``zero=3`` takes ``units``: lists of leaf indices gathered together (a model's embedding, each block, its
        head), one bucket each, partitioned over the data axes; its gradient is summed by the gather's backward.
        """
        matched = broadcast_specs(specs, params)
        axes = [a for a in mesh.axis_names if a != "pp" and mesh.axis_size(a) > 1]
        sizes = [x.numel() for _, _, x in matched]
        nbytes = [x.numel() * x.element_size() for _, _, x in matched]
        for path, spec, x in matched:
            _check_leaf(path, spec, x, data_axes)
        if zero == 3:
            data = tuple(a for a in data_axes if a in axes)
            split = next(((p, a) for p, s, _ in matched for a in data if a in s.axes), None)
            if split is not None:  # a unit's bucket must be the same on every rank it is partitioned over
                raise StepError(f"zero=3 partitions every block over the data axes {', '.join(data)}, but leaf "
                                f"'{split[0]}' is split over '{split[1]}' (each rank holds other values): use "
                                f"zero=1 or 2 on this mesh, or a mesh without '{split[1]}'")
            buckets = [_bucket(master_dtype or matched[u[0]][2].dtype, data, u, [sizes[i] for i in u], mesh, 3, ())
                       for u in units]
        else:
            groups: dict[tuple, list[int]] = {}
            for i, (_path, spec, x) in enumerate(matched):
                repl = tuple(a for a in data_axes if a in axes and a not in spec.axes)
                repl += tuple(a for a in axes if a not in data_axes and a not in spec.axes)
                groups.setdefault((master_dtype or x.dtype, x.device, repl), []).append(i)
            buckets = []
            for (dtype, _, repl), idx in groups.items():
                # leaves that no collective touches (replicated along no axis) need no flat bucket: one leaf each,
                # so a gradient's own storage serves as its bucket (no copy)
                for chunk in _chunks(idx, nbytes, bucket_bytes if repl else 0):
                    buckets.append(_bucket(dtype, repl, chunk, [sizes[i] for i in chunk], mesh, zero, data_axes))
        return cls(mesh, zero, tuple(data_axes), optree.tree_structure(params), tuple(p for p, _, _ in matched),
                   tuple(s for _, s, _ in matched), tuple(tuple(x.shape) for _, _, x in matched), tuple(buckets))

    @property
    def holds_parts(self) -> bool:
        """Whether a state on this layout holds only this rank's part of each leaf (ZeRO-3: the parameters
        partitioned over the data axes, gathered unit by unit) rather than whole local leaves."""
        return self.zero == 3

    # ------------------------------------------------------------------------------------ leaf <-> bucket parts
    def leaf_parts(self) -> list[tuple[int, int, tuple[str, ...]]]:
        """Per leaf: this rank's ZeRO part as a flat range ``[a, z)`` of the local leaf, and the axes the part is
        *not* split over although the leaf is replicated along them (copies of the same part live there)."""
        out: list = [None] * len(self.shapes)
        axes = [a for a in self.mesh.axis_names if a != "pp" and self.mesh.axis_size(a) > 1]
        for b in self.buckets:
            for i, (a, z) in zip(b.leaves, b.ranges, strict=True):
                out[i] = (a, z, tuple(x for x in axes if x not in self.specs[i].axes and x not in b.zero_axes))
        return out

    def views(self, slices: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per leaf, this rank's part of it (1-D), as views into the bucket slices, in leaf order."""
        out: list = [None] * len(self.shapes)
        for b, s in zip(self.buckets, slices, strict=True):
            for i, o, (a, z) in zip(b.leaves, b.offsets, b.ranges, strict=True):
                out[i] = s[o + a - b.lo : o + z - b.lo] if a < z else s[:0]
        return out

    def slices_of(self, view_leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of :meth:`views`: each bucket's part rebuilt from its leaves' parts (plus zero padding)."""
        out = []
        for b in self.buckets:
            pieces = [view_leaves[i].reshape(-1).to(b.dtype) for i in b.leaves if view_leaves[i].numel()]
            pad = (b.hi - b.lo) - sum(p.numel() for p in pieces)
            if pad:
                pieces.append(torch.zeros(pad, dtype=b.dtype, device=view_leaves[b.leaves[0]].device))
            out.append(torch.cat(pieces))
        return out

    def param_slices(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each bucket's part (in the bucket's dtype) cut out of whole local leaves."""
        parts = [leaves[i].detach().reshape(-1)[a:z] for i, (a, z, _) in enumerate(self.leaf_parts())]
        return self.slices_of(parts)

    def flat(self, b: Bucket, leaves: list, dtype: torch.dtype | None = None, *, free: bool = False) -> torch.Tensor:
        """Bucket ``b`` of whole local leaves as one padded flat tensor (in ``dtype``, default the bucket's).
        ``free``: the leaves are the caller's to give away (gradients): drop each from ``leaves`` once copied, so its
        memory can go before the next one's is needed, and use a lone leaf's own storage instead of copying it."""
        dtype = dtype or b.dtype
        first = leaves[b.leaves[0]]
        if free and len(b.leaves) == 1 and b.padded == b.length and first.dtype == dtype and first.is_contiguous():
            leaves[b.leaves[0]] = None  # a bucket of one leaf we own: its own storage is the flat bucket
            return first.view(-1)
        out = torch.empty(b.padded, dtype=dtype, device=first.device)
        for i, o, n in zip(b.leaves, b.offsets, b.sizes, strict=True):
            out[o : o + n].copy_(leaves[i].reshape(-1))
            if free:
                leaves[i] = None
        out[b.length :].zero_()
        return out

    def unpack(self, b: Bucket, whole: torch.Tensor) -> list[torch.Tensor]:
        """Views into a whole flat bucket ``whole``: its leaves, in the bucket's order. Cut by one ``split`` (gaps and
        padding as pieces of their own), whose backward is one concatenation: cut by a slice each, a differentiable
        ``whole`` (ZeRO-3's gathered unit) would get a zero-filled whole-bucket gradient per leaf, summed."""
        order = sorted(range(len(b.leaves)), key=lambda j: b.offsets[j])
        sizes, at, where = [], 0, {}
        for j in order:
            if b.offsets[j] > at:
                sizes.append(b.offsets[j] - at)
            where[j], at = len(sizes), b.offsets[j] + b.sizes[j]
            sizes.append(b.sizes[j])
        if whole.numel() > at:
            sizes.append(whole.numel() - at)
        pieces = whole.split(sizes)
        return [pieces[where[j]].view(self.shapes[i]) for j, i in enumerate(b.leaves)]

    def unflatten(self, leaves: list) -> Any:
        return optree.tree_unflatten(self.treedef, leaves)

    # ------------------------------------------------------------------------------------------- movement
    def reduce(self, b: Bucket, flat: torch.Tensor) -> torch.Tensor:
        """The gradient summed over the data axes, of this rank's part of bucket ``b`` (the whole bucket at zero=0)."""
        for a in b.sum_axes:
            if a in b.zero_axes:
                flat = C.reduce_scatter_nograd(flat, self.mesh, a, 0)
            else:
                flat = C.all_reduce(flat, self.mesh, a)
        for a in b.zero_axes:
            if a not in b.sum_axes:  # identical along a already: keep this rank's block
                k = flat.numel() // self.mesh.axis_size(a)
                flat = flat[self.mesh.coord(a) * k : (self.mesh.coord(a) + 1) * k]
        return flat

    def reduce_leaves(self, b: Bucket, leaves: list) -> torch.Tensor:
        """``reduce(b, flat(b, leaves, free=True))``; on host tensors reduced over one ZeRO axis, straight from the
        leaves (:func:`funcpar.parallel.collectives.reduce_scatter_segments`): no bucket-sized flat copy is made, and
        each leaf is dropped from ``leaves`` as ``flat`` does."""
        ts = [leaves[i] for i in b.leaves]
        if len(b.zero_axes) != 1 or b.sum_axes != b.zero_axes or self.mesh.device.type != "cpu" or any(
                t.dtype != b.dtype or t.device.type not in ("cpu", "meta") for t in ts):
            return self.reduce(b, self.flat(b, leaves, free=True))
        segs = [(o, t.reshape(-1)) for o, t in zip(b.offsets, ts, strict=True) if t.numel()]
        for i in b.leaves:
            leaves[i] = None
        return C.reduce_scatter_segments(segs, b.padded, self.mesh, b.zero_axes[0])

    def gather_into(self, b: Bucket, whole: torch.Tensor) -> None:
        """All-gather this rank's updated part of bucket ``b`` (``whole[lo:hi]``) into every rank's ``whole``, over
        its ZeRO axes (minor first, as the parts were cut); the last gather writes straight into ``whole``."""
        if not b.zero_axes:
            return
        if len(b.zero_axes) == 1 and self.mesh.device.type == "cpu":  # the host ring gathers in place
            C.all_gather_nograd(whole[b.lo : b.hi], self.mesh, b.zero_axes[0], 0, out=whole)
            return
        part = whole[b.lo : b.hi].clone()  # an all-gather's input must not overlap its output
        for a in reversed(b.zero_axes[1:]):
            part = C.all_gather_nograd(part, self.mesh, a, 0)
        C.all_gather_nograd(part, self.mesh, b.zero_axes[0], 0, out=whole)


def _check_leaf(path: str, spec: P, x: Any, data_axes: tuple[str, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise StepError(f"leaf '{path}' is a {type(x).__name__}, not a tensor")
    for a in data_axes:
        # "ep" is the one data axis a model shards leaves over itself (experts): it routes every row's tokens to
        # the rank holding their expert (all_to_all), so the gradient of each shard is already whole
        if a in spec.axes and a != "ep":
            raise SpecError(
                f"leaf '{path}': spec {spec} shards over '{a}'; compile_step keeps parameters whole over the data "
                f"axes ({', '.join(data_axes)}) and partitions their optimizer state instead (zero=1/2)"
            )
    if "pp" in spec.axes:
        raise SpecError(f"leaf '{path}': spec {spec} names 'pp', which compile_step does not use")


def _chunks(idx: list[int], nbytes: list[int], limit: int) -> list[list[int]]:
    chunks, cur, size = [], [], 0
    for i in idx:
        if cur and size + nbytes[i] > limit:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes[i]
    chunks.append(cur)
    return chunks


def _bucket(dtype, repl, chunk, sizes, mesh: "Mesh", zero: int, data_axes) -> Bucket:
    zero_axes = repl if zero >= 1 else ()
    parts = math.prod(mesh.axis_size(a) for a in zero_axes)
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    length = sum(sizes)
    padded = -(-length // parts) * parts
    part = 0
    for a in zero_axes:
        part = part * mesh.axis_size(a) + mesh.coord(a)
    n = padded // parts
    lo, hi = part * n, (part + 1) * n
    ranges = tuple((min(max(lo - o, 0), k), min(max(hi - o, 0), k)) for o, k in zip(offsets, sizes, strict=True))
    return Bucket(
        dtype, tuple(zero_axes), tuple(a for a in repl if a in data_axes), tuple(chunk), tuple(offsets),
        tuple(sizes), length, padded, lo, hi,
        zero >= 1 or all(mesh.coord(a) == 0 for a in repl), ranges,
    )
