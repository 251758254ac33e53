"""What the decoder models in ``funcpar.models`` share, written once: the config fields every one of them has,
transformers' initialisation, the pre-norm residual halves of a layer, the RMS-normed LM head and the loss of a batch.

A model composes these with its own attention (rotary, partial rotary, ALiBi, ...) and MLP (SwiGLU, experts, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import einops
import torch
import torch.nn.functional as F

from funcpar.nn import attention as A
from funcpar.parallel import collectives as C
from funcpar.nn import headloss as HL
from funcpar.nn import layers as L
from funcpar.nn.documents import documents_of as documents_of
from funcpar.spec import P

SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(L.VocabPadding):
    """The fields every decoder config here has, under transformers' names (a model's ``Config`` adds its own, all
    keyword-only). ``pad_token_id``: the embedding's padding_idx, whose row learns nothing from lookups (None: no
    such row); ``vocab_rows``: the rows of the vocab tables when padded for tp (see ``with_mesh``; None: vocab_size);
    ``hf``: the config.json it came from, which an export writes back with these fields set."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    pad_token_id: int | None = None
    vocab_rows: int | None = None
    hf: dict = dataclasses.field(default_factory=dict, hash=False, compare=False, repr=False)

    @staticmethod
    def sizes_of(d: dict[str, Any], **fields: Any) -> dict[str, Any]:
        """The shared fields read from a config.json dict ``d`` (the sizes it must have, its pad token, ``d``
        itself as ``hf``), and ``fields``, which take precedence: the keyword arguments of a ``Config``."""
        return {k: d[k] for k in SIZES} | {"pad_token_id": d.get("pad_token_id"), "hf": dict(d)} | fields

    def hf_sizes(self) -> dict[str, Any]:
        """The sizes as config.json keys, for ``to_hf`` (which writes ``pad_token_id`` as its model does)."""
        return {k: getattr(self, k) for k in SIZES}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RotaryConfig(DecoderConfig):
    """A :class:`DecoderConfig` with grouped-query attention and rotary positions: ``num_key_value_heads`` kv heads
    of ``head_dim`` each, shared by ``num_attention_heads / num_key_value_heads`` query heads; ``rope_theta`` the
    rotary base; the LM head is the embedding where ``tie_word_embeddings``."""

    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False


def check_model_type(d: dict[str, Any], name: str) -> None:
    """Raise unless the config.json dict ``d`` is of ``model_type`` ``name`` (an absent one counts as ``name``)."""
    if d.get("model_type", name) != name:
        raise ValueError(f"model_type '{d.get('model_type')}' is not {name}")


def normal_init(seed: int, dtype: torch.dtype, device: str | torch.device | None):
    """``(w, ones, zeros)`` for a model's ``init``, as transformers initialises: ``w(*shape)`` draws N(0, 0.02) from
    one CPU generator seeded ``seed`` (the same values on any device, in the order of the calls), ``ones(*shape)``
    and ``zeros(*shape)`` are constants; on ``device="meta"`` all three give shapes only."""
    g = None if torch.device(device or "cpu").type == "meta" else torch.Generator().manual_seed(seed)

    def w(*shape):
        t = torch.empty(*shape, dtype=dtype, device=device)
        return t if g is None else t.copy_(torch.randn(*shape, generator=g) * 0.02)

    def ones(*shape):
        return torch.ones(*shape, dtype=dtype, device=device)

    def zeros(*shape):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return w, ones, zeros


def vocab_table(t: torch.Tensor, cfg: Any, pad: int | None = None) -> torch.Tensor:
    """A new embedding or head table ``t`` (``cfg.rows`` rows) as transformers starts it: the tp padding rows beyond
    ``cfg.vocab_size`` and the ``padding_idx`` row ``pad`` zero."""
    if t.device.type != "meta":
        t[cfg.vocab_size :] = 0  # tp padding rows: no token uses them
        if pad is not None:
            t[pad] = 0  # transformers zeroes the padding_idx row
    return t


def attention_residual(lp, x: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor], eps: float, mesh):
    """A pre-norm layer's first half: ``x + attention(rms_norm(x, attn_norm))`` (on this rank's block of the
    sequence under sequence parallelism, the norm's weight shared: :func:`funcpar.nn.layers.sequence_shared`)."""
    return x + attention(L.rms_norm(x, L.sequence_shared(lp["attn_norm"], mesh), eps))


def mlp_residual(lp, x: torch.Tensor, eps: float, mesh) -> torch.Tensor:
    """A pre-norm layer's second half: ``x + swiglu_mlp(rms_norm(x, mlp_norm))``, the MLP tp-parallel."""
    return x + L.swiglu_mlp(lp, L.rms_norm(x, L.sequence_shared(lp["mlp_norm"], mesh), eps), mesh)


def rms_head_logits(params, x: torch.Tensor, cfg, mesh) -> torch.Tensor:
    """This rank's vocab block of the logits, (B, T, V/tp): the final RMS norm, then ``lm_head`` (``embed`` where
    ``cfg.tie_word_embeddings``); under sequence parallelism the head gathers the sequence."""
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    norm = L.sequence_shared(params["norm"], mesh)
    return L.column_parallel(L.rms_norm(x, norm, cfg.rms_norm_eps), [head], mesh)[0]


def rms_head_loss(params, x: torch.Tensor, batch: dict, cfg, mesh, reduction: str = "mean") -> torch.Tensor:
    """:func:`lm_loss` of :func:`rms_head_logits`, through :func:`head_loss` (the logits never held)."""
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    x = L.rms_norm(x, L.sequence_shared(params["norm"], mesh), cfg.rms_norm_eps)
    return head_loss(x, head, batch, cfg, mesh, reduction)


def head_loss(x: torch.Tensor, head, batch: dict, cfg, mesh, reduction: str = "mean",
              softcap: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ``labels=`` loss of the vocab-parallel head ``head`` (this rank's rows, (V/tp, d)) on the final
    states ``x`` (B, T, d), or this rank's block of the sequence under sequence parallelism: :func:`lm_loss` of
    ``x @ head.T``, computed by :func:`funcpar.nn.headloss.head_loss` in row chunks without holding the logits (each
    counted target weighted 1/count for ``"mean"``, 1 for ``"sum"``). A head that is not a plain tensor (LoRA's
    :class:`funcpar.train.lora.LoraWeight`) and ``FUSED_HEAD = False`` take the unfused composition. ``softcap``:
    the logits soft-capped, ``softcap * tanh(logits / softcap)`` (Gemma's); ``bias``: this rank's block of the
    head's bias (V/tp,), added before the cap."""
    if not FUSED_HEAD or not isinstance(head, torch.Tensor):
        logits = L.column_parallel(x, [head], mesh)[0]
        if bias is not None:
            logits = logits + bias
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return lm_loss(logits, batch, cfg, mesh, reduction)
    targets = L.context_chunk(L.shifted_targets(batch.get("labels", batch["input_ids"]), batch.get("loss_mask")),
                              mesh)  # (B, T): the label each position predicts (this cp rank's pieces)
    valid = targets != L.IGNORE_INDEX
    weights = valid.float() / valid.sum().clamp(min=1) if reduction == "mean" else valid.float()
    # the states, replicated over tp (gathered along the sequence under sequence parallelism); backward: summed
    x = C.all_gather(x, mesh, "tp", 1) if L.sequence_parallel(mesh) else C.copy_to_region(x, mesh, "tp")
    return HL.head_loss(x.reshape(-1, x.shape[-1]), head, targets.reshape(-1), weights.reshape(-1), mesh, "tp",
                        cfg.vocab_size, softcap=softcap, bias=bias)


FUSED_HEAD = True  # the models' losses through head_loss's fused path (False: the logits, then lm_loss)


def lm_loss(logits: torch.Tensor, batch: dict, cfg, mesh, reduction: str = "mean") -> torch.Tensor:
    """transformers' ``labels=`` loss from this rank's vocab-sharded ``logits``: the shifted cross-entropy over
    ``batch["labels"]`` (default ``input_ids``; ``-100`` ignored, ``batch["loss_mask"]`` optional)."""
    return L.causal_lm_loss(logits, batch.get("labels", batch["input_ids"]), mesh, "tp", batch.get("loss_mask"),
                            reduction, cfg.vocab_size)


def tables(w: Callable, ones: Callable, cfg, layers: list) -> dict:
    """A decoder's parameter tree around its ``layers``: ``embed`` (its padding row zero), the final ``norm`` and,
    unless ``cfg.tie_word_embeddings``, ``lm_head``; ``w``, ``ones`` from :func:`normal_init`."""
    d = cfg.hidden_size
    params = {"embed": vocab_table(w(cfg.rows, d), cfg, cfg.pad_token_id), "layers": layers, "norm": ones(d)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = vocab_table(w(cfg.rows, d), cfg)
    return params


def embed(params, batch: dict, cfg, mesh) -> torch.Tensor:
    """The vocab-parallel token embedding ``embed`` of ``batch["input_ids"]``, (B, T, d), as transformers'
    ``nn.Embedding(padding_idx=cfg.pad_token_id)``: no gradient into the padding row from its lookups."""
    ids = L.context_chunk(batch["input_ids"], mesh)  # (this cp rank's chunk of the positions)
    return L.padding_row_embedding(params["embed"], ids, mesh, "tp", cfg.pad_token_id)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wo: torch.Tensor, mesh,
           window: int | None = None) -> torch.Tensor:
    """Causal attention of this rank's heads, ``q`` (B, Hq/tp, T, hd) and ``k``, ``v`` (B, Hkv/tp, T, hd), through
    the row-parallel output projection ``wo`` (d, Hq/tp*hd): (B, T, d), summed over tp."""
    o = einops.rearrange(causal(q, k, v, mesh, window), "b h t d -> b t (h d)")  # (B, T, Hq/tp*hd)
    return L.row_parallel_sum_(F.linear(o, wo), mesh, "tp")  # (B, T, d), or (B, T/tp, d): sequence parallel


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh, window: int | None = None) -> torch.Tensor:
    """Causal attention, (B, Hq, T, hd) from ``q`` and ``k``, ``v`` (B, Hkv, T, hd), on ``mesh``: over cp the
    queries are this rank's pieces and the keys are gathered whole; where the mesh carries packed documents
    (``mesh.documents``) each query sees only its own document's keys."""
    docs = mesh.documents
    if L.context_parallel(mesh):  # the queries are this cp rank's pieces: each sees the keys up to its end
        k, v = L.context_whole(k, mesh, 2), L.context_whole(v, mesh, 2)  # (B, Hkv, T, hd), sequence order
    if docs is not None:
        return _by_document(q, k, v, mesh, window, docs)
    parts, at = [], 0
    for a, n in L.context_pieces(mesh, k.shape[2]):  # (the whole sequence, one piece, without cp)
        parts.append(A.causal(q[:, :, at:at + n], k[:, :, :a + n], v[:, :, :a + n], window, a))
        at += n
    return torch.cat(parts, 2) if len(parts) > 1 else parts[0]  # (B, Hq, T/cp, hd)


# Documents per row beyond which one call with the block-diagonal mask beats a kernel call per document
# (benchmarks/documents.py: rows of ~13 arithmetic samples ran 4x slower one call per document than across them).
MANY_DOCUMENTS = 4


def _by_document(q, k, v, mesh, window: int | None, docs) -> torch.Tensor:
    """Causal attention inside each document. Float32 CPU rows of 64-512 positions: one block-causal call, its
    score blocks masked by document (the work of causal attention). Rows of a few documents: per row, per query
    piece, per document it meets, one kernel call on the document's keys up to the piece's end (no (T, T) mask).
    Rows of many short documents (more than ``MANY_DOCUMENTS``), and compiled code (where the spans cannot be read
    on the host): one call with the block-diagonal mask. On meta tensors (a plan) each row counts as one document:
    the most work, the memory of the eager calls, which keep no mask."""
    pieces = L.context_pieces(mesh, k.shape[2])
    one = not L.context_parallel(mesh)  # (the queries are the keys' positions: a contiguous cp chunk is not)
    if (torch.compiler.is_compiling() or (one and A.blocked_within(q, k, v, window))
            or (not q.is_meta and docs.count > MANY_DOCUMENTS * q.shape[0])):
        if one:
            return A.within_documents(q, k, v, docs.ids, lambda: docs.mask(window), window)
        mask = docs.mask(window)  # (B, 1, T, T)
        rows = torch.cat([mask[:, :, a:a + n] for a, n in pieces], 2)  # (B, 1, T/cp, T): the queries' rows
        return F.scaled_dot_product_attention(q, k, v, attn_mask=rows, enable_gqa=True)
    out = []
    for b, row in enumerate([((0, k.shape[2]),)] * q.shape[0] if q.is_meta else docs.spans):
        parts, at = [], 0
        for a, n in pieces:
            for s, e in row:
                qs, qe = max(s, a), min(e, a + n)
                if qs < qe:  # queries qs..qe of document s..e: its keys s..qe, the queries the last of them
                    parts.append(A.causal(q[b:b + 1, :, at + qs - a:at + qe - a], k[b:b + 1, :, s:qe],
                                          v[b:b + 1, :, s:qe], window, qs - s))
            at += n
        out.append(torch.cat(parts, 2) if len(parts) > 1 else parts[0])
    return torch.cat(out, 0) if len(out) > 1 else out[0]


LAYER_SPECS = {  # Megatron's plan for a layer's leaves, by the names the decoders here give them
    "attn_norm": P(), "mlp_norm": P(),
    "wq": P("tp", None), "wk": P("tp", None), "wv": P("tp", None), "wo": P(None, "tp"),
    "bq": P("tp"), "bk": P("tp"), "bv": P("tp"), "bo": P(),
    "w_gate": P("tp", None), "w_up": P("tp", None), "w_down": P(None, "tp"),
    "b_gate": P("tp"), "b_up": P("tp"), "b_down": P(),
}


def megatron_specs(shapes: dict, cfg, mesh) -> dict:
    """The specs of a decoder tree shaped like ``shapes`` (a model's ``init`` on meta): column-parallel q/k/v and
    gate/up, row-parallel o and down, vocab-parallel embedding and head. Where ``mesh``'s tp does not divide
    ``cfg.num_key_value_heads``, k/v are replicated instead, so no head is cut apart (the attention then takes the
    kv heads its query heads use)."""
    cfg.check_mesh(mesh)
    layer = dict(LAYER_SPECS)
    if mesh is not None and cfg.num_key_value_heads % mesh.axis_size("tp"):
        layer |= {"wk": P(), "wv": P(), "bk": P(), "bv": P()}
    out = {"embed": P("tp", None), "layers": [{k: layer[k] for k in lp} for lp in shapes["layers"]], "norm": P()}
    if "lm_head" in shapes:
        out["lm_head"] = P("tp", None)
    return out


def specs_of(init: Callable) -> Callable:
    """``specs(cfg, mesh=None)`` for a decoder whose tree ``init(cfg, device="meta")`` builds: its
    :func:`megatron_specs`."""

    def specs(cfg, mesh=None):
        return megatron_specs(init(cfg, device="meta"), cfg, mesh)

    specs.__doc__ = megatron_specs.__doc__
    return specs
