"""Baichuan2-7B as its published checkpoints lay it out (``model_type: "baichuan"``, remote-code modelling).

A Llama-shaped decoder (RMSNorm, rotary positions with base 10000, SwiGLU MLP, no biases, multi-head attention, an
untied head) with two differences in kind:

* the checkpoint fuses q, k and v into one ``self_attn.W_pack.weight`` of shape ``(3*hidden, hidden)`` (q rows,
  then k rows, then v rows). It is split here into three leaves (the HF table lists the splits), so that tp shards
  each by heads and the export puts them back together;
* the head is a *NormHead*: ``logits = h @ normalize(lm_head.weight).T``, each vocabulary row divided by its L2
  norm in every forward pass (the published code does this in training; at inference it normalises once, which
  computes the same). Under tp each rank normalises its own block of rows, which is exact since the norm is per row.

The embedding is ``nn.Embedding(..., padding_idx=pad_token_id)`` in the published code: the row of
``pad_token_id`` receives no gradient, and it starts at zero. Both are kept.

Refused, with the key that shows it: the 13B layout (ALiBi attention biases and no rotary embedding: its
config.json has no ``max_position_embeddings``, and its sizes are 5120 wide, 40 layers of 40 heads), Baichuan 1
7B (architecture ``BaiChuanForCausalLM``: a plain linear head), a nonzero ``z_loss_weight`` (the published z-loss,
``z_loss_weight * mean(max(logits)^2)`` over every position, is averaged over positions, not targets, so it does
not split over micro-batches weighed by their targets), tied embeddings and activations other than silu.

Per-shard code as in the Llama model (docs/ARCHITECTURE.md, Conventions): q/k/v and gate/up column-parallel, o and
down row-parallel, vocab-parallel embedding and head, vocab-parallel cross-entropy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import einops
import torch
import torch.nn.functional as F

import funcpar as fp
from funcpar import P
from funcpar import decoder as D
from funcpar import layers as L

MODEL_TYPES = ("baichuan",)
ARCHITECTURE = "BaichuanForCausalLM"
ROPE_BASE = 10000.0  # fixed in the published 7B modelling code; config.json has no key for it
_13B_SHAPE = (5120, 40, 40)  # hidden_size, num_hidden_layers, num_attention_heads of the published 13B models


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(D.DecoderConfig):
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    model_type: str = "baichuan"

    def __post_init__(self):
        L.check_sizes(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "max_position_embeddings")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"baichuan.Config: hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"baichuan.Config: rms_norm_eps={self.rms_norm_eps} must be positive")
        pad = self.pad_token_id
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < self.vocab_size):
            raise ValueError(f"baichuan.Config: pad_token_id={pad!r} is not a token id in [0, {self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Config":
        _refuse_unsupported(d)
        return cls(**cls.sizes_of(d), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   max_position_embeddings=d["max_position_embeddings"])

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict: the original one where this config came from a folder (every key it had, auto_map
        and the tokenizer ids included), with our fields set."""
        d = dict(self.hf)
        d.update(
            model_type="baichuan",
            architectures=d.get("architectures") or [ARCHITECTURE],
            **self.hf_sizes(),
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            tie_word_embeddings=False,
        )
        if self.pad_token_id is not None or "pad_token_id" in d:
            d["pad_token_id"] = self.pad_token_id
        return d


def _refuse_unsupported(d: dict[str, Any]) -> None:
    """Raise a ValueError naming the config key for a model_type "baichuan" config this model does not compute."""
    mt = d.get("model_type", "baichuan")
    if mt != "baichuan":
        raise ValueError(f"model_type '{mt}' is not baichuan")
    if "max_position_embeddings" not in d:
        raise ValueError("config has no 'max_position_embeddings': that is the Baichuan 13B layout (ALiBi attention "
                         "biases instead of rotary positions), which funcpar does not implement (Baichuan2-7B it does)")
    shape = tuple(d.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads"))
    if shape == _13B_SHAPE:
        raise ValueError(f"hidden_size, num_hidden_layers, num_attention_heads = {shape} are the Baichuan 13B sizes, "
                         f"whose modelling uses ALiBi attention biases instead of rotary positions: not implemented")
    archs = d.get("architectures") or []
    if "BaiChuanForCausalLM" in archs:
        raise ValueError("architectures ['BaiChuanForCausalLM'] is Baichuan 1 7B, whose head is a plain linear layer; "
                         "funcpar's baichuan model is Baichuan2-7B (BaichuanForCausalLM, a normalised head)")
    z = d.get("z_loss_weight", 0)
    if isinstance(z, bool) or not isinstance(z, (int, float)) or z != 0:
        raise ValueError(f"config key 'z_loss_weight' is {z!r}: funcpar's baichuan model supports only 0 (the "
                         f"published z-loss averages over all positions, not over targets)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act '{act}' is not supported by funcpar's baichuan model (only 'silu')")
    if d.get("tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings=true is not supported: Baichuan2's NormHead is its own weight")


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """Global parameters as the published code initialises them: N(0, 0.02) linear and embedding weights (the
    padding row zero), unit norms, and the NormHead uniform in +-1/sqrt(hidden). ``device="meta"``: shapes only."""
    g = None if torch.device(device or "cpu").type == "meta" else torch.Generator().manual_seed(seed)
    d, inter = cfg.hidden_size, cfg.intermediate_size

    def w(*shape, bound=None):
        t = torch.empty(*shape, dtype=dtype, device=device)
        if g is None:
            return t
        if bound is None:
            return t.copy_(torch.randn(*shape, generator=g) * 0.02)
        return t.copy_((torch.rand(*shape, generator=g) * 2 - 1) * bound)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    layers = [
        {"attn_norm": ones(d), "wq": w(d, d), "wk": w(d, d), "wv": w(d, d), "wo": w(d, d), "mlp_norm": ones(d),
         "w_gate": w(inter, d), "w_up": w(inter, d), "w_down": w(d, inter)}
        for _ in range(cfg.num_hidden_layers)
    ]
    embed = D.vocab_table(w(cfg.rows, d), cfg, cfg.pad_token_id)
    head = D.vocab_table(w(cfg.rows, d, bound=1 / math.sqrt(d)), cfg)
    return {"embed": embed, "layers": layers, "norm": ones(d), "lm_head": head}


_LAYER_SPECS = {
    "attn_norm": P(), "mlp_norm": P(),
    "wq": P("tp", None), "wk": P("tp", None), "wv": P("tp", None), "wo": P(None, "tp"),
    "w_gate": P("tp", None), "w_up": P("tp", None), "w_down": P(None, "tp"),
}


def specs(cfg: Config, mesh=None):
    """Megatron's plan: q/k/v column-parallel by heads, gate/up column-parallel, o/down row-parallel,
    vocab-parallel embedding and NormHead."""
    cfg.check_mesh(mesh)  # (tp divides the heads: q/k/v are split over tp by whole heads)
    return {"embed": P("tp", None), "layers": [dict(_LAYER_SPECS) for _ in range(cfg.num_hidden_layers)],
            "norm": P(), "lm_head": P("tp", None)}


# published name <-> pytree path ({i} = layer index); W_pack is three leaves: part k of 3 along its rows
_LAYER_HF = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.W_pack.weight", "wk": "self_attn.W_pack.weight", "wv": "self_attn.W_pack.weight",
    "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
HF_NAMES = [("embed", "model.embed_tokens.weight"), ("norm", "model.norm.weight"), ("lm_head", "lm_head.weight")] + [
    (f"layers.{{i}}.{k}", f"model.layers.{{i}}.{v}") for k, v in _LAYER_HF.items()]
HF = fp.HFNames(
    HF_NAMES,
    splits={"layers.{i}.wq": (0, 0, 3), "layers.{i}.wk": (0, 1, 3), "layers.{i}.wv": (0, 2, 3)},
    vocab_padded=["embed", "lm_head"],  # rows beyond the real vocabulary are padding (absent from checkpoints)
    ignored=[r".*\.rotary_emb\.inv_freq$"],  # a buffer some conversions carry; it holds nothing to load
)


# ------------------------------------------------------------------------------------------------- the model


def _rope_cos_sin(cfg: Config, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (T, hd), in float32 (the published code rotates in float32)."""
    hd = cfg.head_dim
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, hd, 2, device=device).float() / hd))  # (hd/2,)
    angles = torch.outer(torch.arange(T, device=device).float(), inv)  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (B, H, T, hd), computed in float32 and cast back (as the published code does)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)



def _attention(p, x, cos, sin, cfg: Config, mesh):
    hd = cfg.head_dim
    q, k, v = L.column_parallel(x, [p["wq"], p["wk"], p["wv"]], mesh)  # (B, T, d) -> (B, T, H/tp*hd) each
    q, k, v = (einops.rearrange(t, "b t (h d) -> b h t d", d=hd) for t in (q, k, v))  # (B, H/tp, T, hd)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # (B, H/tp, T, hd)
    return D.attend(q, k, v, p["wo"], mesh)  # (B, T, d)



def _block(lp, x, i: int, cfg: Config, mesh) -> torch.Tensor:
    # the whole sequence's positions, then this cp rank's pieces of them
    cos, sin = (L.position_rows(t, mesh) for t in _rope_cos_sin(cfg, L.sequence_length(x, mesh), x.device))
    x = D.attention_residual(lp, x, lambda h: _attention(lp, h, cos, sin, cfg, mesh), cfg.rms_norm_eps, mesh)
    return D.mlp_residual(lp, x, cfg.rms_norm_eps, mesh)


def _head_logits(params, x: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    """NormHead: this rank's vocabulary rows, each divided by its L2 norm, times the final normed states."""
    x = L.rms_norm(x, L.sequence_shared(params["norm"], mesh), cfg.rms_norm_eps)
    return L.column_parallel(x, [F.normalize(params["lm_head"], dim=-1)], mesh)[0]  # (B, T, d) -> (B, T, V/tp)


def _head(params, x: torch.Tensor, batch: dict, cfg: Config, mesh, reduction: str = "mean") -> torch.Tensor:
    x = L.rms_norm(x, L.sequence_shared(params["norm"], mesh), cfg.rms_norm_eps)
    return D.head_loss(x, F.normalize(params["lm_head"], dim=-1), batch, cfg, mesh, reduction)  # NormHead


STAGES = fp.Stages(D.embed, _block, _head, embed_leaves=lambda cfg: ["embed"],
                   head_leaves=lambda cfg: ["norm", "lm_head"])


def forward(params, tokens: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    """This rank's logits, (B, T, V/tp): vocab-sharded over tp (all of them at ``Mesh()``), padding columns of a
    padded vocabulary dropped."""
    x = STAGES.hidden(params, {"input_ids": tokens}, cfg, mesh)  # (B, T, d)
    return L.unpad_logits(_head_logits(params, x, cfg, mesh), mesh, "tp", cfg.vocab_size)


def loss(params, batch: dict, cfg: Config, mesh, reduction: str = "mean", remat: bool = False) -> torch.Tensor:
    """The published ``labels=`` loss with ``z_loss_weight`` 0: mean over counted tokens of the shifted
    cross-entropy (``-100`` ignored, ``batch["loss_mask"]`` optional), computed vocab-parallel."""
    return STAGES.loss(params, batch, cfg, mesh, reduction, remat)


MODEL = fp.register_model(fp.ModelSpec(
    name="baichuan", model_types=MODEL_TYPES, Config=Config, init=init, specs=specs, forward=forward, loss=loss,
    hf=HF, batch_weight=L.count_targets, check_batch=L.token_range_errors, remat=True, stages=STAGES,
    sequence_parallel=True, context_parallel=True, documents=True,
    config_types=fp.DECODER_CONFIG_TYPES,
))
