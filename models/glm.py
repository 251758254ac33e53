"""GLM as transformers' ``GlmForCausalLM`` computes it (``model_type`` "glm": GLM-4-9B and its relatives).

A Llama-shaped decoder (pre-norm RMSNorm blocks, GQA, SiLU-gated MLP) with three differences that matter here:
q/k/v carry a bias (``attention_bias``, on by default; o has none), rotary embedding covers only the first
``int(head_dim * partial_rotary_factor)`` dimensions of each head and rotates *adjacent* pairs ``(x[2j], x[2j+1])``
by angle ``t * theta**(-2j / rotary_dim)`` (the rest pass through), and the MLP's gate and up projections are one
fused ``gate_up_proj`` tensor (gate rows first). That tensor is split here into two leaves, so tp shards each by
rows like any column-parallel projection (the HF table lists the splits). The embedding has transformers'
``padding_idx``: the row of ``pad_token_id`` is zero at init and learns nothing from lookups.

Per-shard code (docs/ARCHITECTURE.md, Conventions): q/k/v and gate/up column-parallel, o and down row-parallel,
vocab-parallel embedding, head and loss. Weights keep transformers' ``(out, in)`` layout. Local head counts are read
from the shards; a tp that does not divide the kv heads replicates k/v (each rank uses the kv heads it needs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import einops
import torch

import funcpar as fp
from funcpar import collectives as C
from funcpar import decoder as D
from funcpar import layers as L

MODEL_TYPES = ("glm",)
# transformers' GlmConfig defaults: what a config.json key that is absent means
_DEFAULTS = dict(num_key_value_heads=2, head_dim=128, rms_norm_eps=1.5625e-07, rope_theta=10000.0,
                 partial_rotary_factor=0.5, max_position_embeddings=131072, tie_word_embeddings=False,
                 attention_bias=True, pad_token_id=151329, hidden_act="silu")


def _bad(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config key '{key}' is {value!r}: {why}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(D.RotaryConfig):
    rms_norm_eps: float = 1.5625e-07
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 131072
    attention_bias: bool = True
    model_type: str = "glm"

    def __post_init__(self):
        """Validated however it was built; errors name the config.json key."""
        L.check_sizes(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise _bad("num_attention_heads", self.num_attention_heads,
                       f"not a multiple of num_key_value_heads={self.num_key_value_heads}")
        for key in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, key) > 0:
                raise _bad(key, getattr(self, key), "must be positive")
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise _bad("partial_rotary_factor", f, "expected a number in (0, 1]")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise _bad("partial_rotary_factor", f, f"it rotates int({self.head_dim} * {f}) = {self.rotary_dim} "
                       f"dimensions of a head, which must be a positive even number")
        pad = self.pad_token_id
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < self.vocab_size):
            raise _bad("pad_token_id", pad, f"the embedding's padding row must be a token id in [0, "
                       f"{self.vocab_size}) (transformers builds nn.Embedding with it), or null for none")

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head rotary embedding rotates (transformers' ``int`` rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Config":
        """From a config.json dict; an absent key means what transformers' GlmConfig defaults it to."""
        if d.get("model_type", "glm") != "glm":
            raise _bad("model_type", d.get("model_type"), "funcpar's glm model implements 'glm' only")
        if d.get("hidden_act", "silu") != "silu":
            raise _bad("hidden_act", d["hidden_act"], "funcpar's glm model supports 'silu' only")
        # transformers 5 keeps rope settings in rope_parameters, transformers 4 at the top level (or rope_scaling)
        rp = d.get("rope_scaling") or d.get("rope_parameters") or {}
        key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind != "default":
            raise _bad(key, rp, f"rope_type '{kind}' is not supported by funcpar's glm model (only 'default')")
        theta = rp.get("rope_theta", d.get("rope_theta", _DEFAULTS["rope_theta"]))
        factor = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", _DEFAULTS["partial_rotary_factor"]))
        for name, v in (("rope_theta", theta), ("partial_rotary_factor", factor)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _bad(name, v, "expected a number")
        for name in ("num_key_value_heads", "head_dim"):
            if name in d and d[name] is None:
                raise _bad(name, None, "transformers' GlmForCausalLM cannot build a model without it")
        def get(key):
            return d.get(key, _DEFAULTS[key])

        return cls(**cls.sizes_of(
            d, num_key_value_heads=get("num_key_value_heads"), head_dim=get("head_dim"),
            rms_norm_eps=float(get("rms_norm_eps")), rope_theta=float(theta), partial_rotary_factor=factor,
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=bool(get("tie_word_embeddings")), attention_bias=bool(get("attention_bias")),
            pad_token_id=get("pad_token_id"),
        ))

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict: the original one where this config came from a folder, with our fields set."""
        d = dict(self.hf)
        d.update(
            model_type="glm", architectures=d.get("architectures") or ["GlmForCausalLM"], **self.hf_sizes(),
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias, pad_token_id=self.pad_token_id, hidden_act="silu",
        )
        rope = {"rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor}
        if "rope_parameters" not in self.hf and ("rope_theta" in self.hf or "partial_rotary_factor" in self.hf):
            d.update(rope)  # transformers 4 style, as it came
        else:
            d["rope_parameters"] = {**(self.hf.get("rope_parameters") or {}), "rope_type": "default", **rope}
        return d


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """Global parameters, N(0, 0.02) weights, zero biases and unit norms as transformers initialises them (the
    padding row of the embedding zero). ``device="meta"`` gives shapes only."""
    w, ones, zeros = D.normal_init(seed, dtype, device)
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd

    layers = []
    for _ in range(cfg.num_hidden_layers):
        lp = {"attn_norm": ones(d), "wq": w(hq, d), "wk": w(hkv, d), "wv": w(hkv, d), "wo": w(d, hq),
              "mlp_norm": ones(d), "w_gate": w(inter, d), "w_up": w(inter, d), "w_down": w(d, inter)}
        if cfg.attention_bias:
            lp |= {"bq": zeros(hq), "bk": zeros(hkv), "bv": zeros(hkv)}
        layers.append(lp)
    return D.tables(w, ones, cfg, layers)


specs = D.specs_of(init)  # Megatron's plan; k/v replicated where tp does not divide the kv heads (GLM-4-9B has 2)


_LAYER_HF = {  # pytree key in a layer -> transformers name under model.layers.{i}
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_up_proj.weight", "w_up": "mlp.gate_up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
HF = fp.HFNames(
    [("embed", "model.embed_tokens.weight"), ("norm", "model.norm.weight"), ("lm_head", "lm_head.weight")]
    + [(f"layers.{{i}}.{k}", f"model.layers.{{i}}.{v}") for k, v in _LAYER_HF.items()],
    # gate_up_proj is (2 * intermediate, hidden): gate rows first, then up (transformers chunks its output in two)
    splits={"layers.{i}.w_gate": (0, 0, 2), "layers.{i}.w_up": (0, 1, 2)},
    vocab_padded=["embed", "lm_head"],  # rows beyond the real vocabulary are padding (absent from checkpoints)
    ignored=[r".*\.rotary_emb\.inv_freq$"],
    ignored_if_tied=[r"^lm_head\.weight$"],  # a tied checkpoint may still carry a copy of the head
)


# ------------------------------------------------------------------------------------------------- the model


def _rope_cos_sin(cfg: Config, T: int, device, dtype):
    """cos and sin of each position's angle for each rotated pair: (T, rotary_dim / 2)."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # (R/2,)
    angles = torch.arange(T, device=device).float()[:, None] * inv_freq.to(device)[None, :]  # (T, R/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GLM's rotary embedding: adjacent pairs of the first R dims of each head rotated, the rest passed through."""
    R = 2 * cos.shape[-1]
    pairs = einops.rearrange(x[..., :R], "b h t (r two) -> b h t r two", two=2)  # (B, H, T, R/2, 2)
    a, b = pairs[..., 0], pairs[..., 1]  # (B, H, T, R/2) each
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (B, H, T, R/2, 2)
    return torch.cat((einops.rearrange(rotated, "b h t r two -> b h t (r two)"), x[..., R:]), dim=-1)  # (B,H,T,hd)



def _kv_weights(p, cfg: Config, mesh):
    """This rank's k/v projections (weights, biases or None): its shards, or, where tp does not divide the kv heads
    and they are replicated, the rows of the kv heads its query heads use (``copy_to_region`` sums their
    gradients over tp)."""
    hd = cfg.head_dim
    if p["wq"].shape[0] % hd or p["wk"].shape[0] % hd:
        raise ValueError(
            f"the tp plan cuts attention heads apart (local wq {tuple(p['wq'].shape)}, wk {tuple(p['wk'].shape)}, "
            f"head_dim {hd}, tp={mesh.axis_size('tp')}): build specs with specs(cfg, mesh), which replicates k/v "
            f"when tp does not divide num_key_value_heads={cfg.num_key_value_heads}")
    hq, hkv = p["wq"].shape[0] // hd, p["wk"].shape[0] // hd  # local head counts, read from the shards
    names = ("wk", "wv", "bk", "bv")
    if hkv != cfg.num_key_value_heads or hq == cfg.num_attention_heads:  # sharded by heads, or no tp at all
        return [p.get(n) for n in names]
    group = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per kv head
    q0 = mesh.coord("tp") * hq
    k0, k1 = q0 // group, (q0 + hq - 1) // group + 1  # kv heads used by query heads q0 .. q0+hq-1
    return [C.copy_to_region(p[n], mesh, "tp")[k0 * hd : k1 * hd] if n in p else None for n in names]


def _attention(p, x, cos, sin, cfg: Config, mesh):
    hd = cfg.head_dim
    wk, wv, bk, bv = _kv_weights(p, cfg, mesh)
    # (B, T, d) -> (B, T, Hq/tp*hd), (B, T, Hkv/tp*hd) twice; x's gradient summed over tp
    q, k, v = L.column_parallel(x, [p["wq"], wk, wv], mesh, "tp", [p.get("bq"), bk, bv])
    q, k, v = (einops.rearrange(t, "b t (h d) -> b h t d", d=hd) for t in (q, k, v))  # (B, H/tp, T, hd)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # (B, H/tp, T, hd)
    return D.attend(q, k, v, p["wo"], mesh)  # (B, T, d)



def _block(lp, x, i: int, cfg: Config, mesh) -> torch.Tensor:
    # the whole sequence's positions, then this cp rank's pieces of them
    cos, sin = (L.position_rows(t, mesh) for t in _rope_cos_sin(cfg, L.sequence_length(x, mesh), x.device, x.dtype))
    x = D.attention_residual(lp, x, lambda h: _attention(lp, h, cos, sin, cfg, mesh), cfg.rms_norm_eps, mesh)
    return D.mlp_residual(lp, x, cfg.rms_norm_eps, mesh)


def _head(params, x: torch.Tensor, batch: dict, cfg: Config, mesh, reduction: str = "mean") -> torch.Tensor:
    return D.rms_head_loss(params, x, batch, cfg, mesh, reduction)


STAGES = fp.Stages(D.embed, _block, _head, embed_leaves=lambda cfg: ["embed"],
                   head_leaves=lambda cfg: ["norm", "embed" if cfg.tie_word_embeddings else "lm_head"])


def forward(params, tokens: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    """This rank's logits, (B, T, V/tp): vocab-sharded over tp (the full logits at ``Mesh()``), the columns of a
    padded vocabulary dropped, so the ranks' blocks concatenate to exactly ``vocab_size`` columns."""
    x = STAGES.hidden(params, {"input_ids": tokens}, cfg, mesh)  # (B, T, d)
    return L.unpad_logits(D.rms_head_logits(params, x, cfg, mesh), mesh, "tp", cfg.vocab_size)


def loss(params, batch: dict, cfg: Config, mesh, reduction: str = "mean", remat: bool = False) -> torch.Tensor:
    """transformers' ``labels=`` loss (shifted cross-entropy, ``-100`` ignored, ``batch["loss_mask"]`` optional,
    ``labels`` defaulting to ``input_ids``), computed vocab-parallel; ``remat`` recomputes each layer backward."""
    return STAGES.loss(params, batch, cfg, mesh, reduction, remat)


# the JSON types of the config.json keys from_hf reads, refused by name before it runs (funcpar.ModelSpec)
CONFIG_TYPES = {**fp.DECODER_CONFIG_TYPES, "attention_bias": (bool,)}

MODEL = fp.register_model(fp.ModelSpec(
    name="glm", model_types=MODEL_TYPES, Config=Config, init=init, specs=specs, forward=forward, loss=loss,
    hf=HF, batch_weight=L.count_targets, check_batch=L.token_range_errors, remat=True, stages=STAGES,
    sequence_parallel=True, context_parallel=True, documents=True,
    config_types=CONFIG_TYPES,
))
