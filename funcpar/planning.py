"""Planning a run before starting it: how each parameter is sharded over a mesh, and the memory each rank needs.

Everything here works on shapes only (``model.init(cfg, device="meta")``) and an abstract mesh
(:meth:`funcpar.Mesh.abstract`), so ``funcpar plan`` starts no processes and allocates no parameters.
"""

from __future__ import annotations

import math
import re
from typing import Any

from .spec import broadcast_specs, local_shape

__all__ = ["params_like", "sharding_table", "memory_plan", "OPTIMIZER_SLOTS", "print_plan"]

# fp32 tensors of optimizer state per parameter
OPTIMIZER_SLOTS = {"adamw": 2, "lion": 1, "sgd": 1}


def params_like(model, cfg) -> Any:
    """The model's parameter tree as shapes only (meta tensors)."""
    return model.init(cfg, device="meta")


def sharding_table(params_like, specs, mesh) -> str:
    """One row per leaf (layers collapsed when alike): global shape, spec, local shape, MiB per rank."""
    rows: dict[str, list] = {}
    for path, spec, x in broadcast_specs(specs, params_like):
        key = re.sub(r"\.\d+\.", ".*.", path)
        loc = local_shape(spec, tuple(x.shape), mesh, path)
        mib = math.prod(loc) * x.element_size() / 2**20
        row = rows.setdefault(key, [key, tuple(x.shape), spec, loc, mib, 0])
        row[5] += 1
    lines = [f"{'leaf':<28} {'global shape':<16} {'spec':<18} {'local shape':<16} {'MiB/rank':>9}"]
    for key, shape, spec, loc, mib, count in rows.values():
        name = key if count == 1 else f"{key} (x{count})"
        lines.append(f"{name:<28} {str(shape):<16} {str(spec):<18} {str(loc):<16} {mib * count:>9.3f}")
    return "\n".join(lines)


def memory_plan(params_like, specs, mesh, zero: int, opt_slots: int = 2) -> dict[str, float]:
    """Per-rank MiB of parameters, gradients and optimizer state (``opt_slots`` fp32 tensors per parameter).

    With ``zero >= 1`` a leaf's optimizer state is split over every mesh axis (pipeline stages aside) along which
    the leaf is replicated; with ``zero >= 2`` its gradient is split over ``dp`` too; with ``zero=3`` the parameters
    held between steps as well (and the optimizer state over ``dp`` only, as :mod:`funcpar.zero3` partitions it).
    """
    params = grads = opt = 0.0
    dp = mesh.axis_size("dp")
    for path, spec, x in broadcast_specs(specs, params_like):
        n = math.prod(local_shape(spec, tuple(x.shape), mesh, path))
        repl = [a for a in mesh.axis_names if a != "pp" and a not in spec.axes]
        parts = dp if zero == 3 else (math.prod(mesh.axis_size(a) for a in repl) if zero >= 1 else 1)
        params += n * x.element_size() / (dp if zero == 3 else 1)
        grads += n * x.element_size() / (dp if zero >= 2 else 1)
        opt += opt_slots * 4 * n / parts
    return {"params": params / 2**20, "grads": grads / 2**20, "optimizer": opt / 2**20,
            "total": (params + grads + opt) / 2**20}


def print_plan(model, cfg, mesh, zero: int, optimizer: str) -> None:
    """Print what ``funcpar plan`` shows: the parameter count, the sharding table and the per-rank memory."""
    from .tree import leaves_with_path

    like = params_like(model, cfg)
    specs = model.specs(cfg, mesh)
    print(f"{cfg.model_type} on {mesh!r}: {sum(x.numel() for _, x in leaves_with_path(like)):,} parameters")
    print(sharding_table(like, specs, mesh))
    mem = memory_plan(like, specs, mesh, zero, OPTIMIZER_SLOTS.get(optimizer, 2))
    print(f"per rank (zero={zero}, {optimizer}): params {mem['params']:.2f} MiB, grads "
          f"{mem['grads']:.2f} MiB, optimizer state {mem['optimizer']:.2f} MiB, total {mem['total']:.2f} MiB")
