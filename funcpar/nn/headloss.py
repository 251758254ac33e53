"""The LM head and its cross-entropy fused over row chunks: the loss of ``x @ w.T`` without ever holding the logits.

``head_loss(x, w, targets, weights, mesh)`` is ``sum_t weights[t] * CE(x[t] @ w.T, targets[t])`` for a vocab-sharded
head ``w`` (V/tp, d) and rows ``x`` (N, d) replicated over tp. It walks the rows in chunks of at most
:data:`CHUNK_FLOATS` logits: each chunk's logits are formed, their max, sum of exponentials and target logit reduced
over tp, the chunk's loss added, and, when gradients are wanted, the chunk's logit gradient ``(softmax - onehot) *
weight`` turned at once into its rows of ``x``'s gradient and its share of ``w``'s. The backward only scales those by
the incoming scalar. The unfused head keeps a float32 (N, V/tp) tensor for its backward (8192 tokens over a 128k
vocabulary: 4.2 GB) and reads it again there; here one chunk lives at a time, and the gradients cost the same two
matmuls. The trade: the gradients are formed in the forward (an evaluation without gradients skips them), and the
weights of the tokens (the loss's reduction) must be known in advance, as they are for a mean or a sum over
counted targets.

Exact to round-off against the unfused head and :func:`funcpar.nn.layers.vocab_cross_entropy` (the weight gradient's
terms are summed chunk by chunk instead of in one matmul).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from funcpar.parallel import collectives as C
from funcpar.nn import pointwise

if TYPE_CHECKING:
    from funcpar.parallel.mesh import Mesh

__all__ = ["head_loss", "CHUNK_FLOATS"]

CHUNK_FLOATS = 1 << 26  # logits per chunk (256 MiB in float32): small next to a model, large enough for full matmuls


def head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, mesh: "Mesh",
              axis: str = "tp", vocab_size: int | None = None, chunk_floats: int | None = None,
              softcap: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``sum(weights * CE(x @ w.T, targets))``, a scalar in float32. ``x`` (N, d) replicated over ``axis`` (its
    gradient is this rank's part: route it through the region op that sums it, as a column-parallel input is);
    ``w`` (V/tp, d) this rank's rows of the head; ``targets`` (N,) global ids (any id outside the vocabulary, -100
    included, must have weight 0); ``weights`` (N,) float32. Columns at or beyond ``vocab_size`` (a padded
    vocabulary) are left out of the softmax. ``softcap``: the logits are ``softcap * tanh(x @ w.T / softcap)``
    (Gemma's final soft-capping). ``bias`` (V/tp,): this rank's block of the head's bias, added to the logits before
    the cap (Phi's, GPT-J's)."""
    rows = max(1, (chunk_floats or CHUNK_FLOATS) // max(1, w.shape[0]))
    grads = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    grads = grads or (torch.is_grad_enabled() and bias is not None and bias.requires_grad)
    return _HeadLoss.apply(x, w, targets, weights.float(), mesh, axis, vocab_size, rows, grads, softcap, bias)[0]


class _HeadLoss(torch.autograd.Function):
    """Outputs ``(loss, gradient of x, gradient of w)``, the last two without gradient (``None`` when not
    wanted); the backward scales them by the loss's gradient."""

    @staticmethod
    def forward(x, w, targets, weights, mesh, axis, vocab_size, rows, grads, softcap=None, bias=None):
        n, off = w.shape[0], mesh.coord(axis) * w.shape[0]
        pad = None if vocab_size is None or off + n <= vocab_size else torch.arange(off, off + n,
                                                                                  device=w.device) >= vocab_size
        gx = torch.empty_like(x) if grads else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if grads else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=w.device) if grads and bias is not None else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for a in range(0, x.shape[0], rows):
            logits = (x[a:a + rows] @ w.t()).float()  # (r, V/tp)
            if bias is not None:
                logits = logits + bias.float()
            if softcap is not None:  # capped = cap * tanh(logits / cap); its derivative 1 - tanh² kept
                logits = torch.tanh(logits / softcap)
                slope = 1 - logits * logits if grads else None
                logits = logits * softcap
            if pad is not None:
                logits.masked_fill_(pad, float("-inf"))
            m = C.all_reduce(logits.amax(-1), mesh, axis, "max")  # (r,): a statistic, exact for log-sum-exp
            e, s = pointwise.exp_and_sum(logits, m)  # (r, V/tp): exp(logits - max), and its row sums
            del logits
            s = C.all_reduce(s, mesh, axis)  # (r,)
            local = targets[a:a + rows] - off
            inside = (local >= 0) & (local < n)
            at = local.clamp(0, n - 1)[:, None]
            picked = torch.where(inside, e.gather(-1, at).squeeze(-1).log(), torch.zeros((), device=e.device))
            tok = s.log() - C.all_reduce(picked, mesh, axis)  # (r,): -log softmax[target]
            wt = weights[a:a + rows]
            total = total + (tok * wt).sum()
            if grads:  # (softmax - onehot) * weight, then its two matmuls
                g = e.mul_((wt / s)[:, None])
                g.scatter_add_(-1, at, (-inside.float() * wt)[:, None])
                if softcap is not None:
                    g = g * slope
                if gb is not None:
                    gb.add_(g.sum(0))
                gx[a:a + rows] = g.to(x.dtype) @ w
                gw.addmm_(g.t(), x[a:a + rows].float() if x.dtype != torch.float32 else x[a:a + rows])
        return total, gx, None if gw is None else gw.to(w.dtype), None if gb is None else gb.to(bias.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*(t for t in output[1:] if t is not None))
        ctx.save_for_backward(*(t for t in output[1:] if t is not None))
        ctx.grads = inputs[8]  # (x, w, targets, weights, mesh, axis, vocab_size, rows, grads, softcap)

    @staticmethod
    def backward(ctx, g, _gx, _gw, _gb):
        if not ctx.grads:
            raise RuntimeError("funcpar.nn.headloss: the head's loss was computed without gradients (grad mode off, or "
                               "neither x nor w requiring them) and then differentiated")
        gx, gw, *gb = ctx.saved_tensors  # (first order only: formed in the forward, they are constants here)
        gbias = g.to(gb[0].dtype) * gb[0] if gb else None
        return g.to(gx.dtype) * gx, g.to(gw.dtype) * gw, None, None, None, None, None, None, None, None, gbias
