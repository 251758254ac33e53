"""ZeRO-3: parameters kept 1/dp per rank between uses, gathered block by block inside the loss.

The model's staged form (:class:`funcpar.model.Stages`) cuts it into units — the embedding leaves, each block, the head
leaves — one ZeRO bucket each (:meth:`funcpar.parallel.layout.ZeroLayout.build` with ``units``). The loss takes this
rank's parts and, unit by unit, all-gathers a part over the data axes with the *differentiable* ``all_gather`` (its
backward is a reduce-scatter: the gradient arrives at the part already summed over the data ranks, so the step has
nothing left to reduce), runs the unit, and lets the gathered weights go. Each block runs under
:func:`funcpar.nn.remat`, so what the backward pass keeps of it is its input and its part; the backward re-gathers the
block and recomputes it (FSDP's reshard-after-forward, at the cost of one more forward per block). At no time are
more than the embedding, the head and one block gathered.

Composed with tp: a unit's leaves are this rank's tp shards, and the data axes split them further.

Mixed precision (``param_dtype``), as FSDP's with an fp32 reduction: the loss is differentiated with respect to
float32 parts (the step's fp32 master parts, or fp32 copies of the compute parts where the masters are offloaded);
each gather casts the part to the compute dtype first, so it moves half the bytes of a float32 gather and the block
computes on exactly the values a ``zero=1`` run computes on (its compute copies are the masters rounded alike), and
its backward reduce-scatters the gradient in float32, as ``zero=1``'s fp32 buckets sum it (:func:`gather_as`).
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch
import torch.nn.functional as F

from funcpar.parallel import collectives as C
from funcpar.parallel.layout import ZeroLayout
from funcpar.nn.documents import documents_of
from funcpar.nn.remat import remat
from funcpar.state import StepError

__all__ = ["units_of", "stage_units", "Zero3Loss", "StageGather", "gather_params", "gather_as", "ZeroRows"]


class _GatherAs(torch.autograd.Function):
    """``part`` cast to ``dtype`` and all-gathered over ``axes`` (minor axis first) forward; the gradient cast back to
    ``part``'s dtype and reduce-scattered over them backward (once differentiable: ZeRO-3's backward is never
    differentiated again, and it runs outside ``torch.func`` transforms)."""

    @staticmethod
    def forward(part, mesh, axes, dtype):
        x = part.to(dtype)
        for a in reversed(axes):
            x = C.all_gather_nograd(x, mesh, a, 0)
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.axes, ctx.dtype = inputs[1], inputs[2], inputs[0].dtype

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        g = g.to(ctx.dtype)
        for a in ctx.axes:  # (the conjugate order: the outer axis first)
            g = C.reduce_scatter_nograd(g, ctx.mesh, a, 0)
        return g, None, None, None


def gather_as(part: torch.Tensor, mesh, axes: tuple[str, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A ZeRO-3 unit's whole flat bucket from this rank's ``part``: gathered over ``axes`` in ``dtype`` (default
    ``part``'s own), its gradient reduce-scattered in ``part``'s dtype (see the module docstring)."""
    if dtype is None or dtype == part.dtype:
        for a in reversed(axes):  # the differentiable gather: its backward is the reduce-scatter
            part = C.all_gather(part, mesh, a, 0)
        return part
    return _GatherAs.apply(part, mesh, tuple(axes), dtype)


def units_of(paths: list[str], stages, cfg) -> tuple[list[list[int]], int]:
    """Leaf indices per unit, in order of use: embedding, each block, head (a tied leaf in the embedding's unit);
    and the number of blocks."""
    embed, head = set(stages.embed_leaves(cfg)), set(stages.head_leaves(cfg))
    out: dict[Any, list[int]] = {"embed": []}
    for i, p in enumerate(paths):
        top, _, rest = p.partition(".")
        if top == stages.layers:
            out.setdefault(("block", int(rest.partition(".")[0])), []).append(i)
        elif top in embed:
            out["embed"].append(i)
        elif top in head:
            out.setdefault("head", []).append(i)
        else:
            raise StepError(f"zero=3: leaf '{p}' belongs to no unit of the model's staged form (embed leaves "
                            f"{sorted(embed)}, blocks under '{stages.layers}', head leaves {sorted(head)})")
    blocks = sorted(k for k in out if isinstance(k, tuple))
    return [out["embed"]] + [out[k] for k in blocks] + ([out["head"]] if "head" in out else []), len(blocks)


class _PartLookup(torch.autograd.Function):
    """``F.embedding`` of every data rank's ids on this rank's rows of a table, summed over the data axis: each
    id's row lives on exactly one rank, so each rank gets its own ids' rows whole. Backward, every rank's output
    gradient is gathered and each rank adds the rows it holds into its part's gradient: no gathered table and no
    dense (V, d) gradient either way (once differentiable, as :class:`_GatherAs`)."""

    @staticmethod
    def forward(rows, ids, mesh, axis, row0, dtype):
        every = C.all_gather_nograd(ids.reshape(-1), mesh, axis, 0)  # (n*N,): every data rank's ids, in rank order
        local, inside = _local_rows(every, row0, rows.shape[0])
        # (masks, not boolean indexing: shapes that do not depend on the values, so a plan on meta tensors runs it)
        held = rows[local] if rows.shape[0] else rows.new_zeros(local.numel(), rows.shape[1])  # (none held: zeros)
        out = torch.where(inside[:, None], held.to(dtype), torch.zeros((), dtype=dtype, device=rows.device))
        return C.reduce_scatter_nograd(out, mesh, axis, 0).view(*ids.shape, rows.shape[1])

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, ids, ctx.mesh, ctx.axis, ctx.row0, _ = inputs
        ctx.save_for_backward(ids)
        ctx.rows_shape, ctx.rows_dtype = rows.shape, rows.dtype

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        every = C.all_gather_nograd(ids.reshape(-1), ctx.mesh, ctx.axis, 0)
        g_all = C.all_gather_nograd(g.reshape(-1, g.shape[-1]), ctx.mesh, ctx.axis, 0)  # (n*N, d)
        local, inside = _local_rows(every, ctx.row0, ctx.rows_shape[0])
        g_all = torch.where(inside[:, None], g_all.to(ctx.rows_dtype), torch.zeros((), dtype=ctx.rows_dtype,
                                                                                    device=g.device))
        grad = torch.zeros(ctx.rows_shape, dtype=ctx.rows_dtype, device=g.device)
        if ctx.rows_shape[0]:
            grad.index_add_(0, local, g_all)  # (others' ids add zeros)
        return grad, None, None, None, None, None


def _local_rows(ids: torch.Tensor, row0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` as rows of a block of ``n`` rows from ``row0`` (clamped into it), and which of them fall inside."""
    local = ids - row0
    return local.clamp(0, max(n - 1, 0)), (local >= 0) & (local < n)


class ZeroRows:
    """A ZeRO-3 embedding table left in its parts, standing where the table stands in the parameter tree:
    ``F.embedding(ids, table)`` (what :func:`funcpar.nn.layers.vocab_embedding` does) looks the ids up on the rows this
    rank holds (:class:`_PartLookup`), so a lookup never gathers the table; any other torch function sees the whole
    table, gathered (``whole``). ``shape``, ``dtype`` and ``device`` are the table's."""

    def __init__(self, rows: torch.Tensor, row0: int, shape: tuple, dtype: torch.dtype, mesh, axis: str,
                 whole: Callable[[], torch.Tensor]):
        self.rows, self.row0, self.shape, self.dtype, self.mesh, self.axis = rows, row0, torch.Size(shape), dtype, \
            mesh, axis
        self.whole = whole
        self.device, self.ndim = rows.device, len(shape)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = {"padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False, "sparse": False}
        if (func is F.embedding and len(args) == 2 and isinstance(args[1], ZeroRows)
                and all(plain.get(k, object()) == v for k, v in kwargs.items())):  # (a plain lookup: the parts')
            ids, t = args
            return _PartLookup.apply(t.rows, ids, t.mesh, t.axis, t.row0, t.dtype)
        args, kwargs = optree.tree_map(lambda v: v.whole() if isinstance(v, ZeroRows) else v, (args, kwargs),
                                       is_leaf=lambda v: isinstance(v, ZeroRows))
        return func(*args, **kwargs)


class Zero3Loss:
    """``loss(parts, batch)``: the model's loss over this rank's parts (one per unit), gathering as it goes."""

    def __init__(self, layout: ZeroLayout, stages, cfg, mesh, data_axes: tuple[str, ...], n_blocks: int,
                 compute_dtype: torch.dtype | None = None):
        self.layout, self.stages, self.cfg, self.mesh = layout, stages, cfg, mesh
        self.compute_dtype = compute_dtype  # the gathers' dtype (mixed precision), else the parts' own
        self.axes = tuple(a for a in data_axes if mesh.axis_size(a) > 1)
        self.n_blocks = n_blocks  # units: 0 = embedding, 1..n_blocks = blocks, then the head's own leaves if any
        self.tied = bool(set(stages.head_leaves(cfg)) & set(stages.embed_leaves(cfg)))

    def gather(self, k: int, part: torch.Tensor) -> list[torch.Tensor]:
        """Unit ``k``'s leaves, gathered from this rank's ``part`` of it."""
        whole = gather_as(part, self.mesh, self.axes, self.compute_dtype)  # minor axis first, as the parts were cut
        return self.layout.unpack(self.layout.buckets[k], whole)

    def embed_leaves(self, part: torch.Tensor) -> list:
        """The embedding unit's leaves for ``stages.embed``: a lone 2-D table, cut over one data axis at a row
        boundary, as a :class:`ZeroRows` (its lookup reads the parts, the table is never gathered for it);
        anything else gathered."""
        b = self.layout.buckets[0]
        if len(b.leaves) != 1 or len(self.axes) != 1 or len(self.layout.shapes[b.leaves[0]]) != 2:
            return self.gather(0, part)
        i, (a, z) = b.leaves[0], b.ranges[0]
        rows, d = self.layout.shapes[i]
        if a % d or (z % d and z != rows * d):
            return self.gather(0, part)
        off = b.offsets[0] + a - b.lo  # (this rank's rows of the table within its part)
        mine = part[off : off + (z - a)].view(-1, d) if z > a else part[:0].view(0, d)
        dtype = self.compute_dtype or part.dtype
        return [ZeroRows(mine, a // d, (rows, d), dtype, self.mesh, self.axes[0], lambda: self.gather(0, part)[0])]

    def tree(self, units: dict[int, list[torch.Tensor]]) -> Any:
        """The parameter tree with the given units' leaves (``{unit: leaves}``), ``None`` elsewhere."""
        leaves: list = [None] * len(self.layout.shapes)
        for k, xs in units.items():
            for i, x in zip(self.layout.buckets[k].leaves, xs, strict=True):
                leaves[i] = x
        return self.layout.unflatten(leaves)

    def __call__(self, parts: list[torch.Tensor], batch: Any) -> torch.Tensor:
        st, cfg = self.stages, self.cfg
        mesh = documents_of(self.mesh, batch)  # (packed samples: each attends to itself)
        x = st.embed(self.tree({0: self.embed_leaves(parts[0])}), batch, cfg, mesh)
        for i in range(self.n_blocks):
            x = remat(self._block(i + 1, i, mesh))(parts[i + 1], x)
        head = {0: self.gather(0, parts[0])} if self.tied else {}  # a tied head: the embedding gathered again
        if len(parts) > self.n_blocks + 1:
            head[len(parts) - 1] = self.gather(len(parts) - 1, parts[-1])
        return st.head(self.tree(head), x, batch, cfg, mesh)

    def _block(self, k: int, i: int, mesh) -> Callable:
        def run(part, x):
            tree = self.tree({k: self.gather(k, part)})
            return self.stages.block(tree[self.stages.layers][i], x, i, self.cfg, mesh)

        return run


def stage_units(paths: list[str], stages, cfg, tied: list[str]) -> tuple[list[list[int]], dict[Any, int]]:
    """A pipeline stage's ZeRO-3 units, from the paths of the leaves it holds: a tied leaf's own unit (the first and
    the last stage hold it alike, so their parts line up and their gradients add), the embedding's other leaves,
    each layer it holds (or the half of it it holds), the head's other leaves; empty ones left out. Returns the units
    and their roles: ``{"tied": k, "embed": k, ("block", i): k, "head": k}``."""
    embed, head = set(stages.embed_leaves(cfg)), set(stages.head_leaves(cfg))
    out: dict[Any, list[int]] = {}
    for i, p in enumerate(paths):
        top, _, rest = p.partition(".")
        role = ("tied" if top in tied else ("block", int(rest.partition(".")[0])) if top == stages.layers
                else "embed" if top in embed else "head" if top in head else None)
        if role is None:
            raise StepError(f"zero=3: leaf '{p}' belongs to no unit of the model's staged form")
        out.setdefault(role, []).append(i)
    order = [r for r in ("tied", "embed") if r in out] + sorted(r for r in out if isinstance(r, tuple))
    order += ["head"] if "head" in out else []
    return [out[r] for r in order], {r: k for k, r in enumerate(order)}


class StageGather:
    """ZeRO-3 on a pipeline stage: this pp rank's units (:func:`stage_units`) kept as parts over the data axes and
    gathered as the executor reaches them (:class:`funcpar.pipeline.executor.Executor`): the ends whole for the
    embedding and the head, each layer under the executor's remat, so its backward gathers it again."""

    def __init__(self, layout: ZeroLayout, stages, cfg, mesh, data_axes: tuple[str, ...], roles: dict,
                 compute_dtype: torch.dtype | None = None):
        self.layout, self.stages, self.roles = layout, stages, roles
        self.units = Zero3Loss(layout, stages, cfg, mesh, data_axes, 0, compute_dtype)
        self.tied = roles.get("tied")

    def ends(self, parts: list[torch.Tensor], which: str) -> Any:
        """The tree ``stages.embed`` (``which="embed"``) or ``stages.head`` reads: its units gathered."""
        ks = [k for k in (self.tied, self.roles.get(which)) if k is not None]
        return self.units.tree({k: self.units.gather(k, parts[k]) for k in ks})

    def layer(self, i: int, part: torch.Tensor) -> Any:
        """Layer ``i``'s leaves that this stage holds, gathered from its unit's part."""
        k = self.roles[("block", i)]
        return self.units.tree({k: self.units.gather(k, part)})[self.stages.layers][i]

    def unit(self, i: int) -> int:
        return self.roles[("block", i)]


def gather_params(layout: ZeroLayout, parts: list[torch.Tensor]) -> Any:
    """Whole local leaves (a params tree) from the zero=3 parts: all-gathered over the ZeRO axes, no autograd."""
    leaves: list = [None] * len(layout.shapes)
    for b, part in zip(layout.buckets, parts, strict=True):
        for a in reversed(b.zero_axes):
            part = C.all_gather_nograd(part, layout.mesh, a, 0)
        for i, x in zip(b.leaves, layout.unpack(b, part), strict=True):
            leaves[i] = x
    return layout.unflatten(leaves)
