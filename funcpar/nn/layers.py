"""Per-shard building blocks shared by the models: vocab-parallel embedding and cross-entropy (on this rank's block
of vocabulary rows, ``V/tp`` of them, never full-vocabulary tensors; at ``Mesh()`` the plain ``F.embedding`` and
cross-entropy), and what the Llama-like models share (RMSNorm, rotary, the gated SiLU MLP, column-parallel linears,
an embedding with a padding row)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from funcpar.parallel import collectives as C
from funcpar.nn import pointwise
from funcpar.nn.pointwise import functorch_wrapped, rms_norm, rotary, swiglu

if TYPE_CHECKING:  # pragma: no cover
    from funcpar.parallel.mesh import Mesh

__all__ = ["rms_norm", "rotary", "swiglu", "swiglu_mlp", "column_parallel", "padding_row_embedding", "check_sizes",
           "token_range_errors", "vocab_embedding", "vocab_cross_entropy", "causal_lm_loss", "count_targets",
           "IGNORE_INDEX", "padded_vocab", "unpad_logits", "VocabPadding", "shifted_targets", "check_pad_token_id",
           "sequence_parallel", "row_parallel_sum_", "sequence_shared", "sequence_block", "sequence_length",
           "context_parallel", "context_pieces", "context_chunk", "context_whole", "position_rows", "data_size",
           "STOOD_IN"]

IGNORE_INDEX = -100
STOOD_IN: dict[str, int] = {}  # what data_size put in for a value on meta, by what it stands for: the plan reads it


def data_size(t: torch.Tensor, planned: int, what: str) -> int:
    """``int(t)``: a size the data decides (a MoE expert's capacity: the tokens its busiest expert takes). Meta
    tensors carry shapes and no values (``funcpar plan``'s trace), so there ``planned`` stands for it and is counted
    in :data:`STOOD_IN` under ``what``: the plan says what it assumed instead of sizing a buffer by a stand-in 1."""
    if t.is_meta:
        STOOD_IN[what] = STOOD_IN.get(what, 0) + 1
        return int(planned)
    return int(t)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Rows of a vocab-parallel table for ``vocab_size`` tokens on ``tp`` ranks.

    A vocabulary divisible by lcm(8, tp) is kept as it is; any other is padded up to a multiple of lcm(128, tp)
    (GPT-2's 50257 becomes 50304). For every power-of-two tp up to 8 the answer does not depend on tp, and for
    larger ones it stays a multiple of 128, so checkpoints keep their shapes when the mesh changes. Padding rows
    are zeros that no token uses; the losses exclude them and exports drop them."""
    if vocab_size % math.lcm(8, tp) == 0:
        return vocab_size
    return -(-vocab_size // (m := math.lcm(128, tp))) * m


def check_sizes(cfg: Any, *names: str) -> None:
    """Raise a ValueError naming the field unless each of ``cfg``'s fields ``names`` is a positive int (a model
    config's ``__post_init__`` calls it, so that no path builds a config with sizes no model has)."""
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{type(cfg).__module__}.{type(cfg).__name__}: {name}={v!r}, expected a positive int")


def check_pad_token_id(cfg: Any) -> None:
    """``cfg.pad_token_id`` as ``nn.Embedding(padding_idx=...)`` takes it, stored as its row (negatives count back)."""
    p, v = cfg.pad_token_id, cfg.vocab_size
    if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not -v <= p < v):
        raise ValueError(f"{type(cfg).__module__}.{type(cfg).__name__}: pad_token_id={p!r}, not in [-{v}, {v}) or None")
    object.__setattr__(cfg, "pad_token_id", None if p is None else p % v)


class VocabPadding:
    """For a model config (a dataclass) with ``vocab_size`` and ``vocab_rows`` fields: the rows of its vocab
    tables, and the config padded for a mesh (``vocab_rows`` set only where tp calls for padding)."""

    @property
    def rows(self) -> int:
        return self.vocab_rows or self.vocab_size

    def with_mesh(self, mesh):
        """This config with its vocabulary padded for ``mesh``'s tp where tp does not divide it."""
        import dataclasses

        rows = padded_vocab(self.vocab_size, mesh.axis_size("tp"))
        return dataclasses.replace(self, vocab_rows=None if rows == self.vocab_size else rows)

    def check_mesh(self, mesh) -> None:
        """Raise unless ``mesh``'s tp divides the attention heads (the tp plan splits attention by whole heads) and
        the vocab tables' rows (it always does after ``with_mesh``)."""
        tp = 1 if mesh is None else mesh.axis_size("tp")
        key = next((k for k in ("num_attention_heads", "n_head") if getattr(self, k, None)), None)
        heads = getattr(self, key) if key else 0
        if heads and heads % tp:
            fits = [str(n) for n in range(1, heads + 1) if heads % n == 0]
            raise ValueError(f"{key}={heads} is not divisible by tp={tp}: tensor parallelism splits attention by "
                             f"whole heads (use tp={', '.join(fits[:-1])} or {fits[-1]})")
        if mesh is not None and self.rows % mesh.axis_size("tp"):
            raise ValueError(
                f"vocab_size {self.vocab_size} ({self.rows} rows) is not divisible by tp={mesh.axis_size('tp')}: "
                f"use cfg.with_mesh(mesh), which pads the vocabulary (fp.hf.load does it for you)"
            )


def _mask_padding(logits: torch.Tensor, mesh: "Mesh", axis: str, vocab_size: int | None) -> torch.Tensor:
    n = logits.shape[-1]
    start = mesh.coord(axis) * n
    if vocab_size is None or start + n <= vocab_size:
        return logits
    cols = torch.arange(start, start + n, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, float("-inf"))


def unpad_logits(logits: torch.Tensor, mesh: "Mesh", axis: str, vocab_size: int) -> torch.Tensor:
    """Local logits with padded vocabulary columns dropped (at tp=1: exactly ``vocab_size`` columns)."""
    n = logits.shape[-1]
    keep = min(n, max(0, vocab_size - mesh.coord(axis) * n))
    return logits if keep == n else logits[..., :keep]


def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, mesh: "Mesh", axis: str) -> torch.Tensor:
    """Rows of a vocab-sharded embedding table: each rank looks up the ids it owns, zeros elsewhere, then sums."""
    if mesh.axis_size(axis) == 1:
        return F.embedding(ids, weight)  # (B, T) -> (B, T, d)
    n = weight.shape[0]
    local = ids - mesh.coord(axis) * n
    inside = (local >= 0) & (local < n)
    rows = F.embedding(local.clamp(0, n - 1), weight)  # (B, T, d), wrong rows where not inside
    rows = torch.where(inside[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return row_parallel_sum_(rows, mesh, axis)  # (rows: a fresh temporary, summed in place)


def vocab_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, mesh: "Mesh", axis: str, vocab_size: int | None = None
) -> torch.Tensor:
    """Per-position ``-log softmax(logits)[label]`` from vocab-sharded logits (``(..., V/tp)``), in float32.

    Positions whose label is ``-100`` (or any id outside the vocabulary) give an unspecified finite value: mask
    them out. The softmax max is a statistic (no gradient), which is exact since log-sum-exp does not depend on it.
    Columns at or beyond ``vocab_size`` (padding of a vocabulary tp does not divide) are excluded.
    """
    return _VocabCrossEntropy.apply(_mask_padding(logits.float(), mesh, axis, vocab_size), labels, mesh, axis)[0]


class _VocabCrossEntropy(torch.autograd.Function):
    """Fused: the forward keeps ``exp(logits - max)`` and two per-position statistics, not the logits; the backward
    scales it into ``(softmax - onehot) * g`` in place (one pass; a new tensor under a transform or a second-order
    graph). Composed from autograd's primitives the loss holds three more logits-sized tensors. Outputs ``(loss, max,
    sum of exp, exp)``, the last three without gradient. First order, one backward per graph (a second is refused:
    its saved tensor is used up); vmap over it works."""

    generate_vmap_rule = True  # vmap over it (e.g. per-example gradients) traces its forward and backward

    @staticmethod
    def forward(logits, labels, mesh, axis):
        n = logits.shape[-1]
        m = C.all_reduce(logits.amax(-1), mesh, axis, "max")  # (...,): a statistic, exact for log-sum-exp
        e, s = pointwise.exp_and_sum(logits, m)  # this rank's columns of exp(logits - max), their sum
        sumexp = C.all_reduce(s, mesh, axis)
        local = labels - mesh.coord(axis) * n
        picked = logits.gather(-1, local.clamp(0, n - 1)[..., None]).squeeze(-1) - m
        inside = (local >= 0) & (local < n)
        picked = torch.where(inside, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
        return sumexp.log() - C.all_reduce(picked, mesh, axis), m, sumexp, e

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, labels, mesh, axis = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # (no zeros as big as the logits for ``exp``'s gradient)
        ctx.save_for_backward(output[3], labels, output[2])
        ctx.offset = mesh.coord(axis) * logits.shape[-1]

    @staticmethod
    def backward(ctx, g, _gm, _gs, _ge):
        e, labels, sumexp = ctx.saved_tensors
        f, local, n = (g / sumexp)[..., None], labels - ctx.offset, e.shape[-1]
        grad = e * f if torch.is_grad_enabled() or functorch_wrapped(g) or functorch_wrapped(e) else e.mul_(f)
        inside = ((local >= 0) & (local < n)).to(grad.dtype)
        grad.scatter_add_(-1, local.clamp(0, n - 1)[..., None], (-inside * g)[..., None])
        return grad, None, None, None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, mesh: "Mesh", axis: str,
                   loss_mask: torch.Tensor | None = None, reduction: str = "mean",
                   vocab_size: int | None = None) -> torch.Tensor:
    """transformers' causal-LM loss: position t predicts label t+1; ``-100`` labels (and ``loss_mask == 0``) ignored.
    ``reduction="mean"`` divides by the number of counted tokens (as transformers does); ``"sum"`` does not."""
    shifted = context_chunk(shifted_targets(labels, loss_mask), mesh)  # (B, T), or this cp rank's chunk
    valid = shifted != IGNORE_INDEX
    tok = vocab_cross_entropy(logits, shifted, mesh, axis, vocab_size)  # (B, T)
    total = torch.where(valid, tok, torch.zeros((), dtype=tok.dtype, device=tok.device)).sum()
    if reduction == "sum":
        return total
    return total / valid.sum().clamp(min=1)


def shifted_targets(labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The label each position predicts: ``labels`` shifted left by one, ``-100`` where masked or past the end."""
    if loss_mask is not None:
        labels = labels.masked_fill(~loss_mask.bool(), IGNORE_INDEX)
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def count_targets(batch: dict, mesh: "Mesh | None" = None) -> int:
    """How many tokens :func:`causal_lm_loss` averages over in ``batch`` (on ``mesh``: in this cp rank's chunk)."""
    targets = shifted_targets(batch.get("labels", batch["input_ids"]), batch.get("loss_mask"))
    if mesh is not None:
        targets = context_chunk(targets, mesh)
    return int((targets != IGNORE_INDEX).sum().item())


def token_range_errors(batch: dict, cfg: Any) -> list[str]:
    """What is out of range in a language-model batch: ``input_ids`` outside ``[0, cfg.vocab_size)`` (which a
    vocab-parallel embedding would silently embed as zeros), ``labels`` outside it other than -100 (which the loss
    would train on). One message per entry, naming the value, where it is and the vocabulary size."""
    out = []
    for name in ("input_ids", "labels"):
        x = batch.get(name)
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            continue
        bad = ((x < 0) | (x >= cfg.vocab_size)) & ((x != IGNORE_INDEX) if name == "labels" else True)
        if bool(bad.any()):
            at = [int(i) for i in bad.nonzero()[0]]
            out.append(f"batch['{name}'] holds {int(x[tuple(at)])} at {at} ({int(bad.sum())} such entries), outside "
                       f"the vocabulary [0, {cfg.vocab_size})" + (" (and not -100)" if name == "labels" else ""))
    return out + _position_errors(batch)


def _position_errors(batch: dict) -> list[str]:
    """What is wrong with a batch's ``position_ids`` (packed documents): not the shape of ``input_ids``, or a
    position outside ``[0, T)`` (the position tables hold T rows)."""
    pos, ids = batch.get("position_ids"), batch.get("input_ids")
    if pos is None or not isinstance(ids, torch.Tensor):
        return []
    if not isinstance(pos, torch.Tensor) or pos.shape != ids.shape or pos.dtype.is_floating_point:
        what = f"{pos.dtype} {tuple(pos.shape)}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        return [f"batch['position_ids'] is {what}: expected integers shaped as input_ids {tuple(ids.shape)}"]
    T = ids.shape[-1]
    bad = (pos < 0) | (pos >= T)
    if pos.numel() and bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        return [f"batch['position_ids'] holds {int(pos[tuple(at)])} at {at}, outside [0, {T}) (each token's position "
                f"in its packed sample)"]
    return []


def sequence_parallel(mesh: "Mesh", axis: str = "tp") -> bool:
    """Whether a model on ``mesh`` keeps its hidden state split along the sequence over ``axis`` between tp regions
    (:meth:`funcpar.Mesh.with_sequence_parallel`)."""
    return mesh.sequence_parallel and axis == "tp" and mesh.axis_size(axis) > 1


def row_parallel_sum_(y: torch.Tensor, mesh: "Mesh", axis: str = "tp") -> torch.Tensor:
    """A row-parallel layer's partial outputs ``y`` (B, T, d) summed over ``axis``: in place
    (:func:`funcpar.parallel.collectives.reduce_from_region_`), or under sequence parallelism reduce-scattered along the
    sequence, each rank keeping its block (B, T/tp, d)."""
    if not sequence_parallel(mesh, axis):
        return C.reduce_from_region_(y, mesh, axis)
    n = mesh.axis_size(axis)
    if y.ndim != 3 or y.shape[1] % n:
        raise ValueError(f"sequence parallelism splits the sequence over {axis}={n}: a sequence of {y.shape[1]} "
                         f"positions (shape {tuple(y.shape)}) does not split evenly; make the sequence length a "
                         f"multiple of {n}")
    return C.reduce_scatter(y, mesh, axis, 1)


def sequence_shared(w: torch.Tensor, mesh: "Mesh", axis: str = "tp") -> torch.Tensor:
    """A leaf replicated over ``axis`` that a model uses on its block of the sequence (a norm's weight, a bias
    added there): under sequence parallelism its gradient is summed over ``axis`` (``copy_to_region``), since each
    rank's block contributes part of it; otherwise ``w`` itself."""
    return C.copy_to_region(w, mesh, axis) if sequence_parallel(mesh, axis) else w


def sequence_block(t: torch.Tensor, mesh: "Mesh", dim: int = 0, axis: str = "tp") -> torch.Tensor:
    """This rank's block along ``dim`` of a tensor over the whole sequence (position embeddings) under sequence
    parallelism (no communication; the gradient gathered backward); otherwise ``t`` itself."""
    return C.scatter_to_region(t, mesh, axis, dim) if sequence_parallel(mesh, axis) else t


def sequence_length(x: torch.Tensor, mesh: "Mesh", axis: str = "tp") -> int:
    """The whole sequence's length, from the hidden state ``x`` a block receives: (B, T, d), or this rank's block of
    it under sequence parallelism (T/tp) and context parallelism (T/cp)."""
    n = mesh.axis_size(axis) if sequence_parallel(mesh, axis) else 1
    return x.shape[1] * n * (mesh.axis_size("cp") if context_parallel(mesh) else 1)


def context_parallel(mesh: "Mesh") -> bool:
    """Whether ``mesh`` has a ``cp`` axis of more than one rank: each holds its pieces of every sequence
    (:func:`context_pieces`), and attention sees the keys of every position before each of its queries."""
    return "cp" in mesh.axis_names and mesh.axis_size("cp") > 1


def context_pieces(mesh: "Mesh", length: int) -> list[tuple[int, int]]:
    """The (start, size) of each piece of a sequence of ``length`` positions this cp rank holds, in the order it
    holds them: under ``mesh.context_layout`` "zigzag", pieces ``c`` and ``2cp-1-c`` of ``2cp`` (rank ``c``);
    under "contiguous", chunk ``c`` of ``cp``; the whole sequence without context parallelism."""
    if not context_parallel(mesh):
        return [(0, length)]
    n, c = mesh.axis_size("cp"), mesh.coord("cp")
    zigzag = mesh.context_layout == "zigzag"
    parts = 2 * n if zigzag else n
    if length % parts:
        how = f"into 2*cp={parts} pieces (the zig-zag layout)" if zigzag else f"into cp={n} chunks"
        raise ValueError(f"context parallelism splits each sequence over cp={n}: a sequence of {length} positions "
                         f"does not split evenly {how}; make the sequence length a multiple of {parts}")
    s = length // parts
    return [(c * s, s), ((2 * n - 1 - c) * s, s)] if zigzag else [(c * s, s)]


def context_chunk(t: torch.Tensor, mesh: "Mesh", dim: int = 1) -> torch.Tensor:
    """This ``cp`` rank's pieces of ``t`` along ``dim`` (:func:`context_pieces`; a view when one piece, ``t``
    itself without context parallelism)."""
    pieces = [t.narrow(dim, a, n) for a, n in context_pieces(mesh, t.shape[dim])]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def position_rows(table: torch.Tensor, mesh: "Mesh") -> torch.Tensor:
    """The rows of a per-position table (T, ...) (rotary angles, learned positions) for this rank's positions:
    (T/cp, ...), this cp rank's pieces; where the mesh carries packed documents, each token's own position's row,
    (B, 1, T/cp, ...), broadcasting over the heads of (B, H, T/cp, ...)."""
    docs = mesh.documents
    if docs is None:
        return context_chunk(table, mesh, 0)
    return context_chunk(table[docs.positions], mesh, 1)[:, None]


def context_whole(t: torch.Tensor, mesh: "Mesh", dim: int) -> torch.Tensor:
    """Every cp rank's pieces of ``t`` (this rank's: :func:`context_chunk`) gathered over cp and put back in
    sequence order along ``dim``. The backward hands each rank the gradient of its own pieces."""
    whole = C.all_gather(t, mesh, "cp", dim)  # rank order: each rank's pieces as it holds them
    if mesh.context_layout != "zigzag":
        return whole
    n = mesh.axis_size("cp")
    held = whole.chunk(2 * n, dim)  # rank r holds pieces r and 2n-1-r, at 2r and 2r+1
    return torch.cat([held[2 * p] if p < n else held[2 * (2 * n - 1 - p) + 1] for p in range(2 * n)], dim)


def column_parallel(
    x: torch.Tensor, weights: "list[torch.Tensor]", mesh: "Mesh", axis: str = "tp",
    biases: "list[torch.Tensor | None] | None" = None,
) -> tuple[torch.Tensor, ...]:
    """``F.linear(copy_to_region(x), w_i, b_i)`` for column-parallel weights sharing one replicated input ``x``
    (q/k/v, gate/up, the head): ``(..., d) -> (..., out_i/tp)`` each, as one operation.

    Its backward forms the input gradient first, starts its all-reduce over ``axis`` and computes the weights' (and
    biases') gradients while the all-reduce runs (Megatron's overlap of tensor-parallel communication with the
    weight-gradient matmuls), then waits. The gradients are the composition's to round-off (the input gradient's
    terms are summed in another order). Where the backward itself is
    differentiated (``torch.func`` transforms, ``create_graph``, ``vmap``) it runs the composition's collective
    instead, without the overlap. On an axis of size 1 it is the plain linears; weights that are not plain tensors
    (LoRA's :class:`funcpar.train.lora.LoraWeight`) take the composition."""
    biases = [None] * len(weights) if biases is None else list(biases)
    if sequence_parallel(mesh, axis):  # x: this rank's block of the sequence, gathered (backward: reduce-scattered)
        x = C.all_gather(x, mesh, axis, 1)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
    if mesh.axis_size(axis) == 1 or not all(isinstance(w, torch.Tensor) for w in weights):
        x = C.copy_to_region(x, mesh, axis)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
    return _ColumnParallel.apply(x, mesh, axis, len(weights), *weights, *biases)


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(x, mesh, axis, k, *wb):
        return tuple(F.linear(x, w, b) for w, b in zip(wb[:k], wb[k:], strict=True))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, mesh, axis, k, *wb = inputs
        ctx.mesh, ctx.axis, ctx.k = mesh, axis, k
        ctx.save_for_backward(x, *wb[:k])

    @staticmethod
    def backward(ctx, *gs):
        x, *ws = ctx.saved_tensors
        need, k, (mesh, axis) = ctx.needs_input_grad, ctx.k, (ctx.mesh, ctx.axis)
        g2 = [g.reshape(-1, g.shape[-1]) for g in gs]  # (N, out_i/tp)
        done = None
        if need[0]:
            gx = g2[0].mm(ws[0])
            for g, w in zip(g2[1:], ws[1:], strict=True):
                gx.addmm_(g, w)  # (N, d): this rank's part of x's gradient
            gx = gx.view(x.shape)
            if torch.is_grad_enabled() or functorch_wrapped(gx):  # differentiated again: the composable collective
                gx = C.reduce_from_region(gx, mesh, axis)
                done = lambda: gx  # noqa: E731
            else:
                done = C.all_reduce_start(gx, mesh, axis)  # runs while the weight gradients are computed
        x2 = x.reshape(-1, x.shape[-1])
        gw = [g.t().mm(x2) if need[4 + i] else None for i, g in enumerate(g2)]
        gb = [g.sum(0) if need[4 + k + i] else None for i, g in enumerate(g2)]
        return (done() if done else None, None, None, None, *gw, *gb)

    @staticmethod
    def vmap(info, in_dims, x, mesh, axis, k, *wb):
        if any(d is not None for d in in_dims[1:]):
            raise NotImplementedError("column_parallel under vmap: only the input may be batched, not the weights")
        x = C.copy_to_region(x.movedim(in_dims[0], 0), mesh, axis)
        return tuple(F.linear(x, w, b) for w, b in zip(wb[:k], wb[k:], strict=True)), (0,) * k


def swiglu_mlp(p: dict, x: torch.Tensor, mesh: "Mesh", axis: str = "tp") -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` on leaves ``w_gate``, ``w_up`` (column-parallel over ``axis``) and ``w_down``
    (row-parallel), with ``b_gate``/``b_up``/``b_down`` when present: (B, T, d) -> (B, T, d), summed over ``axis``."""
    g, u = column_parallel(x, [p["w_gate"], p["w_up"]], mesh, axis, [p.get("b_gate"), p.get("b_up")])  # (B, T, I/tp)
    y = row_parallel_sum_(F.linear(swiglu(g, u), p["w_down"]), mesh, axis)  # (B, T, I/tp) -> (B, T, d)
    return y + sequence_shared(p["b_down"], mesh, axis) if "b_down" in p else y


def padding_row_embedding(weight: torch.Tensor, ids: torch.Tensor, mesh: "Mesh", axis: str,
                          pad_token_id: int | None) -> torch.Tensor:
    """:func:`vocab_embedding` as ``nn.Embedding(padding_idx=pad_token_id)`` trains it: the same rows, but lookups of
    the pad token send no gradient into its row (``None``: a plain embedding)."""
    x = vocab_embedding(weight, ids, mesh, axis)  # (B, T) -> (B, T, d), or (B, T/tp, d): sequence parallel
    if pad_token_id is None:
        return x
    return torch.where((sequence_block(ids, mesh, 1, axis) == pad_token_id)[..., None], x.detach(), x)
