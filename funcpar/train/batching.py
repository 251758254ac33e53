"""The train step's batches: their rows, the split into micro-batches, and the ``check=True`` consistency test.

Private to :mod:`funcpar.train.step`.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from funcpar.parallel import collectives as C
from funcpar.spec import broadcast_specs
from funcpar.state import StepError
from funcpar.tree import path_str


def batch_items(batch: Any) -> list[tuple[str, torch.Tensor]]:
    paths, leaves, _ = optree.tree_flatten_with_path(batch)
    return [(f"batch[{path_str(p)!r}]", x) for p, x in zip(paths, leaves, strict=True) if isinstance(x, torch.Tensor)]


def rows(batch: Any) -> int:
    items = batch_items(batch)
    if not items:
        raise StepError("the batch holds no tensors")
    n = items[0][1].shape[0]
    for path, x in items:
        if x.shape[0] != n:
            raise StepError(f"batch entries disagree on the batch dimension: {path} has {x.shape[0]} rows, not {n}")
    return n


def split(batch: Any, n: int) -> list[Any]:
    treedef = optree.tree_structure(batch)
    cols = [x.chunk(n, 0) if isinstance(x, torch.Tensor) else [x] * n for x in optree.tree_leaves(batch)]
    return [optree.tree_unflatten(treedef, [c[i] for c in cols]) for i in range(n)]


def check_consistency(mesh, specs, params: Any | None, batch: Any, batch_axes: tuple[str, ...],
                      leaf_axes: tuple[str, ...]) -> None:
    """The batch agrees across ``batch_axes`` (the model axes, and ``pp``), every leaf of ``params`` (whole local
    leaves; ``None`` to skip) along its replicated axes among ``leaf_axes``; raises naming the first that does not."""
    items = [(name, x, batch_axes) for name, x in batch_items(batch)]
    if params is not None:
        items += [(f"leaf '{p}'", x, tuple(a for a in leaf_axes if a not in s.axes))
                  for p, s, x in broadcast_specs(specs, params)]
    for axis in dict.fromkeys(batch_axes + leaf_axes):
        sel = [(n, x) for n, x, axes in items if axis in axes]
        if mesh.axis_size(axis) == 1 or not sel:
            continue
        v = torch.stack([_checksums(x) for _, x in sel])
        hi, neg_lo = C.all_reduce(torch.stack([v, -v]), mesh, axis, "max")  # (max and min in one all-reduce)
        bad = (hi != -neg_lo).any(-1).nonzero()
        if len(bad):
            name = sel[int(bad[0])][0]
            what = "Data inconsistency within the TP group" if axis == "tp" else f"Replicas disagree over {axis}"
            raise StepError(
                f"{what}: {name} differs across mesh axis '{axis}' (group ranks {mesh.group_ranks(axis)}); "
                f"every rank of the group must hold the same values"
                + (f" (feed every {axis} rank the same batch)" if name.startswith("batch") else "")
            )


def batch_drift(mesh, batch: Any, axes: tuple[str, ...]) -> torch.Tensor:
    """This rank's share of a sum that is zero over the whole mesh when every group along each of ``axes`` holds
    the same ``batch``, for the step to add to an all-reduce it makes anyway: per axis of size n > 1, the batch's
    checksums times n - 1 on the group's first rank and times -1 on the others, weighted by the group's index (so
    that groups do not cancel). Beside each term its size and whether it is an integer (checksums of integer
    tensors are: their sum is then exact, and :func:`drifted` asks for exactly zero)."""
    items = batch_items(batch)
    c = torch.cat([_checksums(x) for _, x in items])  # (on the batch's device: no sync before the step)
    whole = torch.cat([torch.full((2,), float(not x.is_floating_point()), dtype=torch.float64, device=c.device)
                       for _, x in items])
    coords, out = mesh.coords, []
    for a in axes:
        n = mesh.axis_size(a)
        if n == 1:
            continue
        group, stride = 1, 1
        for b in (b for b in mesh.axis_names if b != a):  # (1 + the group's index along the other axes)
            group, stride = group + coords[b] * stride, stride * mesh.axis_size(b)
        term = c * ((n - 1) if coords[a] == 0 else -1) * group
        out.append(torch.stack([term, term.abs(), whole], 1).reshape(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64, device=c.device)


def drifted(summed: torch.Tensor) -> bool:
    """Whether :func:`batch_drift`'s terms, summed over the mesh, say a group's batches differ: an integer sum
    (exact below 2**53) that is not zero, or a float one away from zero by more than round-off of its terms."""
    t = summed.reshape(-1, 3)
    exact = (t[:, 2] > 0) & (t[:, 1] < 2.0**53)
    return bool(((exact & (t[:, 0] != 0)) | (~exact & (t[:, 0].abs() > 1e-9 * t[:, 1]))).any())


def _checksums(x: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """Two float64 sums (plain, and position-weighted) of ``x``, a chunk at a time (no whole float64 copy)."""
    x = x.detach().reshape(-1)
    out = torch.zeros(2, dtype=torch.float64, device=x.device)
    for i in range(0, x.numel(), chunk):
        c = x[i : i + chunk].double()
        w = torch.arange(i + 1, i + c.numel() + 1, dtype=torch.float64, device=x.device).remainder_(7.0).add_(1.0)
        out += torch.stack([c.sum(), (c * w).sum()])
    return out
