"""BLOOM as transformers' ``BloomForCausalLM`` computes it: word embeddings followed by a LayerNorm, ALiBi attention
(no position embeddings), LayerNorm with bias, BLOOM's tanh gelu, the LM head tied to the word embeddings.

The checkpoint keeps q/k/v in one ``query_key_value`` tensor whose rows are grouped by head: head ``h`` owns rows
``h*3*hd .. (h+1)*3*hd``, a block of query rows, then key rows, then value rows. This model keeps that tensor as one
leaf, split over tp by rows: a rank's block is then ``H/tp`` whole heads with their q, k and v, read from the file as
one contiguous run (no splits in the HF table; GPT-2's ``c_attn``, which stores all q before all k, needs them).
ALiBi adds ``slope[h] * key_position`` to head ``h``'s scores; a rank uses the slopes of the heads it holds.

Per-shard code as in llama.py: column-parallel ``query_key_value`` and ``dense_h_to_4h``, row-parallel ``dense`` and
``dense_4h_to_h`` (their biases added once, after the reduction), vocab-parallel embedding, head and loss. Dropout
(``hidden_dropout``, ``attention_dropout``) is not applied, as in transformers' eval mode; ``pretraining_tp`` with
``slow_but_exact`` only changes transformers' summation order, so both are accepted and have no effect here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import einops
import torch
import torch.nn.functional as F

import funcpar as fp
from funcpar import P
from funcpar import collectives as C
from funcpar import decoder as D
from funcpar import layers as L

MODEL_TYPES = ("bloom",)
# config.json keys a size may come under, preferred first (transformers lets n_embed override hidden_size, and maps
# num_hidden_layers / num_attention_heads onto n_layer / n_head)
_ALIASES = {"hidden_size": ("n_embed", "hidden_size"), "n_layer": ("n_layer", "num_hidden_layers"),
            "n_head": ("n_head", "num_attention_heads")}


@dataclasses.dataclass(frozen=True)
class Config(L.VocabPadding):
    vocab_size: int
    hidden_size: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False
    tie_word_embeddings: bool = True
    model_type: str = "bloom"
    vocab_rows: int | None = None  # rows of word_embeddings when padded for tp (see with_mesh); None = vocab_size
    hf: dict = dataclasses.field(default_factory=dict, hash=False, compare=False, repr=False)

    def __post_init__(self):
        """Validated however it was built."""
        L.check_sizes(self, "vocab_size", "hidden_size", "n_layer", "n_head")
        if self.hidden_size % self.n_head:
            raise ValueError(f"bloom.Config: hidden_size={self.hidden_size} is not a multiple of n_head={self.n_head}")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"bloom.Config: layer_norm_epsilon={self.layer_norm_epsilon} must be positive")
        if self.tie_word_embeddings is not True:
            raise ValueError("bloom.Config: tie_word_embeddings=False (an untied lm_head) is not supported")

    @property
    def head_dim(self) -> int:
        """Each head's width: the query, key and value rows of a head in ``w_qkv``."""
        return self.hidden_size // self.n_head

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Config":
        D.check_model_type(d, "bloom")
        sizes = {}
        for field, keys in _ALIASES.items():
            key = next((k for k in keys if d.get(k) is not None), None)
            if key is None:
                raise KeyError(field)
            if isinstance(d[key], bool) or not isinstance(d[key], int):
                raise ValueError(f"config key '{key}' is {d[key]!r}, expected an integer")
            sizes[field] = d[key]
        post = d.get("apply_residual_connection_post_layernorm", False)
        if not isinstance(post, bool):
            raise ValueError(f"config key 'apply_residual_connection_post_layernorm' is {post!r}, expected true or "
                             f"false")
        if d.get("tie_word_embeddings", True) is not True:
            raise ValueError("config key 'tie_word_embeddings' is false: BLOOM with an untied lm_head is not "
                             "supported")
        return cls(vocab_size=d["vocab_size"], **sizes, layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
                   apply_residual_connection_post_layernorm=post, hf=dict(d))

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict: the original one where this config came from a folder, with our fields set (under
        every alias the original used, so transformers reads the same sizes)."""
        d = dict(self.hf)
        d.update(
            model_type="bloom",
            architectures=d.get("architectures") or ["BloomForCausalLM"],
            vocab_size=self.vocab_size, layer_norm_epsilon=self.layer_norm_epsilon,
            apply_residual_connection_post_layernorm=self.apply_residual_connection_post_layernorm,
        )  # tie_word_embeddings is true (from_hf refuses false) whether the dict has it or leaves it to the default
        for field, keys in _ALIASES.items():
            d.update({k: getattr(self, field) for k in keys if k == field or d.get(k) is not None})
        return d


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """Global parameters as transformers initialises them: N(0, 0.02) weights, zero biases, unit LayerNorms.
    ``device="meta"`` gives shapes only."""
    w, ones, zeros = D.normal_init(seed, dtype, device)
    d = cfg.hidden_size

    layers = [
        {
            "ln1_w": ones(d), "ln1_b": zeros(d),
            "w_qkv": w(3 * d, d), "b_qkv": zeros(3 * d),  # rows (H, 3, hd): per head its q, k, v rows
            "wo": w(d, d), "bo": zeros(d),
            "ln2_w": ones(d), "ln2_b": zeros(d),
            "w_fc": w(4 * d, d), "b_fc": zeros(4 * d), "w_proj": w(d, 4 * d), "b_proj": zeros(d),
        }
        for _ in range(cfg.n_layer)
    ]
    wte = D.vocab_table(w(cfg.rows, d), cfg)
    return {"wte": wte, "emb_ln_w": ones(d), "emb_ln_b": zeros(d), "layers": layers,
            "ln_f_w": ones(d), "ln_f_b": zeros(d)}


_LAYER_SPECS = {
    "ln1_w": P(), "ln1_b": P(), "ln2_w": P(), "ln2_b": P(),
    "w_qkv": P("tp", None), "b_qkv": P("tp"),  # by rows: whole heads per rank
    "wo": P(None, "tp"), "bo": P(),
    "w_fc": P("tp", None), "b_fc": P("tp"), "w_proj": P(None, "tp"), "b_proj": P(),
}


def specs(cfg: Config, mesh=None):
    """Megatron's plan. tp must divide ``n_head``: a rank holds whole heads (and their ALiBi slopes)."""
    cfg.check_mesh(mesh)  # (tp divides n_head: a rank holds whole heads and their ALiBi slopes)
    return {"wte": P("tp", None), "emb_ln_w": P(), "emb_ln_b": P(),
            "layers": [dict(_LAYER_SPECS) for _ in range(cfg.n_layer)], "ln_f_w": P(), "ln_f_b": P()}


_LAYER_HF = {  # pytree key in a layer -> transformers name under transformer.h.{i}
    "ln1_w": "input_layernorm.weight", "ln1_b": "input_layernorm.bias",
    "w_qkv": "self_attention.query_key_value.weight", "b_qkv": "self_attention.query_key_value.bias",
    "wo": "self_attention.dense.weight", "bo": "self_attention.dense.bias",
    "ln2_w": "post_attention_layernorm.weight", "ln2_b": "post_attention_layernorm.bias",
    "w_fc": "mlp.dense_h_to_4h.weight", "b_fc": "mlp.dense_h_to_4h.bias",
    "w_proj": "mlp.dense_4h_to_h.weight", "b_proj": "mlp.dense_4h_to_h.bias",
}
HF_NAMES = [
    ("wte", "transformer.word_embeddings.weight"),
    ("emb_ln_w", "transformer.word_embeddings_layernorm.weight"),
    ("emb_ln_b", "transformer.word_embeddings_layernorm.bias"),
    ("ln_f_w", "transformer.ln_f.weight"),
    ("ln_f_b", "transformer.ln_f.bias"),
] + [(f"layers.{{i}}.{k}", f"transformer.h.{{i}}.{v}") for k, v in _LAYER_HF.items()]
HF = fp.HFNames(
    HF_NAMES,
    vocab_padded=["wte"],  # rows beyond the real vocabulary are padding (absent from checkpoints)
    ignored=[r"^lm_head\.weight$"],  # a copy of the tied head some checkpoints carry
)


# ------------------------------------------------------------------------------------------------- the model


def alibi_slopes(n_head: int) -> torch.Tensor:
    """BLOOM's ALiBi slope of every head, (n_head,) float32. With ``p`` the largest power of two ``<= n_head``, the
    first ``p`` heads take ``b**1 .. b**p`` for ``b = 2**(-8/p)``; the others take the odd powers ``c**1, c**3, ...``
    of ``c = 2**(-4/p)`` (every other slope a ``2p``-head model would have). Computed in float32 as transformers
    computes it, so the bits agree."""
    p = 2 ** int(math.floor(math.log2(n_head)))

    def powers(base: float, exponents: range) -> torch.Tensor:
        return torch.pow(torch.tensor(base, dtype=torch.float32), torch.tensor(list(exponents), dtype=torch.int32))

    slopes = powers(2.0 ** (-8.0 / p), range(1, p + 1))
    if p < n_head:
        slopes = torch.cat([slopes, powers(2.0 ** (-4.0 / p), range(1, 2 * (n_head - p), 2))])
    return slopes


def _local_heads(w_qkv: torch.Tensor, cfg: Config, mesh) -> tuple[int, int]:
    """``(first, count)``: the global index of this rank's first head and how many it holds, read from its shard."""
    rows, tp = w_qkv.shape[0], mesh.axis_size("tp")
    count = rows // (3 * cfg.head_dim)
    if rows % (3 * cfg.head_dim) or count * tp != cfg.n_head:
        raise ValueError(f"bloom: the tp plan cuts attention heads apart (local query_key_value {tuple(w_qkv.shape)}, "
                         f"head_dim {cfg.head_dim}, n_head {cfg.n_head}, tp={tp}): build specs with specs(cfg, mesh)")
    return mesh.coord("tp") * count, count


def attention_bias(w_qkv: torch.Tensor, T: int, cfg: Config, mesh) -> torch.Tensor:
    """This rank's additive attention mask (H/tp, T, T): ``slope[h] * key`` on and below the diagonal (ALiBi as
    transformers adds it: by key position, which softmax takes as ``slope * (key - query)``), -inf above it."""
    first, count = _local_heads(w_qkv, cfg, mesh)
    slopes = alibi_slopes(cfg.n_head)[first : first + count].to(w_qkv.device)  # (H/tp,)
    pos = torch.arange(T, device=w_qkv.device)
    alibi = (slopes[:, None, None] * pos.float()).to(w_qkv.dtype)  # (H/tp, 1, T)
    future = pos[None, :] > pos[:, None]  # (T, T): keys after the query
    return torch.where(future, float("-inf"), alibi)  # (H/tp, T, T)


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, cfg: Config) -> torch.Tensor:
    return F.layer_norm(x, (cfg.hidden_size,), w, b, cfg.layer_norm_epsilon)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's tanh approximation of gelu, with its constants."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def _attention(p, h: torch.Tensor, bias: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    qkv = L.column_parallel(h, [p["w_qkv"]], mesh, "tp", [p["b_qkv"]])[0]  # (B, T, d) -> (B, T, H/tp*3*hd)
    q, k, v = einops.rearrange(qkv, "b t (h s d) -> s b h t d", s=3, d=cfg.head_dim).unbind(0)  # (B, H/tp, T, hd)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (B, H/tp, T, hd); bias (H/tp, T, T)
    o = einops.rearrange(o, "b h t d -> b t (h d)")  # (B, T, H/tp*hd)
    return C.reduce_from_region_(F.linear(o, p["wo"]), mesh, "tp") + p["bo"]  # (B, T, H/tp*hd) -> (B, T, d)


def _mlp(p, h: torch.Tensor, mesh) -> torch.Tensor:
    h = _gelu(L.column_parallel(h, [p["w_fc"]], mesh, "tp", [p["b_fc"]])[0])  # (B, T, d) -> (B, T, 4d/tp)
    return C.reduce_from_region_(F.linear(h, p["w_proj"]), mesh, "tp") + p["b_proj"]  # (B, T, 4d/tp) -> (B, T, d)


def _layer(p, x: torch.Tensor, bias: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    """One block; the residual is the block's input, or (``apply_residual_connection_post_layernorm``) the normed
    input, around each of attention and MLP."""
    post = cfg.apply_residual_connection_post_layernorm
    h = _layer_norm(x, p["ln1_w"], p["ln1_b"], cfg)
    x = (h if post else x) + _attention(p, h, bias, cfg, mesh)
    h = _layer_norm(x, p["ln2_w"], p["ln2_b"], cfg)
    return (h if post else x) + _mlp(p, h, mesh)


def _embed(params, batch: dict, cfg: Config, mesh) -> torch.Tensor:
    x = L.vocab_embedding(params["wte"], batch["input_ids"], mesh, "tp")  # (B, T) -> (B, T, d)
    return _layer_norm(x, params["emb_ln_w"], params["emb_ln_b"], cfg)


def _stage_block(lp, x: torch.Tensor, i: int, cfg: Config, mesh) -> torch.Tensor:
    return _layer(lp, x, attention_bias(lp["w_qkv"], x.shape[1], cfg, mesh), cfg, mesh)


def _trunk(params, tokens: torch.Tensor, cfg: Config, mesh, remat: bool = False) -> torch.Tensor:
    """The last block's output (B, T, d), replicated over tp. ``remat``: keep only each layer's input and
    recompute the layer in the backward pass (activation checkpointing)."""
    x = _embed(params, {"input_ids": tokens}, cfg, mesh)  # (B, T, d)
    bias = attention_bias(params["layers"][0]["w_qkv"], tokens.shape[1], cfg, mesh)  # (H/tp, T, T), every layer's
    layer = functools.partial(_layer, cfg=cfg, mesh=mesh)
    for lp in params["layers"]:
        x = fp.remat(layer)(lp, x, bias) if remat else layer(lp, x, bias)
    return x


def _head_logits(params, x: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    x = _layer_norm(x, params["ln_f_w"], params["ln_f_b"], cfg)
    return L.column_parallel(x, [params["wte"]], mesh)[0]  # (B, T, d) @ (d, V/tp) -> (B, T, V/tp)


def _head(params, x: torch.Tensor, batch: dict, cfg: Config, mesh, reduction: str = "mean") -> torch.Tensor:
    return D.head_loss(_layer_norm(x, params["ln_f_w"], params["ln_f_b"], cfg), params["wte"], batch, cfg, mesh,
                       reduction)


def forward(params, tokens: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    """This rank's logits (B, T, V/tp), vocab-sharded over tp, padded vocabulary columns dropped."""
    logits = _head_logits(params, _trunk(params, tokens, cfg, mesh), cfg, mesh)
    return L.unpad_logits(logits, mesh, "tp", cfg.vocab_size)


def loss(params, batch: dict, cfg: Config, mesh, reduction: str = "mean", remat: bool = False) -> torch.Tensor:
    """transformers' ``labels=`` loss (shifted cross-entropy, ``-100`` ignored, ``loss_mask`` optional), computed
    vocab-parallel. ``remat`` recomputes each layer in the backward pass instead of keeping its activations."""
    return _head(params, _trunk(params, batch["input_ids"], cfg, mesh, remat), batch, cfg, mesh, reduction)


# the JSON types of the config.json keys from_hf reads, refused by name before it runs (funcpar.ModelSpec)
# (n_embed, an alias of hidden_size, is checked by from_hf itself)
CONFIG_TYPES = {**dict.fromkeys(("vocab_size", "hidden_size", "n_layer", "num_hidden_layers", "n_head",
                                 "num_attention_heads"), (int,)),
                "layer_norm_epsilon": (float,), "tie_word_embeddings": (bool,), "model_type": (str,)}

MODEL = fp.register_model(fp.ModelSpec(
    name="bloom", model_types=MODEL_TYPES, Config=Config, init=init, specs=specs, forward=forward, loss=loss,
    hf=HF, batch_weight=L.count_targets, check_batch=L.token_range_errors, remat=True,
    stages=fp.Stages(_embed, _stage_block, _head, embed_leaves=lambda cfg: ["wte", "emb_ln_w", "emb_ln_b"],
                     head_leaves=lambda cfg: ["ln_f_w", "ln_f_b", "wte"]),
    config_types=CONFIG_TYPES,
))
