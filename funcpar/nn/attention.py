"""Causal self-attention: ``causal(q, k, v)`` is ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
enable_gqa=True)``, equal to it to round-off, faster on host tensors.

On CPU (float32, ``BLOCKED_T`` = 64 to 512 positions, plain tensors) it runs *block-causal*: the query rows are taken
in blocks of ``tb`` (32, or 64 beyond 256 positions); block ``i`` meets only the keys before its end, so of the masked
upper triangle only the diagonal block's part is computed (the matmuls do (n+1)/2n of the full T x T work over n
blocks), and a key/value head's query heads are folded into the rows of one matmul (no repeated k/v). Its backward
keeps the probabilities (B·H·T²·(n+1)/2n floats, which ``BLOCKED_T`` bounds) instead of recomputing them. It is
faster than torch's CPU flash kernel at these sizes (figures: docs/MEASUREMENTS.md).

Elsewhere (CUDA, whose kernels are better; other dtypes; longer or shorter sequences; inside ``torch.func``
transforms or ``torch.compile``, where the inputs are wrapped) it is torch's kernel. Differentiated twice, the block
path's backward recomputes the attention as matmuls and softmax for autograd to differentiate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from funcpar.nn.pointwise import functorch_wrapped

__all__ = ["causal", "within_documents", "blocked_within", "BLOCKED_T"]

BLOCKED_T = (64, 512)  # the sequence lengths (inclusive) the block path takes on CPU


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
           offset: int = 0) -> torch.Tensor:
    """(B, Hq, T, D), (B, Hkv, T, D) twice -> (B, Hq, T, D): softmax(q kᵀ / sqrt(D) + causal mask) v, each kv head
    shared by Hq / Hkv query heads. The result's memory is laid out (B, T, Hq, D) on the block path (as torch's CPU
    kernel returns it), so ``b h t d -> b t (h d)`` is a view. ``window``: each query sees only the last ``window``
    keys up to itself (sliding-window attention, as Mistral's), through an explicit (T, T) mask. ``offset``: the
    queries are positions ``offset ..`` of the keys' sequence (a context-parallel chunk; ``k``, ``v`` then hold
    every position up to the chunk's end or beyond), through an explicit (Tq, Tk) mask."""
    if offset or k.shape[-2] != q.shape[-2]:
        if _chunk(q, k, v, window, offset, "cpu"):
            return _ChunkCausal.apply(q, k, v)
        if _chunk(q, k, v, window, offset, "cuda"):
            return _lower_right(q, k, v)
        i = offset + torch.arange(q.shape[-2], device=q.device)[:, None]  # (Tq, 1): the queries' positions
        j = torch.arange(k.shape[-2], device=q.device)[None, :]  # (1, Tk)
        mask = (j <= i) & ((i - j < window) if window is not None else True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    T = q.shape[-2]
    if window is not None and T > window:
        i = torch.arange(T, device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)  # (T, T): causal, last `window`
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if _blocked(q, k, v):
        return _BlockCausal.apply(q, k, v, 32 if q.shape[-2] <= 256 else 64)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


# The device a meta tensor stands for: funcpar.cli.planning traces a step on meta tensors and sets this to the planned
# device's type, so that attention takes the path the real run would (and the plan counts what that path keeps).
META_DEVICE = "cpu"


def _device_type(t: torch.Tensor) -> str:
    return META_DEVICE if t.is_meta else t.device.type


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, offset: int, device: str) -> bool:
    """Whether a context-parallel chunk on ``device`` runs without a mask: the keys exactly the positions up to the
    chunk's end, no window that cuts them, plain tensors of a floating dtype; on "cpu" through
    :class:`_ChunkCausal` (torch's CPU flash kernel returns the log-sum-exp it needs), on "cuda" through torch's
    lower-right causal bias (:func:`_lower_right`)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    return (_device_type(q) == device and q.dtype == k.dtype == v.dtype and q.dtype in _FLASH_DTYPES
            and q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape and 0 < offset == Tk - Tq
            and (window is None or window >= Tk) and q.shape[1] % k.shape[1] == 0
            and not any(functorch_wrapped(t) for t in (q, k, v)))


def _lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Queries that are the last of the keys' positions, on CUDA: torch's lower-right causal bias, which its flash
    (half precision) and memory-efficient (float32) kernels apply without forming a mask. Those kernels take as
    many key as query heads: a kv head's keys are repeated for its query heads (a copy of the keys, far smaller
    than the (Tq, Tk) mask it replaces)."""
    from torch.nn.attention.bias import causal_lower_right

    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))


_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ChunkCausal(torch.autograd.Function):
    """A context-parallel chunk's attention without a mask: its queries (positions ``Tk - Tq ..``) against the
    earlier positions' keys, all visible (one flash call, no mask), and against their own (a second, ``is_causal``),
    the two merged by their log-sum-exps. The backward runs the flash backward of each part with the merged output
    and log-sum-exp (each part's probabilities are then the whole softmax's). An explicit (Tq, Tk) mask would be
    kept, in float, by every layer for its backward: 2 GiB at 16k positions over cp=2 on a 4-layer model."""

    @staticmethod
    def forward(ctx, q, k, v):
        s = k.shape[-2] - q.shape[-2]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(q, k[:, :, :s], v[:, :, :s], 0.0, False)  # every earlier position: visible
        o2, l2 = flash(q, k[:, :, s:], v[:, :, s:], 0.0, True)  # the chunk's own: causal
        lse = torch.logaddexp(l1, l2)  # (B, H, Tq), float32
        w1, w2 = (l1 - lse).exp_().unsqueeze_(-1), (l2 - lse).exp_().unsqueeze_(-1)
        o = (o1 * w1).add_(o2 * w2) if q.dtype == torch.float32 else (o1.float() * w1 + o2.float() * w2).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, go):
        q, k, v, o, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # differentiated again: the composition's graph gives the second derivative
            return tuple(_again(ctx, q, k, v, go))
        s = k.shape[-2] - q.shape[-2]
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        gq1, gk1, gv1 = back(go, q, k[:, :, :s], v[:, :, :s], o, lse, 0.0, False)
        gq2, gk2, gv2 = back(go, q, k[:, :, s:], v[:, :, s:], o, lse, 0.0, True)
        return gq1.add_(gq2), torch.cat([gk1, gk2], 2), torch.cat([gv1, gv2], 2)


def _blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    T = q.shape[-2]
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and q.dim() == 4
            and k.shape == v.shape and k.dim() == 4 and q.shape[0] == k.shape[0] and k.shape[1] > 0
            and q.shape[1] % k.shape[1] == 0 and k.shape[2] == T and k.shape[3] == q.shape[3]
            and BLOCKED_T[0] <= T <= BLOCKED_T[1] and not any(functorch_wrapped(t) for t in (q, k, v)))


def _rows(x: torch.Tensor, kv: int, a: int, e: int) -> torch.Tensor:
    """Positions [a, e) of (B, H, T, D) ``x`` as (B·kv, H/kv·(e-a), D): a kv head's query heads stacked (a copy)."""
    B, H, T, D = x.shape
    return x.reshape(B, kv, H // kv, T, D)[:, :, :, a:e].reshape(B * kv, H // kv * (e - a), D)


def blocked_within(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> bool:
    """Whether :func:`within_documents` takes the block-causal CPU path (no mask, the work of causal attention)."""
    return window is None and _blocked(q, k, v)


def within_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, mask,
                     window: int | None = None) -> torch.Tensor:
    """Causal attention inside documents in one call: ``ids`` (B, T) numbers each position's document, and a query
    sees the keys of its own document up to itself (and within ``window``). On the block-causal CPU path its score
    blocks are masked by document (the work of plain causal attention, exact per document); elsewhere torch's
    kernel with ``mask()``, the (B, 1, T, T) block-diagonal mask (for rows of many short documents, where a kernel
    call per document would cost more than the mask)."""
    if blocked_within(q, k, v, window):
        return _BlockCausal.apply(q, k, v, 32 if q.shape[-2] <= 256 else 64, ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(), enable_gqa=True)


class _BlockCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tb, ids=None):
        B, H, T, D = q.shape
        kv, scale = k.shape[1], D ** -0.5
        kf, vf = k.reshape(B * kv, T, D), v.reshape(B * kv, T, D)
        out = q.new_empty(B, T, kv, H // kv, D)  # laid out (B, T, H, D)
        above = torch.ones(tb, tb, dtype=torch.bool, device=q.device).triu_(1)  # the diagonal block's future keys
        probs = []
        for a in range(0, T, tb):
            e = min(a + tb, T)
            s = torch.bmm(_rows(q, kv, a, e), kf[:, :e].transpose(1, 2)).mul_(scale)  # (B·kv, G·n, e)
            s.view(B * kv, H // kv, e - a, e)[..., a:].masked_fill_(above[: e - a, : e - a], float("-inf"))
            if ids is not None:  # packed documents: only the query's own document's keys
                other = (ids[:, a:e, None] != ids[:, None, :e])[:, None, None]  # (B, 1, 1, n, e)
                s.view(B, kv, H // kv, e - a, e).masked_fill_(other, float("-inf"))
            p = torch.softmax(s, -1)
            out[:, a:e] = torch.bmm(p, vf[:, :e]).view(B, kv, H // kv, e - a, D).permute(0, 3, 1, 2, 4)
            probs.append(p)
        o = out.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        ctx.tb, ctx.ids = tb, ids
        ctx.save_for_backward(q, k, v, o, *probs)
        return o

    @staticmethod
    def backward(ctx, go):
        q, k, v, o, *probs = ctx.saved_tensors
        if torch.is_grad_enabled():  # differentiated again: the composition's graph gives the second derivative
            if ctx.ids is not None:
                raise NotImplementedError("attention within documents differentiated twice")
            return (*_again(ctx, q, k, v, go), None, None)
        B, H, T, D = q.shape
        kv, scale, tb = k.shape[1], D ** -0.5, ctx.tb
        kf, vf = k.reshape(B * kv, T, D), v.reshape(B * kv, T, D)
        delta = (go * o).sum(-1, keepdim=True)  # (B, H, T, 1): the softmax's rowwise term
        gq = q.new_empty(B, T, kv, H // kv, D)
        gk, gv = torch.zeros_like(kf), torch.zeros_like(vf)
        for i, a in enumerate(range(0, T, tb)):
            e, p = min(a + tb, T), probs[i]
            goi = _rows(go, kv, a, e)  # (B·kv, G·n, D)
            gv[:, :e].baddbmm_(p.transpose(1, 2), goi)
            ds = torch.bmm(goi, vf[:, :e].transpose(1, 2)).sub_(_rows(delta, kv, a, e)).mul_(p).mul_(scale)
            gk[:, :e].baddbmm_(ds.transpose(1, 2), _rows(q, kv, a, e))
            gq[:, a:e] = torch.bmm(ds, kf[:, :e]).view(B, kv, H // kv, e - a, D).permute(0, 3, 1, 2, 4)
        return gq.view(B, T, H, D).transpose(1, 2), gk.view(k.shape), gv.view(v.shape), None, None


def _again(ctx, q, k, v, go):
    """The input gradients as differentiable functions of ``q, k, v, go``: through the composition of matmuls and
    softmax (torch's CPU flash kernel has no second derivative). The queries are the last of the keys' positions."""
    need = ctx.needs_input_grad[:3]
    with torch.enable_grad():
        g, Tq, Tk = q.shape[1] // k.shape[1], q.shape[-2], k.shape[-2]
        s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
        above = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).triu(1 + Tk - Tq)  # keys after each query
        s = s.masked_fill(above, float("-inf"))
        o = s.softmax(-1) @ v.repeat_interleave(g, 1)
        wanted = [t for t, n in zip((q, k, v), need, strict=True) if n]
        got = iter(torch.autograd.grad(o, wanted, go, create_graph=True))
    return [next(got) if n else None for n in need]
