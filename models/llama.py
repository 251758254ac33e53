"""The Llama family as transformers defines it: Llama (GQA, rope_theta, llama3/linear rope scaling), Mistral
(sliding-window attention), Qwen2 (q/k/v bias), with or without tied embeddings.

Per-shard code (docs/ARCHITECTURE.md, Conventions): q/k/v and gate/up are column-parallel (output rows split over tp), o
and down are row-parallel (input columns split), the embedding and the LM head are vocab-parallel, and the loss is a
vocab-parallel cross-entropy, so full-vocabulary logits never exist during training. Weights keep transformers' ``(out,
in)`` layout, so this model's HF table needs no transposes. Local head counts are read from the shards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import einops
import torch

import funcpar as fp
from funcpar import collectives as C
from funcpar import decoder as D
from funcpar import layers as L

MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(D.RotaryConfig):
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = dataclasses.field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple = ()  # per layer: a window size or None
    model_type: str = "llama"

    def __post_init__(self):
        """Validated and completed however it was built: per-layer fields sized to the layer count."""
        L.check_sizes(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"llama.Config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        n, windows = self.num_hidden_layers, tuple(self.sliding_windows) or (None,) * self.num_hidden_layers
        if len(windows) != n or any(w is not None and (not isinstance(w, int) or w < 1) for w in windows):
            raise ValueError(f"llama.Config: sliding_windows={self.sliding_windows!r} must give each of the {n} "
                             f"layers a window (a positive int) or None")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"llama.Config: rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} "
                             f"must be positive")
        object.__setattr__(self, "sliding_windows", windows)
        L.check_pad_token_id(self)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Config":
        mt = d.get("model_type", "llama")
        if mt not in MODEL_TYPES:
            raise ValueError(f"model_type '{mt}' is not a Llama-family model ({', '.join(MODEL_TYPES)})")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act '{act}' is not supported by funcpar's llama model (only 'silu')")
        heads = d["num_attention_heads"]
        rp = d.get("rope_parameters") or {}
        theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = dict(rp) if rp.get("rope_type", rp.get("type", "default")) != "default" else d.get("rope_scaling")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "linear", "llama3"):
                raise ValueError(f"rope scaling type '{kind}' is not supported (supported: default, linear, llama3)")
            if kind == "default":
                scaling = None
        n = d["num_hidden_layers"]
        window = d.get("sliding_window")
        if mt == "mistral":
            windows = tuple([window] * n)
        elif mt == "qwen2" and d.get("use_sliding_window") and window:
            types = d.get("layer_types") or [
                "sliding_attention" if i >= d.get("max_window_layers", n) else "full_attention" for i in range(n)
            ]
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        else:
            windows = tuple([None] * n)
        bias = bool(d.get("attention_bias", False))
        return cls(
            **cls.sizes_of(d),
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if mt == "qwen2" else bias,
            o_bias=False if mt == "qwen2" else bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_windows=windows,
            model_type=mt,
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict: the original one where this config came from a folder, with our fields set."""
        d = dict(self.hf)
        d.update(
            model_type=self.model_type,
            architectures=d.get("architectures") or [ARCHITECTURES[self.model_type]],
            **self.hf_sizes(),
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=self.pad_token_id,
            hidden_act="silu",
        )
        if self.model_type != "qwen2":
            d["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if "rope_theta" in self.hf and "rope_parameters" not in self.hf:  # transformers 4 style
            d["rope_theta"] = self.rope_theta
            d["rope_scaling"] = self.rope_scaling
        else:
            d["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return d


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """Global parameters, N(0, 0.02) weights and unit norms as transformers initialises them. ``device="meta"``
    gives shapes only."""
    w, ones, zeros = D.normal_init(seed, dtype, device)
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    layers = []
    for _ in range(cfg.num_hidden_layers):
        lp = {
            "attn_norm": ones(d),
            "wq": w(cfg.num_attention_heads * hd, d),
            "wk": w(cfg.num_key_value_heads * hd, d),
            "wv": w(cfg.num_key_value_heads * hd, d),
            "wo": w(d, cfg.num_attention_heads * hd),
            "mlp_norm": ones(d),
            "w_gate": w(inter, d),
            "w_up": w(inter, d),
            "w_down": w(d, inter),
        }
        if cfg.qkv_bias:
            lp |= {"bq": zeros(cfg.num_attention_heads * hd), "bk": zeros(cfg.num_key_value_heads * hd),
                   "bv": zeros(cfg.num_key_value_heads * hd)}
        if cfg.o_bias:
            lp["bo"] = zeros(d)
        if cfg.mlp_bias:
            lp |= {"b_gate": zeros(inter), "b_up": zeros(inter), "b_down": zeros(d)}
        layers.append(lp)
    return D.tables(w, ones, cfg, layers)


# Megatron's plan; where tp does not divide the kv heads, k/v are replicated and each rank takes the kv heads its
# query heads use (``_kv_weights``)
specs = D.specs_of(init)


# transformers name <-> pytree path: a literal table ({i} = layer index); this model stores weights as HF does,
# so it has no transposes and no splits
_LAYER_HF = {  # pytree key in a layer -> transformers name under model.layers.{i}
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias", "bo": "self_attn.o_proj.bias", "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight", "b_gate": "mlp.gate_proj.bias",
    "b_up": "mlp.up_proj.bias", "b_down": "mlp.down_proj.bias",
}
HF_NAMES = [("embed", "model.embed_tokens.weight"), ("norm", "model.norm.weight"), ("lm_head", "lm_head.weight")] + [
    (f"layers.{{i}}.{k}", f"model.layers.{{i}}.{v}") for k, v in _LAYER_HF.items()]
HF = fp.HFNames(
    HF_NAMES,
    vocab_padded=["embed", "lm_head"],  # rows beyond the real vocabulary are padding (absent from checkpoints)
    ignored=[r".*\.rotary_emb\.inv_freq$"],  # tensors some checkpoints carry that hold nothing to load
    ignored_if_tied=[r"^lm_head\.weight$"],  # a tied checkpoint may still carry a copy of the head
)


# ------------------------------------------------------------------------------------------------- the model


def rope_inv_freq(cfg: Config) -> torch.Tensor:
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))  # (hd/2,)
    s = cfg.rope_scaling
    if s is None:
        return inv
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv / s["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def _rope_cos_sin(cfg: Config, T: int, device, dtype):
    freqs = torch.arange(T, device=device).float()[:, None] * rope_inv_freq(cfg).to(device)[None, :]  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _kv_weights(p, cfg: Config, mesh):
    """This rank's k/v projections: its shards, or, where they are replicated because tp does not divide the kv
    heads, the rows of the kv heads its query heads use (gradients summed over tp by ``copy_to_region``)."""
    hd = cfg.head_dim
    hq, hkv = p["wq"].shape[0] // hd, p["wk"].shape[0] // hd  # local head counts, read from the shards
    if p["wq"].shape[0] % hd or p["wk"].shape[0] % hd:
        raise ValueError(
            f"the tp plan cuts attention heads apart (local wq {tuple(p['wq'].shape)}, wk {tuple(p['wk'].shape)}, "
            f"head_dim {hd}, tp={mesh.axis_size('tp')}): build specs with specs(cfg, mesh), which replicates k/v "
            f"when tp does not divide num_key_value_heads={cfg.num_key_value_heads}"
        )
    names = [n for n in ("wk", "wv", "bk", "bv") if n in p]
    if hkv != cfg.num_key_value_heads or hq == cfg.num_attention_heads:
        return [p[n] for n in ("wk", "wv")] + [p.get(n) for n in ("bk", "bv")]
    group = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per kv head
    q0 = mesh.coord("tp") * hq
    k0, k1 = q0 // group, (q0 + hq - 1) // group + 1  # kv heads used by query heads q0 .. q0+hq-1
    sel = {n: C.copy_to_region(p[n], mesh, "tp")[k0 * hd : k1 * hd] for n in names}
    return [sel["wk"], sel["wv"], sel.get("bk"), sel.get("bv")]


def _attention(p, x, cos, sin, window, cfg: Config, mesh):
    hd = cfg.head_dim
    wk, wv, bk, bv = _kv_weights(p, cfg, mesh)
    # (B, T, d) -> (B, T, Hq/tp*hd), (B, T, Hkv/tp*hd) twice; x's gradient summed over tp
    q, k, v = L.column_parallel(x, [p["wq"], wk, wv], mesh, "tp", [p.get("bq"), bk, bv])
    q, k, v = (einops.rearrange(t, "b t (h d) -> b h t d", d=hd) for t in (q, k, v))  # (B, H/tp, T, hd)
    q = L.rotary(q, cos, sin)  # (B, Hq/tp, T, hd)
    k = L.rotary(k, cos, sin)  # (B, Hkv/tp, T, hd)
    y = D.attend(q, k, v, p["wo"], mesh, window)  # (B, T, d)
    return y + L.sequence_shared(p["bo"], mesh) if "bo" in p else y


def _attention_half(lp, x, i: int, cfg: Config, mesh) -> torch.Tensor:
    """Layer ``i``'s attention and its residual (a pipeline may cut a layer after it)."""
    # (T, hd): the positions of the whole sequence, then this cp rank's chunk of them
    cos, sin = (L.position_rows(t, mesh) for t in _rope_cos_sin(cfg, L.sequence_length(x, mesh), x.device,
                                                                    x.dtype))
    window = cfg.sliding_windows[i]
    return D.attention_residual(lp, x, lambda h: _attention(lp, h, cos, sin, window, cfg, mesh), cfg.rms_norm_eps,
                                mesh)


def _mlp_half(lp, x, i: int, cfg: Config, mesh) -> torch.Tensor:
    """The MLP and its residual."""
    return D.mlp_residual(lp, x, cfg.rms_norm_eps, mesh)


def _block(lp, x, i: int, cfg: Config, mesh) -> torch.Tensor:
    return _mlp_half(lp, _attention_half(lp, x, i, cfg, mesh), i, cfg, mesh)


def _head(params, x: torch.Tensor, batch: dict, cfg: Config, mesh, reduction: str = "mean") -> torch.Tensor:
    return D.rms_head_loss(params, x, batch, cfg, mesh, reduction)


STAGES = fp.Stages(D.embed, _block, _head, embed_leaves=lambda cfg: ["embed"],
                   head_leaves=lambda cfg: ["norm", "embed" if cfg.tie_word_embeddings else "lm_head"],
                   halves=(_attention_half, _mlp_half),  # first_leaves: the attention's; the rest, the MLP's
                   first_leaves=lambda cfg: ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"))


def forward(params, tokens: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    """This rank's logits, (B, T, V/tp): vocab-sharded over tp (the full logits at ``Mesh()``). Columns of a padded
    vocabulary are dropped, so concatenating the ranks' blocks gives exactly ``vocab_size`` columns."""
    x = STAGES.hidden(params, {"input_ids": tokens}, cfg, mesh)  # (B, T, d)
    return L.unpad_logits(D.rms_head_logits(params, x, cfg, mesh), mesh, "tp", cfg.vocab_size)


def loss(params, batch: dict, cfg: Config, mesh, reduction: str = "mean", remat: bool = False) -> torch.Tensor:
    """transformers' ``labels=`` loss: mean over counted tokens of the shifted cross-entropy (``-100`` ignored,
    ``batch["loss_mask"]`` optional), computed vocab-parallel. ``labels`` defaults to ``input_ids``. ``remat``
    recomputes each layer in the backward pass instead of keeping its activations."""
    return STAGES.loss(params, batch, cfg, mesh, reduction, remat)


# the JSON types of the config.json keys from_hf reads, refused by name before it runs (funcpar.ModelSpec)
CONFIG_TYPES = {**fp.DECODER_CONFIG_TYPES, "max_window_layers": (int,), "sliding_window": (int, None),
                **dict.fromkeys(("attention_bias", "mlp_bias", "use_sliding_window"), (bool,)),
                "layer_types": (list, None)}

MODEL = fp.register_model(fp.ModelSpec(
    name="llama", model_types=MODEL_TYPES, Config=Config, init=init, specs=specs, forward=forward, loss=loss,
    hf=HF, batch_weight=L.count_targets, check_batch=L.token_range_errors, remat=True, stages=STAGES,
    sequence_parallel=True, context_parallel=True, documents=True,
    config_types=CONFIG_TYPES,
))
