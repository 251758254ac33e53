"""ZeRO's gradient reduce-scatter overlapped with the backward pass.

:class:`BucketReducer` watches one micro-batch's backward: a hook on every parameter leaf (a fresh leaf of
:func:`funcpar.remat.grad_and_value`, called once with that leaf's whole gradient, as DDP's and FSDP's hooks are)
counts the leaves each ZeRO bucket still waits for. Buckets are reduced in one fixed order, the last first (the
backward meets the last layers first): as soon as a bucket and every bucket before it in that order are complete,
its reduce-scatter is handed to one worker thread, which runs it while the backward goes on. The rest (from the
first bucket holding a leaf the backward did not reach, whose gradient is zeros) are handed over after the
backward, in the same order, then the buckets that cannot overlap, and :meth:`BucketReducer.finish` waits for them
all.

The order is fixed so that every rank issues the same reductions in the same sequence whatever its graph does, and
the worker talks over a second process group per ZeRO axis (:meth:`funcpar.mesh.Mesh.lane`), so that collectives
the model's own backward issues on the main thread (an all-to-all over ``ep``, say) never interleave with it. The
worker's sums are the same ring's as without overlap (:meth:`funcpar.layout.ZeroLayout.reduce_leaves`), so the
gradients are bit for bit the same. Each wait is bounded by the mesh's timeout, and a failure in the worker is
raised by :meth:`finish` on the main thread.

Used for buckets reduced from their leaves on the host (gloo) over one ZeRO axis; other buckets (and a simulated
mesh, and ``compile=True``) are reduced after the backward as before.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .layout import Bucket, ZeroLayout
    from .mesh import Mesh

__all__ = ["BucketReducer", "Overlap", "overlappable"]


def overlappable(lay: "ZeroLayout", b: "Bucket") -> bool:
    """Whether bucket ``b`` can be reduced beside the backward: summed and partitioned over one axis, on the host,
    over a real (not simulated) group."""
    mesh = lay.mesh
    return (len(b.zero_axes) == 1 and b.sum_axes == b.zero_axes and mesh.device.type == "cpu"
            and not mesh.simulated and mesh.axis_size(b.zero_axes[0]) > 1)


class Overlap:
    """A step's worker thread (started on first use) and, per micro-batch, a :class:`BucketReducer` where any
    bucket can be reduced beside the backward."""

    def __init__(self) -> None:
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def reducer(self, lay: "ZeroLayout") -> "BucketReducer | None":
        if not any(overlappable(lay, b) for b in lay.buckets):
            return None
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="funcpar-reduce")
        return BucketReducer(lay, self.pool)


class _Lane:
    """``mesh`` with ``group(axis)`` answered by the mesh's second group for that axis (its lane)."""

    def __init__(self, mesh: "Mesh"):
        self._mesh = mesh

    def __repr__(self) -> str:
        return f"{self._mesh!r} (lane)"

    def group(self, axis: str):
        return self._mesh.lane(axis)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mesh, name)


class BucketReducer:
    """The reduce-scatters of one micro-batch's buckets, started from the backward's leaf hooks (``hook``) and
    collected by :meth:`finish` (this rank's reduced part of every bucket, in bucket order)."""

    def __init__(self, lay: "ZeroLayout", pool: concurrent.futures.ThreadPoolExecutor):
        self.lay, self.pool = lay, pool
        self.leaves: list[torch.Tensor | None] = [None] * len(lay.paths)
        self.waiting = [len(b.leaves) for b in lay.buckets]
        self.bucket_of = {i: k for k, b in enumerate(lay.buckets) for i in b.leaves}
        ks = list(reversed(range(len(lay.buckets))))  # the backward meets the last leaves first
        self.order = [k for k in ks if overlappable(lay, lay.buckets[k])]  # on the lane, from the hooks
        self.rest = [k for k in ks if k not in self.order]  # on the mesh's own groups, after the backward
        self.started: dict[int, concurrent.futures.Future] = {}
        self.next = 0  # position in ``order`` of the next bucket to start
        self.lane = _Lane(lay.mesh)
        for a in sorted({lay.buckets[k].zero_axes[0] for k in self.order}):
            lay.mesh.lane(a)  # (built now, by every rank in the same order, if not yet)

    def hook(self, i: int, g: torch.Tensor) -> None:
        """Leaf ``i``'s whole gradient ``g`` (left as it is): start every bucket now complete in turn."""
        self.leaves[i] = g
        k = self.bucket_of.get(i)
        if k is not None:
            self.waiting[k] -= 1
        self._start_ready()

    def _start_ready(self) -> None:
        while self.next < len(self.order) and self.waiting[self.order[self.next]] == 0:
            self.next += 1
            self._start(self.order[self.next - 1], self.lane)

    def _start(self, k: int, mesh: Any) -> None:
        self.started[k] = self.pool.submit(self.lay.reduce_leaves, self.lay.buckets[k], self.leaves, mesh)

    def finish(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """After the backward: ``grads`` is every leaf's gradient (zeros for unused leaves); the buckets not yet
        started are, in the same order, then the others; returns each bucket's reduced part once all are done."""
        for k in self.order[self.next:] + self.rest:
            for i in self.lay.buckets[k].leaves:
                self.leaves[i] = grads[i]
        grads[:] = [None] * len(grads)  # (each bucket's gradients are dropped once it is reduced)
        for k in self.order[self.next:]:
            self._start(k, self.lane)
        for k in self.rest:
            self._start(k, self.lay.mesh)
        return self._collect()

    def _collect(self) -> list[torch.Tensor]:
        """Every bucket's result; the first failure is raised once all have ended (none left running)."""
        out, err = {}, None
        for k, f in self.started.items():
            try:
                out[k] = f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others
                err = err or e
        if err is not None:
            raise err
        return [out[k] for k in range(len(self.lay.buckets))]

    def abandon(self) -> None:
        """After a backward that raised: start nothing more, and wait for what runs (its waits are bounded), so
        that no ring of this step is left running on the lane; its errors give way to the backward's."""
        for f in self.started.values():
            f.cancel()
        concurrent.futures.wait(list(self.started.values()))
