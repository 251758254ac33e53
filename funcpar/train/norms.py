"""The train step's gradient-norm kernel: every bucket's sum of squares in float64, with one copy to the host.

It lives with the step (:meth:`funcpar.train.step.Step` reduces these sums over the mesh into the global norm it
passes to :func:`funcpar.optim.clip_by_global_norm` as ``global_norm=``). A bare optimizer that gets no norm computes
one plainly in :mod:`funcpar.optim.transforms` (:func:`~funcpar.optim.transforms.sum_of_squares`, float64 chunks),
which is also the exact path here.
"""

from __future__ import annotations

import math

import torch

from funcpar.optim.transforms import sum_of_squares

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # (bf16 and fp16 values are float32 values exactly)
_TINY = torch.finfo(torch.float32).tiny


def _row_sum_of_squares(x: torch.Tensor, row: int) -> torch.Tensor:
    """The float32 2-norms of ``row``-element rows of the flat ``x``, squared and summed in float64 (the tail in
    float64): a handful of kernels whatever the size, no device sync."""
    n = x.numel() // row * row
    total = torch.linalg.vector_norm(x[:n].reshape(-1, row), dim=1, dtype=torch.float32).double().square().sum()
    if n < x.numel():
        total = total + torch.linalg.vector_norm(x[n:], dtype=torch.float64).square()
    return total


def _needs_exact(total: float, numel: int) -> bool:
    """Whether the row path's ``total`` may be off: inf (a row past float32's range, an element above ~1e19) or
    within float32's subnormal range (the rows' squares lost digits, or underflowed to 0). NaN stays NaN."""
    return total == math.inf or total < numel * _TINY


def _to_host(ts: list) -> list:
    """Python floats of the 0-d tensors in ``ts`` (None stays None): one copy to the host (a sync) per device."""
    out = [None] * len(ts)
    for dev in dict.fromkeys(t.device for t in ts if t is not None):
        idx = [i for i, t in enumerate(ts) if t is not None and t.device == dev]
        for i, v in zip(idx, torch.stack([ts[i] for i in idx]).cpu().tolist(), strict=True):
            out[i] = v
    return out


def sums_of_squares(xs: list[torch.Tensor], chunk: int = 1 << 20, row: int = 128) -> torch.Tensor:
    """``(x ** 2).sum()`` of each of ``xs`` in float64, as one float64 tensor on the host: what the step's gradient
    norm needs, with one device sync (two where a result needs the exact path).

    A float32 norm of a million-element tensor is off by ~1e-3 relative, enough to move clipping off the
    single-process run's. Here a float, bf16 or fp16 ``x`` takes the float32 2-norms of ``row``-element rows, squared
    and summed in float64: each row within a float32 rounding, which mostly averages out over rows; a handful of
    kernels per tensor whatever its size, where float64 copies a chunk at a time cost more on the CPU and launched
    thousands of kernels a step on a GPU (docs/MEASUREMENTS.md, benchmarks/GPU.md). A result the rows
    may have got wrong (:func:`_needs_exact`) and any other dtype: float64 copies of ``chunk`` elements at a time
    (:func:`funcpar.optim.transforms.sum_of_squares`), all copied to the host together."""
    xs = [x.detach().reshape(-1) for x in xs]
    fast = _to_host([_row_sum_of_squares(x, row) if x.numel() and x.dtype in _FLOATS else None for x in xs])
    redo = [sum_of_squares(x, chunk) if x.numel() and (f is None or _needs_exact(f, x.numel())) else None
            for x, f in zip(xs, fast, strict=True)]
    exact = _to_host(redo)
    rows = zip(xs, fast, exact, strict=True)
    return torch.tensor([0.0 if not x.numel() else e if e is not None else f for x, f, e in rows], dtype=torch.float64)
