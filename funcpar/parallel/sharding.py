"""Global <-> local trees: ``shard`` cuts each rank's blocks out of global tensors, ``gather`` reassembles them.

Both walk the tree leaf by leaf, so the extra memory at any moment is about one leaf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import optree
import torch

from funcpar.parallel import collectives as C
from funcpar.parallel import p2p as P2P
from funcpar.spec import P, broadcast_specs, global_shape, local_slice, validate

if TYPE_CHECKING:  # pragma: no cover
    from funcpar.parallel.mesh import Mesh

__all__ = ["shard", "gather", "gathered_leaves", "shard_leaf", "gather_leaf", "ShardingError"]


class ShardingError(ValueError):
    """A bad argument to shard/gather."""


def shard_leaf(x: torch.Tensor, spec: P, mesh: "Mesh", path: str = "") -> torch.Tensor:
    """This rank's block of the global tensor ``x``, on the mesh's device (a fresh contiguous tensor, so ``x``,
    e.g. a CPU initialisation, can be freed)."""
    idx = local_slice(spec, tuple(x.shape), mesh, path=path)
    block = x[idx]
    if block.device != mesh.device:
        return block.to(mesh.device, memory_format=torch.contiguous_format)
    return block.clone(memory_format=torch.contiguous_format)


def gather_leaf(
    x: torch.Tensor, spec: P, mesh: "Mesh", dst: int | None = None, path: str = ""
) -> torch.Tensor | None:
    """The global tensor from this rank's block ``x``: on every rank, or only on global rank ``dst``."""
    if len(spec) > x.ndim:
        validate(spec, tuple(x.shape), mesh, path)  # raises: spec longer than the tensor
    gshape = global_shape(spec, tuple(x.shape), mesh)
    validate(spec, gshape, mesh, path)
    if dst is None:
        y = x
        for i in range(len(spec)):
            # minor axis first: after gathering it, each block of the next-major axis is contiguous
            for a in reversed(spec.axes_of(i)):
                y = C.all_gather_nograd(y, mesh, a, i)
        return y if y is not x else x.detach().clone()
    if mesh.size == 1:
        return x.detach().clone()
    # Only one rank per distinct block sends: the one at coordinate 0 of every axis the spec does not name.
    named = set(spec.axes)
    sources = [r for r in range(mesh.size) if all(mesh.coords_of(r)[a] == 0 for a in mesh.axis_names if a not in named)]
    blocks = P2P.gather_blocks_to(x.detach(), mesh, sources, dst)
    if blocks is None:
        return None
    out = x.new_empty(gshape)
    for r, b in zip(sources, blocks, strict=True):
        out[local_slice(spec, gshape, mesh, coords=mesh.coords_of(r))] = b
    return out


def shard(tree: Any, specs: Any, mesh: "Mesh") -> Any:
    """Global tree -> this rank's local tree, on ``mesh.device``. Every rank passes the same global values."""
    matched = broadcast_specs(specs, tree)
    _, treedef = optree.tree_flatten(tree)
    return optree.tree_unflatten(treedef, [shard_leaf(x, s, mesh, p) for p, s, x in matched])


def gather(tree: Any, specs: Any, mesh: "Mesh", dst: int | None = None) -> Any:
    """Local tree -> global tree, on every rank (``dst=None``) or only on global rank ``dst`` (``None`` elsewhere).

    Collective: every rank must call it with the same specs. On a pipeline mesh each rank passes its stage tree
    (``None`` for the leaves other stages hold) and gets the whole model's tree.
    """
    _, treedef = optree.tree_flatten(tree, none_is_leaf=True)
    if dst is not None and not 0 <= dst < mesh.size:
        raise ShardingError(f"gather: dst={dst} is not a rank of {mesh} (ranks 0..{mesh.size - 1})")
    leaves = [g for _, _, g in gathered_leaves(tree, specs, mesh, dst)]
    if dst is not None and mesh.rank != dst:
        return None
    return optree.tree_unflatten(treedef, leaves)


class _Absent:
    """Stands for a leaf another pipeline stage holds, so that specs can be matched against the whole tree."""

    shape = ()


def gathered_leaves(tree: Any, specs: Any, mesh: "Mesh", dst: int | None = None):
    """Yield ``(path, spec, global tensor)`` for every leaf of the global tree, one at a time (the tensor only on
    ``dst`` when given, else on every rank). ``tree`` may be a pipeline stage tree: a leaf another stage holds is
    ``None`` here and comes from its holder over ``pp`` (its dtype and shape agreed first)."""
    leaves = optree.tree_leaves(tree, none_is_leaf=True)
    matched = broadcast_specs(specs, optree.tree_map(lambda x: _Absent() if x is None else x, tree,
                                                     none_is_leaf=True))
    if mesh.axis_size("pp") == 1:
        for p, s, x in matched:
            yield p, s, gather_leaf(x, s, mesh, dst, p)
        return
    desc = torch.full((len(leaves), 3 + P2P.MAX_DIMS), -1, dtype=torch.int64)  # the holding stage, dtype, shape
    for i, x in enumerate(leaves):
        if x is not None:
            desc[i, 0], desc[i, 1:] = mesh.coord("pp"), P2P.describe(x)
    desc = C.all_reduce(desc.to(mesh.device), mesh, "pp", "max").cpu()  # the last stage holding a leaf sends it
    for (p, s, x), d in zip(matched, desc.tolist(), strict=True):
        if d[0] < 0:
            raise ShardingError(f"gather: no pipeline stage holds leaf '{p}'")
        whole = gather_leaf(x, s, mesh, None, p) if x is not None and d[0] == mesh.coord("pp") else None
        if whole is None:
            dtype, shape = P2P.described(d[1:])
            whole = torch.empty(global_shape(s, shape, mesh), dtype=dtype, device=mesh.device)
        whole = C.broadcast(whole, mesh, "pp", src=d[0])
        yield p, s, whole if dst is None or mesh.rank == dst else None
