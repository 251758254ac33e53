"""Element-wise layers as single operations: RMSNorm, rotary embedding and SwiGLU as custom ``autograd.Function``
s that keep less for their backward than the composition does, and the *fused* kernels some of them run on large
host tensors.

**Fused kernels.** Eager PyTorch runs every element-wise op as its own pass over memory; at the sizes that matter
those passes, not the arithmetic, are the time. Where :func:`fusable` says so, RMSNorm's forward and backward, the
SwiGLU forward and backward and the cross-entropy's ``exp(logits - max)`` with its row sums
(:func:`exp_and_sum`) run as ``torch.compile``d kernels of the same formulas (inductor: one loop over the
tensors instead of three to seven; compiled at first use with dynamic sizes, again for a new number of dimensions,
dtype or device, and kept in inductor's on-disk cache for later processes). Rotary embedding was no faster compiled
and stays eager (docs/MEASUREMENTS.md). The fused results are the eager ones to round-off (an FMA or a summation
order: about 1e-7 relative), not bit for bit.

:data:`FUSE` (``FUNCPAR_FUSE`` in the environment): ``"auto"`` (default) fuses float32 host tensors of at least
:data:`MIN_NUMEL` elements (below it a compiled call's fixed cost outweighs the passes it saves; the unmeasured
GPU keeps torch's kernels), ``"on"`` at any size, dtype and device (where the Function takes the case at all: RMSNorm
float32, SwiGLU equal shapes), ``"off"`` never; anything else is refused at import. Never under ``torch.func``
transforms' wrapped tensors (under ``torch.func.grad`` a Function's forward sees plain tensors and may fuse, its
backward does not; ``vmap`` never), ``torch.compile`` (the outer graph fuses them itself) or a backward run with
grad mode on (differentiated again, or ``torch.func.vjp``: so the blocks :mod:`funcpar.nn.remat` recomputes take the
eager backward, and at fused sizes their gradients equal the plain step's to round-off, not bit for bit).
If compiling fails (no C++ compiler, the recompile limit), funcpar warns once, runs the same formulas eagerly and
stops trying; any other error is raised as it is.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F


__all__ = ["rms_norm", "rotary", "swiglu", "exp_and_sum", "fusable", "FUSE", "MIN_NUMEL"]

FUSE = os.environ.get("FUNCPAR_FUSE", "auto")  # "auto" | "on" | "off"
MIN_NUMEL = 1 << 17  # "auto": the smallest tensor fused (0.5 MB of float32)
_MODES = ("auto", "on", "off")
_failed: list[str] = []  # the compile error that turned fusion off, once one did


def _check_mode() -> None:
    if FUSE not in _MODES:
        raise ValueError(f"funcpar.nn.pointwise.FUSE (FUNCPAR_FUSE in the environment) is {FUSE!r}; one of {_MODES}")


_check_mode()  # at import: a misspelt FUNCPAR_FUSE fails before any training starts


def functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` transform's tensor; always under ``torch.compile`` (dynamo cannot trace the
    query; the fused layers take their composable paths there)."""
    return torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(t)


def fusable(*ts: torch.Tensor) -> bool:
    """Whether the fused kernels take ``ts`` (the first one's size decides), under :data:`FUSE`."""
    _check_mode()  # (FUSE may have been set since import)
    if FUSE == "off" or _failed or torch.is_grad_enabled() or any(functorch_wrapped(t) for t in ts):
        return False
    return FUSE == "on" or (ts[0].numel() >= MIN_NUMEL and all(
        t.device.type == "cpu" and t.dtype == torch.float32 for t in ts))


def compile_error(e: BaseException) -> BaseException | None:
    """The compiler's own failure in ``e`` (no C++ compiler, a lowering or codegen error, the recompile limit), or
    None: an error of the computation itself, which the eager formula would raise too."""
    from torch._dynamo import exc as dx
    from torch._inductor import exc as ix

    inner = getattr(e, "inner_exception", None) if isinstance(e, dx.BackendCompilerFailed) else None
    if isinstance(e, (dx.BackendCompilerFailed, dx.Unsupported, dx.FailOnRecompileLimitHit,
                      dx.InternalTorchDynamoError, ix.InvalidCxxCompiler, ix.CppCompileError, ix.OperatorIssue)):
        return inner or e
    return None


def compile_error_text(cause: BaseException) -> str:
    """A compiler failure in one line, for a warning."""
    return f"{type(cause).__name__}: {cause}".strip().split("\n")[0][:300]


def _kernel(fn):
    """``fn`` compiled at its first call (dynamic sizes); on a compile error, a warning, fusion off for the process,
    and ``fn`` run eagerly (the same formula). Tensors go in detached (``requires_grad`` would be one more guard)."""
    compiled = []

    def run(*args):
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        if _failed:
            return fn(*args)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True, fullgraph=True))
        try:
            return compiled[0](*args)
        except Exception as e:
            cause = compile_error(e)
            if cause is None:
                raise
            _failed.append(compile_error_text(cause))
            warnings.warn(f"funcpar.nn.pointwise: torch.compile of the fused {fn.__name__} failed ({_failed[0]}); "
                          "running torch's eager kernels from now on (FUNCPAR_FUSE=off skips the attempt)",
                          stacklevel=2)
            return fn(*args)

    run.__name__ = fn.__name__
    return run


@_kernel
def _rms_forward(x, w, eps: float):
    r = _rstd(x, eps)
    return x * r * w, r


@_kernel
def _rms_backward_kernel(x, w, r, g, need_w: bool):
    gx = g * x
    dot = (gx * w).sum(-1, keepdim=True) * r / x.shape[-1]
    gi = (g * w - x * (r * dot)) * r
    return gi, gx * r if need_w else None


def _rms_backward(x, w, r, g, need_w: bool):
    """The input's gradient and the weight's. The kernel writes ``g x r`` out and torch's row sum reduces it:
    inductor's own reduction down the rows was slower and less accurate (docs/MEASUREMENTS.md)."""
    gi, gxr = _rms_backward_kernel(x, w, r, g, need_w)
    return gi, gxr.reshape(-1, x.shape[-1]).sum(0) if need_w else None


@_kernel
def _swiglu_forward(gate, up):
    return F.silu(gate) * up


@_kernel
def _swiglu_backward(gate, up, go):
    return _silu_grad(go * up, gate), go * F.silu(gate)


def _silu_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g`` times silu's derivative at ``x``, ``s (1 + x (1 - s))`` with ``s = sigmoid(x)``, composably."""
    s = x.sigmoid()
    return g * s * (1.0 + x * (1.0 - s))


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's ``1 / sqrt(mean(x²) + eps)`` over the last dim, kept: (..., 1)."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@_kernel
def _exp_and_sum(logits, m):
    e = (logits - m[..., None]).exp()
    return e, e.sum(-1)


def exp_and_sum(logits: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``e = exp(logits - m[..., None])`` and ``e.sum(-1)``: the softmax's numerators and denominators."""
    if fusable(logits, m):
        return _exp_and_sum(logits, m)
    e = (logits - m[..., None]).exp_()
    return e, e.sum(-1)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Llama family computes it: normalised in float32, cast back, then scaled by ``w``.

    float32 ``x`` and ``w``: one operation, the composition's values bit for bit, its gradients to round-off (the
    backward written out, three new ``x``-sized tensors, one kept for it instead of two); where :func:`fusable`, a
    fused kernel each way (values to round-off too). Other dtypes: composed."""
    if x.dtype == w.dtype == torch.float32 and not torch.compiler.is_compiling() and not (
            functorch_wrapped(w) and not functorch_wrapped(x)):
        return _RMSNorm.apply(x, w, eps)[0]
    xf = x.float()
    return w * (xf * _rstd(xf, eps)).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, w, eps):
        if fusable(x, w):
            return _rms_forward(x, w, eps)
        r = _rstd(x, eps)  # (..., 1)
        return (x * r).mul_(w), r  # the composition's w * (x * r), rounded alike

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(inputs[0], inputs[1], output[1])
        ctx.eps = inputs[2]

    @staticmethod
    def backward(ctx, g, _):
        x, w, r = ctx.saved_tensors
        again = torch.is_grad_enabled() or functorch_wrapped(g)  # differentiated again: out of place, r of x
        r = _rstd(x, ctx.eps) if again else r
        need_x, need_w, rows = *ctx.needs_input_grad[:2], tuple(range(g.ndim - 1))
        fused = not again and fusable(x, w, r, g)
        if not need_x:  # the weight's alone (a split backward's weight pass): the same products and sum as below
            if not need_w:
                return None, None, None
            gxr = (g * x).mul_(r)
            return None, gxr.reshape(-1, x.shape[-1]).sum(0) if fused else gxr.sum(rows), None
        if fused:
            return (*_rms_backward(x, w, r, g, need_w), None)
        # d/dx (x_j r) = r (e_j - x x_j r²/d): gx = g x; the input's gradient r (g w - x r dot), dot = r (gx @ w)/d;
        # the weight's: the rows' sum of gx r (faster than r (g w - n mean(g w n)): docs/MEASUREMENTS.md)
        gx, d = g * x, x.shape[-1]
        dot = torch.mv(gx.reshape(-1, d), w).view(r.shape)
        if again:
            dot = dot * r / d
            return torch.addcmul(x * (r * dot).neg(), g, w) * r, (gx * r).sum(rows) if need_w else None, None
        dot.mul_(r).div_(d)
        gw = gx.mul_(r).sum(rows) if need_w else None
        return torch.mul(x, (r * dot).neg_()).addcmul_(g, w).mul_(r), gw, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as transformers applies it, ``x * cos + rotate_half(x) * sin`` (``rotate_half``: the
    last dim's halves swapped, the new first half negated), as one operation: ``x`` (..., T, hd), ``cos``/``sin``
    (T, hd) or broadcastable to ``x``, constants. The composition's values and gradients bit for bit, with two new
    ``x``-sized tensors each way where the composition makes five. ``cos``/``sin`` that need a gradient take the
    composition."""
    if cos.requires_grad or sin.requires_grad or functorch_wrapped(cos) or functorch_wrapped(sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return _Rotary.apply(x, cos, sin)


class _Rotary(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, cos, sin):
        h = x.shape[-1] // 2
        out = x * cos  # (..., T, hd); then out1 -= x2 * sin1, out2 += x1 * sin2 (rounded as the composition)
        out[..., :h].sub_(x[..., h:] * sin[..., :h])
        out[..., h:].add_(x[..., :h] * sin[..., h:])
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        h = g.shape[-1] // 2
        gx = g * cos  # the transpose of the rotation: gx1 += g2 * sin2, gx2 -= g1 * sin1
        gx[..., :h].add_(g[..., h:] * sin[..., h:])
        gx[..., h:].sub_(g[..., :h] * sin[..., :h])
        return gx, None, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the composition's values and gradients bit for bit (second derivatives to round-off),
    keeping only its inputs for the backward (the composition keeps ``silu(gate)`` too); writes 1 new tensor, then 2.
    Where :func:`fusable`, a fused kernel each way: the same formulas to round-off."""
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(gate, up):
        if gate.shape == up.shape and fusable(gate, up):
            return _swiglu_forward(gate, up)
        act = F.silu(gate)
        if act.shape != up.shape or act.dtype != up.dtype or functorch_wrapped(up) and not functorch_wrapped(act):
            return act * up  # (broadcast, promoted, or only ``up`` batched under vmap: not into ``act``)
        return act.mul_(up)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, go):
        gate, up = ctx.saved_tensors
        if all(ctx.needs_input_grad) and gate.shape == up.shape == go.shape and fusable(gate, up, go):
            return _swiglu_backward(gate, up, go)
        g_up = F.silu(gate).mul_(go) if ctx.needs_input_grad[1] else None  # go * silu(gate)
        if not ctx.needs_input_grad[0]:
            return None, g_up
        g_act = go * up  # the gradient of silu(gate)
        if torch.is_grad_enabled() or functorch_wrapped(g_act):  # differentiated again: autograd's own formula
            return _silu_grad(g_act, gate), g_up
        return torch.ops.aten.silu_backward.grad_input(g_act, gate, grad_input=g_act), g_up

