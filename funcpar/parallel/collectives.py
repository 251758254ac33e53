"""Differentiable collectives over one mesh axis, and (with :mod:`funcpar.parallel.transport`) what calls
torch.distributed.

Each collective is a ``torch.autograd.Function`` with a separate ``setup_context`` and a ``vmap`` rule, so it works
under ``torch.func.grad``, ``vjp`` and ``vmap`` as well as ``.backward()``. Its backward is its conjugate collective
(itself a Function, so higher-order derivatives stay correct). Every function takes ``(x, mesh, axis)``; on an
axis of size 1 it returns ``x`` untouched, so at ``Mesh()`` a model is the single-device program.

Gradient convention (Megatron's, and the one that makes sharded gradients equal the single-device ones): the
objective is the sum over ranks of each rank's *partial* values and counts each *replicated* value once.

===========================  ======================  ======================  =====================================
function                     forward                 backward                typical use
===========================  ======================  ======================  =====================================
``copy_to_region``  (f)      identity                all-reduce sum          input of a column-parallel layer
``reduce_from_region`` (g)   all-reduce sum          identity                output of a row-parallel layer
``reduce_from_region_``      all-reduce sum in place identity                the same, on a temporary it consumes
``all_gather``               all-gather along dim    reduce-scatter          sequence-parallel entry
``reduce_scatter``           reduce-scatter          all-gather              sequence-parallel exit
``scatter_to_region``        keep own block of dim   all-gather              replicated -> sharded (split)
``gather_from_region``       all-gather along dim    keep own block          sharded -> replicated (gather)
``all_to_all``               block j to rank j       the same exchange       expert parallelism (token dispatch)
===========================  ======================  ======================  =====================================

Non-differentiable: :func:`all_reduce` (sum/max/min/avg, over one axis or several, for statistics such as a global
gradient norm) and :func:`broadcast`; point-to-point operations (pipeline stages) live in :mod:`funcpar.parallel.p2p`.
Every wait is bounded by the mesh's timeout: a dead or stuck peer becomes an error, not a hang
(:mod:`funcpar.parallel.transport`, which also holds the rings host tensors reduce-scatter and all-gather over).

What a collective sends goes through the mesh's ``comm``, chosen once by its kind: :class:`CollectiveWire` (a
:class:`funcpar.Mesh`: torch.distributed over the axis's process group) or :class:`CollectiveSimulation` (an abstract
mesh, for planning: nothing sent, traffic counted, buffers filled as if every rank held this rank's values);
:mod:`funcpar.parallel.p2p` adds the messages to both.
"""

from __future__ import annotations

import functools

from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from funcpar.parallel.transport import (CollectiveError, count as _count, fill, pieces, ring_all_gather,
                                        ring_reduce_scatter)
from funcpar.parallel.transport import note_collective, wait as _wait

if TYPE_CHECKING:  # pragma: no cover
    from funcpar.parallel.mesh import Mesh
    from funcpar.parallel.transport import Segments

__all__ = [
    "copy_to_region", "reduce_from_region", "reduce_from_region_", "all_gather", "reduce_scatter",
    "scatter_to_region", "gather_from_region", "all_to_all", "all_reduce", "all_gather_nograd",
    "reduce_scatter_nograd", "reduce_scatter_segments", "all_reduce_start", "broadcast", "barrier", "CollectiveError",
    "CollectiveWire", "CollectiveSimulation",
]


# ---------------------------------------------------------------------------------------------------------------
# the mesh's communication, by kind (mesh.comm): the only calls into torch.distributed, and their stand-ins
# ---------------------------------------------------------------------------------------------------------------

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed the flat-tensor collectives; keep working on the older names too
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise CollectiveError(f"dim {dim} is out of range for a tensor of rank {ndim}")
    return dim % ndim


def _check_divisible(x: torch.Tensor, dim: int, mesh: "Mesh", axis: str, what: str) -> int:
    n = mesh.axis_size(axis)
    if x.shape[dim] % n:
        raise CollectiveError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} (size {x.shape[dim]}) is not divisible "
            f"by mesh axis '{axis}' of size {n}"
        )
    return n


class CollectiveWire:
    """The collectives of a :class:`funcpar.Mesh` (its ``comm``, with :mod:`funcpar.parallel.p2p`'s messages):
    torch.distributed over the axis's process group (``axis="world"``: the default group), each collective counted
    and recorded as it is posted (:func:`funcpar.parallel.transport.count`) and waited for within the mesh's timeout.
    Host tensors reduce-scatter and all-gather over funcpar's rings, CUDA tensors over NCCL's collectives. Each
    method takes contiguous tensors (``xm``: this rank's, its blocks along dimension 0)."""

    def all_reduce(self, y: torch.Tensor, mesh: "Mesh", axis: str, op: str) -> torch.Tensor:
        """``y`` reduced in place (``op``: sum, max or min) and returned."""
        group = None if axis == "world" else mesh.group(axis)
        _count(mesh, axis, 2 * y.numel() * y.element_size(), f"all_reduce({op})")  # reduce-scatter + all-gather
        work = dist.all_reduce(y, op=_REDUCE_OPS[op], group=group, async_op=True)
        _wait(work, mesh, f"all_reduce({op})", axis)
        return y

    def all_reduce_start(self, x: torch.Tensor, mesh: "Mesh", axis: str) -> "Callable[[], torch.Tensor]":
        """Start summing ``x`` in place; returns what waits for it (:func:`all_reduce_start`)."""
        _count(mesh, axis, 2 * x.numel() * x.element_size(), "all_reduce(sum)")  # reduce-scatter + all-gather
        work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=mesh.group(axis), async_op=True)

        def done() -> torch.Tensor:
            _wait(work, mesh, "all_reduce(sum)", axis)
            return x

        return done

    def all_gather(self, xm: torch.Tensor, out: torch.Tensor, mesh: "Mesh", axis: str) -> None:
        """``out`` = the ranks' ``xm`` one after another along dimension 0."""
        _count(mesh, axis, out.numel() * out.element_size(), "all_gather")
        if out.device.type == "cpu":
            ring_all_gather(xm, out, mesh, axis)
        else:
            _wait(_all_gather_flat(out, xm, group=mesh.group(axis), async_op=True), mesh, "all_gather", axis)

    def reduce_scatter(self, xm: torch.Tensor, out: torch.Tensor, mesh: "Mesh", axis: str) -> None:
        """``out`` = this rank's block (along dimension 0) of the sum of the ranks' ``xm``."""
        if out.device.type == "cpu":  # the host ring, over the one segment
            self.reduce_scatter_segments([(0, xm.view(-1))], xm.numel(), out.view(-1), mesh, axis)
        else:
            _count(mesh, axis, xm.numel() * xm.element_size(), "reduce_scatter")
            _wait(_reduce_scatter_flat(out, xm, group=mesh.group(axis), async_op=True), mesh, "reduce_scatter", axis)

    def segments_on(self, t: torch.Tensor) -> bool:
        """Whether :meth:`reduce_scatter_segments` runs on tensors where ``t`` is: the host ring's, on the host."""
        return t.is_cpu

    def reduce_scatter_segments(self, segs: "Segments", total: int, out: torch.Tensor, mesh: "Mesh",
                                axis: str) -> None:
        """``out`` (1-D) = this rank's block of the sum of the ranks' flat ranges ``segs`` describe (host tensors:
        :meth:`segments_on`)."""
        _count(mesh, axis, total * out.element_size(), "reduce_scatter")
        ring_reduce_scatter(segs, total, out, mesh, axis)

    def all_to_all(self, xm: torch.Tensor, mesh: "Mesh", axis: str) -> torch.Tensor:
        """Block j of ``xm`` to rank j; rank j's block for this rank at place j."""
        _count(mesh, axis, xm.numel() * xm.element_size(), "all_to_all")  # (n-1)/n of the blocks leave, as in a ring
        out = torch.empty_like(xm)
        _wait(dist.all_to_all_single(out, xm, group=mesh.group(axis), async_op=True), mesh, "all_to_all", axis)
        return out

    def broadcast(self, x: torch.Tensor, mesh: "Mesh", axis: str, src: int) -> torch.Tensor:
        """A new tensor: the value of the rank at coordinate ``src`` along ``axis``."""
        y = x.detach().clone(memory_format=torch.contiguous_format)
        note_collective(mesh, axis, f"broadcast(from {src})", y.numel() * y.element_size())
        work = dist.broadcast(y, src=mesh.group_ranks(axis)[src], group=mesh.group(axis), async_op=True)
        _wait(work, mesh, "broadcast", axis)
        return y


_WIRE = [0]  # > 0 while a simulated collective stands in for the wire (on_simulated_wire)


def on_simulated_wire() -> bool:
    """True inside a :class:`CollectiveSimulation` collective: the operators it runs to fill its outputs stand for
    the transport's work (counted as traffic), not the device's (a plan's time model leaves them out)."""
    return _WIRE[0] > 0


def simulated_wire(cls):
    """Every public method of ``cls`` marked as the wire's work while it runs (:func:`on_simulated_wire`)."""
    def wrap(fn):
        @functools.wraps(fn)
        def on_wire(*args, **kwargs):
            _WIRE[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                _WIRE[0] -= 1
        return on_wire
    for name, fn in list(vars(cls).items()):
        if callable(fn) and not name.startswith("_"):
            setattr(cls, name, wrap(fn))
    return cls


@simulated_wire
class CollectiveSimulation:
    """The collectives of an abstract mesh (:meth:`funcpar.Mesh.abstract`, for planning; its ``comm``, with
    :mod:`funcpar.parallel.p2p`'s messages): nothing is sent, every rank is taken to hold this rank's values. The
    allocations are the real run's (a host ring's staging block included), the numbers are not; the traffic is
    counted as a wire counts it, and nothing is recorded. The methods are :class:`CollectiveWire`'s."""

    def all_reduce(self, y: torch.Tensor, mesh: "Mesh", axis: str, op: str) -> torch.Tensor:
        n = _count(mesh, axis, 2 * y.numel() * y.element_size())  # reduce-scatter + all-gather
        return y.mul_(n) if op == "sum" else y

    def all_reduce_start(self, x: torch.Tensor, mesh: "Mesh", axis: str) -> "Callable[[], torch.Tensor]":
        x.mul_(_count(mesh, axis, 2 * x.numel() * x.element_size()))
        return lambda: x

    def all_gather(self, xm: torch.Tensor, out: torch.Tensor, mesh: "Mesh", axis: str) -> None:
        for block in out.chunk(_count(mesh, axis, out.numel() * out.element_size())):
            block.copy_(xm)

    def reduce_scatter(self, xm: torch.Tensor, out: torch.Tensor, mesh: "Mesh", axis: str) -> None:
        self.reduce_scatter_segments([(0, xm.view(-1))], xm.numel(), out.view(-1), mesh, axis)

    def segments_on(self, t: torch.Tensor) -> bool:
        return True  # (a plan's meta tensors too)

    def reduce_scatter_segments(self, segs: "Segments", total: int, out: torch.Tensor, mesh: "Mesh",
                                axis: str) -> None:
        host = mesh.device.type == "cpu"  # on host tensors the ring holds one more block while it runs (n > 2: two)
        staged = [torch.empty_like(out) for _ in range(min(mesh.axis_size(axis) - 2, 2))] if host else []
        fill(out, pieces(segs, 0, out.numel())).mul_(_count(mesh, axis, total * out.element_size()))
        staged.clear()  # (held while the ring would run)

    def all_to_all(self, xm: torch.Tensor, mesh: "Mesh", axis: str) -> torch.Tensor:
        n = _count(mesh, axis, xm.numel() * xm.element_size())  # every rank sends its own block, as this one
        return xm.view(n, -1)[mesh.coord(axis)].repeat(n, 1).view(xm.shape)

    def broadcast(self, x: torch.Tensor, mesh: "Mesh", axis: str, src: int) -> torch.Tensor:
        return x.detach().clone()


def _raw_all_reduce(x: torch.Tensor, mesh: "Mesh", axis: str, op: str = "sum", inplace: bool = False) -> torch.Tensor:
    """All-reduce over ``axis``, or over the whole mesh for ``axis="world"``: into a copy, or ``inplace`` into ``x``
    (contiguous)."""
    y = x.detach() if inplace else x.detach().clone(memory_format=torch.contiguous_format)
    return mesh.comm.all_reduce(y, mesh, axis, op)


def all_reduce_start(x: torch.Tensor, mesh: "Mesh", axis: str) -> "Callable[[], torch.Tensor]":
    """Start summing ``x`` over ``axis`` *in place* and return a function that waits for it (bounded by the mesh's
    timeout) and returns ``x``. For work that overlaps communication with computation: ``x`` must be the caller's
    own tensor, left untouched until the wait. Not differentiable (a layer's backward calls it)."""
    if _trivial(mesh, axis):
        return lambda: x
    return mesh.comm.all_reduce_start(x, mesh, axis)


def _raw_all_gather(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    n = mesh.axis_size(axis)
    xm = x.detach().movedim(dim, 0).contiguous()
    if out is None or dim:
        out = xm.new_empty((n * xm.shape[0], *xm.shape[1:]))
    mesh.comm.all_gather(xm, out, mesh, axis)
    return out.movedim(0, dim).contiguous() if dim else out


def _raw_reduce_scatter(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int) -> torch.Tensor:
    n = _check_divisible(x, dim, mesh, axis, "reduce_scatter")
    xm = x.detach().movedim(dim, 0).contiguous()
    out = xm.new_empty((xm.shape[0] // n, *xm.shape[1:]))
    mesh.comm.reduce_scatter(xm, out, mesh, axis)
    return out.movedim(0, dim).contiguous() if dim else out


def _raw_all_to_all(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int) -> torch.Tensor:
    _check_divisible(x, dim, mesh, axis, "all_to_all")
    out = mesh.comm.all_to_all(x.detach().movedim(dim, 0).contiguous(), mesh, axis)
    return out.movedim(0, dim).contiguous()


def _own_block(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int) -> torch.Tensor:
    n = _check_divisible(x, dim, mesh, axis, "scatter_to_region")
    k = x.shape[dim] // n
    return x.narrow(dim, mesh.coord(axis) * k, k).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# differentiable collectives
# ---------------------------------------------------------------------------------------------------------------


def _function(name: str, op, conjugate: str) -> type:
    """An autograd Function whose forward is ``op(x, mesh, axis[, dim])`` and whose backward is the Function named
    ``conjugate``, with a separate ``setup_context`` and a ``vmap`` rule (a batch dimension moves to the front and a
    ``dim`` argument shifts by one), so it works under ``torch.func`` transforms as well as ``.backward()``."""

    def forward(x, *args):
        return op(x, *args)

    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    def backward(ctx, g):
        return (_FUNCTIONS[conjugate].apply(g, *ctx.args), *([None] * len(ctx.args)))

    def vmap(info, in_dims, x, *args):
        fn, bdim = _FUNCTIONS[name], in_dims[0]
        if bdim is None:
            return fn.apply(x, *args), None
        if len(args) == 2:  # element-wise: the batch dimension stays where it is
            return fn.apply(x, *args), bdim
        mesh, axis, dim = args
        x = x.movedim(bdim, 0)
        return fn.apply(x, mesh, axis, _norm_dim(dim, x.ndim - 1) + 1), 0

    members = {k: staticmethod(v) for k, v in
               dict(forward=forward, setup_context=setup_context, backward=backward, vmap=vmap).items()}
    _FUNCTIONS[name] = cls = type(name, (torch.autograd.Function,), members)
    return cls


_FUNCTIONS: dict[str, type] = {}
# (name, forward, conjugate): each collective's backward is its conjugate collective (itself a Function, so
# higher-order derivatives stay correct)
_CopyToRegion = _function("_CopyToRegion", lambda x, mesh, axis: x.view_as(x), "_ReduceFromRegion")
_ReduceFromRegion = _function("_ReduceFromRegion", lambda x, mesh, axis: _raw_all_reduce(x, mesh, axis),
                              "_CopyToRegion")
_AllGather = _function("_AllGather", lambda x, mesh, axis, dim: _raw_all_gather(x, mesh, axis, dim), "_ReduceScatter")
_ReduceScatter = _function("_ReduceScatter", lambda x, mesh, axis, dim: _raw_reduce_scatter(x, mesh, axis, dim),
                           "_AllGather")
_ScatterToRegion = _function("_ScatterToRegion", lambda x, mesh, axis, dim: _own_block(x, mesh, axis, dim),
                             "_GatherFromRegion")
_GatherFromRegion = _function("_GatherFromRegion", lambda x, mesh, axis, dim: _raw_all_gather(x, mesh, axis, dim),
                              "_ScatterToRegion")
_AllToAll = _function("_AllToAll", _raw_all_to_all, "_AllToAll")  # even blocks: its own conjugate


def _trivial(mesh: "Mesh", axis: str) -> bool:
    return mesh.axis_size(axis) == 1


def copy_to_region(x: torch.Tensor, mesh: "Mesh", axis: str) -> torch.Tensor:
    """f: identity forward, all-reduce-sum of the gradient backward (a replicated input feeding sharded work)."""
    return x if _trivial(mesh, axis) else _CopyToRegion.apply(x, mesh, axis)


def reduce_from_region(x: torch.Tensor, mesh: "Mesh", axis: str) -> torch.Tensor:
    """g: all-reduce-sum of partial results forward, identity backward (output of a row-parallel layer)."""
    return x if _trivial(mesh, axis) else _ReduceFromRegion.apply(x, mesh, axis)


class _ReduceFromRegionInPlace(torch.autograd.Function):
    @staticmethod
    def forward(x, mesh, axis):
        _raw_all_reduce(x, mesh, axis, inplace=True)
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])  # anything that saved x for its backward now fails loudly there
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        return _CopyToRegion.apply(g, *ctx.args), None, None

    @staticmethod
    def vmap(info, in_dims, x, mesh, axis):
        fn = _ReduceFromRegionInPlace if x.is_contiguous() else _ReduceFromRegion  # (element-wise: any layout)
        return fn.apply(x, mesh, axis), in_dims[0]


def reduce_from_region_(x: torch.Tensor, mesh: "Mesh", axis: str) -> torch.Tensor:
    """:func:`reduce_from_region` summing ``x`` *in place* and returning it: for a temporary nothing else reads
    (a row-parallel linear's fresh output), it saves a copy of the activation per call. An operation that saved
    ``x`` for its backward raises there (``x`` is marked dirty). Not contiguous: a copy is summed instead."""
    if _trivial(mesh, axis):
        return x
    return (_ReduceFromRegionInPlace if x.is_contiguous() else _ReduceFromRegion).apply(x, mesh, axis)


def all_gather(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int = 0) -> torch.Tensor:
    """Concatenate the ranks' blocks along ``dim`` forward; reduce-scatter the gradient backward.

    Use it where the gathered tensor feeds *partial* per-rank work (sequence parallelism before a column-parallel
    layer). Where it feeds replicated work, use :func:`gather_from_region`.
    """
    if _trivial(mesh, axis):
        return x
    return _AllGather.apply(x, mesh, axis, _norm_dim(dim, x.ndim))


def reduce_scatter(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int = 0) -> torch.Tensor:
    """Sum partial tensors and keep this rank's block of ``dim`` forward; all-gather the gradient backward."""
    if _trivial(mesh, axis):
        return x
    return _ReduceScatter.apply(x, mesh, axis, _norm_dim(dim, x.ndim))


def scatter_to_region(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int = -1) -> torch.Tensor:
    """Keep this rank's block of a replicated tensor along ``dim`` (no communication); all-gather backward."""
    if _trivial(mesh, axis):
        return x
    return _ScatterToRegion.apply(x, mesh, axis, _norm_dim(dim, x.ndim))


def gather_from_region(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' blocks along ``dim`` into a replicated tensor; keep own block of the gradient."""
    if _trivial(mesh, axis):
        return x
    return _GatherFromRegion.apply(x, mesh, axis, _norm_dim(dim, x.ndim))


def all_to_all(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int = 0) -> torch.Tensor:
    """Block j of ``dim`` to rank j, rank j's block for this rank at place j; the same exchange backward."""
    return x if _trivial(mesh, axis) else _AllToAll.apply(x, mesh, axis, _norm_dim(dim, x.ndim))


# ---------------------------------------------------------------------------------------------------------------
# non-differentiable helpers
# ---------------------------------------------------------------------------------------------------------------


def _axes(axis: str | Sequence[str]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


class _AllReduceStat(torch.autograd.Function):
    """Non-differentiable all-reduce, as a Function so that it unwraps torch.func transforms' tensors."""

    @staticmethod
    def forward(x, mesh, axes, op):
        y, n = x.detach(), 1
        for a in axes:
            if not _trivial(mesh, a):
                y = _raw_all_reduce(y, mesh, a, "sum" if op == "avg" else op)  # a new tensor
                n *= mesh.axis_size(a)
        return y.clone() if n == 1 else (y / n if op == "avg" else y)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - outputs are non-differentiable
        return None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, mesh, axes, op):
        return _AllReduceStat.apply(x, mesh, axes, op), in_dims[0]


def all_reduce(x: torch.Tensor, mesh: "Mesh", axis: str | Sequence[str], op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over one axis or several (``("dp", "tp")``); returns a new tensor that carries no gradient.

    ``op`` is ``"sum"``, ``"max"``, ``"min"`` or ``"avg"`` (sum divided by the number of ranks reduced over).
    Usable inside ``torch.func`` transforms (statistics such as a softmax's running max).
    """
    if op not in ("sum", "max", "min", "avg"):
        raise CollectiveError(f"all_reduce: unknown op {op!r}; use 'sum', 'max', 'min' or 'avg'")
    axes = _axes(axis)
    for a in axes:
        mesh.axis_size(a)  # unknown axis -> a clear MeshError
    return _AllReduceStat.apply(x.detach(), mesh, axes, op)


def all_gather_nograd(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int = 0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """The ranks' blocks of ``x`` concatenated along ``dim`` (no autograd; for the train step's own plumbing).
    ``out`` (``dim=0`` only): write the result there instead of into a new tensor; ``x`` must not overlap it, or on
    host tensors may be exactly this rank's block of it (gathered in place)."""
    if out is not None and (dim != 0 or out.shape[0] != x.shape[0] * mesh.axis_size(axis)):
        raise CollectiveError(f"all_gather_nograd: out {tuple(out.shape)} does not fit {mesh.axis_size(axis)} blocks "
                              f"of {tuple(x.shape)} along dim 0")
    if _trivial(mesh, axis):
        return x if out is None else out.copy_(x)
    return _raw_all_gather(x, mesh, axis, _norm_dim(dim, x.ndim), out)


def reduce_scatter_nograd(x: torch.Tensor, mesh: "Mesh", axis: str, dim: int = 0) -> torch.Tensor:
    """This rank's block along ``dim`` of the sum of the ranks' ``x`` (no autograd; the train step's plumbing)."""
    return x if _trivial(mesh, axis) else _raw_reduce_scatter(x, mesh, axis, _norm_dim(dim, x.ndim))


def reduce_scatter_segments(segs: "Segments", total: int, mesh: "Mesh", axis: str) -> torch.Tensor:
    """:func:`reduce_scatter_nograd` of the 1-D tensor of ``total`` elements that ``segs`` describe (``[(offset, 1-D
    tensor)]``, sorted, zeros between them) without building it: host tensors only (the ring sends and adds each
    block's pieces where they lie: the train step's gradient leaves, no bucket-sized copy of them)."""
    n, first = mesh.axis_size(axis), segs[0][1]
    if total % n or not mesh.comm.segments_on(first):
        raise CollectiveError(f"reduce_scatter_segments: {total} elements over mesh axis '{axis}' of size {n}, on "
                              f"{first.device}: needs a multiple of {n}, on the host")
    out = first.new_empty(total // n)
    if _trivial(mesh, axis):
        return fill(out, pieces(segs, 0, total))
    mesh.comm.reduce_scatter_segments(segs, total, out, mesh, axis)
    return out


def barrier(mesh: "Mesh") -> None:
    """Wait until every rank of the mesh gets here (bounded by the mesh's timeout)."""
    if mesh.size > 1:
        _raw_all_reduce(torch.zeros(1, device=mesh.device), mesh, "world")


def broadcast(x: torch.Tensor, mesh: "Mesh", axis: str, src: int = 0) -> torch.Tensor:
    """The value held by the rank at coordinate ``src`` along ``axis``, on every rank of the group."""
    if _trivial(mesh, axis):
        return x.detach().clone()
    return mesh.comm.broadcast(x, mesh, axis, src)
