"""ChatGLM3-6B–style folders (``model_type`` "chatglm", remote code) read as transformers' ``GlmForCausalLM``.

ChatGLM2/3's modelling code (``modeling_chatglm.py``) computes what transformers' GLM computes, for the configs
whose layout maps (the rest are refused with the key and its value named):

- RMSNorm blocks, pre-norm residuals, a final norm (``rmsnorm``, ``apply_residual_connection_post_layernorm``
  false, ``post_layer_norm``), ``layernorm_epsilon`` as ``rms_norm_eps``;
- grouped-query attention (``multi_query_attention``, ``multi_query_group_num`` kv heads of ``kv_channels``
  dimensions) whose ``query_key_value`` holds all q rows, then all k rows, then all v rows (``split([heads * kv,
  groups * kv, groups * kv])``), with a bias when ``add_qkv_bias``; ``dense`` is o_proj, without bias;
- rotary over the first half of each head (``RotaryEmbedding(kv_channels // 2)``: ``partial_rotary_factor``
  0.5) in adjacent pairs, angle ``t * (10000 * rope_ratio) ** (-2j / (kv_channels / 2))``: GLM's rotary with
  ``rope_theta = 10000 * rope_ratio``;
- ``dense_h_to_4h`` = gate rows then up rows (``chunk(2)``, ``silu(x[0]) * x[1]``): GLM's ``gate_up_proj``;
- an embedding of ``padded_vocab_size`` rows without ``padding_idx`` and its own ``output_layer`` (never tied).

This is the mapping of transformers' ``convert_glm_weights_to_hf.py`` (ChatGLM-layout GLM-4 folders to ``glm``),
with ``rope_ratio`` applied (the script's ``getattr(original_config, "rope_ratio", 1)`` on a dict is always 1) and
q/k/v cut by ``kv_channels`` as the modelling code cuts them (the script uses ``hidden_size // heads``, the same for
the published sizes). The fused q/k/v and gate/up tensors are split into GLM's leaves by the HF table; tp ranks
read only their rows of each part. ``original_rope`` (stored, never read by the modelling code),
``apply_query_key_layer_scaling`` and ``attention_softmax_in_fp32`` (untouched by the ``scaled_dot_product_attention``
path ChatGLM3 takes under torch 2) are accepted whatever their value; ``vocab_size`` is ignored (the tables have
``padded_vocab_size`` rows, and so do the logits, in ChatGLM as in GLM).

``Config.from_hf`` returns the :class:`funcpar.models.glm.Config` the folder maps onto (``model_type`` "glm"), so
a loaded ChatGLM folder is the glm model from then on, and ``fp.hf.save`` writes a transformers GLM folder
(``HFNames.export_as``) that ``GlmForCausalLM.from_pretrained`` loads. Its ``pad_token_id`` is null: ChatGLM's
embedding has no padding row, and GLM's ``padding_idx`` would keep that row from learning.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import funcpar as fp
from funcpar.models import glm

MODEL_TYPES = ("chatglm",)

# ChatGLM3's ChatGLMConfig defaults (configuration_chatglm.py): what an absent key means
_DEFAULTS = dict(kv_channels=128, seq_length=2048, layernorm_epsilon=1e-5, rope_ratio=1, multi_query_group_num=1,
                 add_qkv_bias=False, rmsnorm=True, post_layer_norm=True, apply_residual_connection_post_layernorm=False,
                 add_bias_linear=False, multi_query_attention=False, fp32_residual_connection=False,
                 quantization_bit=0, pre_seq_len=None, hidden_dropout=0.0, attention_dropout=0.0,
                 tie_word_embeddings=False)  # PretrainedConfig says True, but ChatGLM never ties output_layer

# key -> (the one value that maps onto GLM, what another value would mean)
_ONLY: dict[str, tuple[Any, str]] = {
    "rmsnorm": (True, "ChatGLM then uses LayerNorm (with a bias), which GLM has not"),
    "post_layer_norm": (True, "GLM always normalises the last block's output"),
    "apply_residual_connection_post_layernorm": (False, "ChatGLM then adds the normed input to the residual, GLM "
                                                        "the input itself"),
    "add_bias_linear": (False, "dense, dense_h_to_4h and dense_4h_to_h then carry biases, which GLM's o_proj and "
                               "MLP have not"),
    "multi_query_attention": (True, "query_key_value then holds q, k, v interleaved head by head ((heads, 3, "
                                    "kv_channels) rows), not all q rows, then k, then v"),
    "fp32_residual_connection": (False, "the residual stream then runs in float32 whatever the weights' dtype, "
                                        "which GLM does not do"),
    "quantization_bit": (0, "the weights are then quantised, not float tensors"),
    "pre_seq_len": (None, "its P-tuning prefix encoder has no GLM equivalent"),
    "tie_word_embeddings": (False, "ChatGLM's modelling code never ties output_layer to the embedding"),
    "hidden_dropout": (0.0, "funcpar's GLM has no dropout"),
    "attention_dropout": (0.0, "funcpar's GLM has no dropout"),
}
_SIZES = ("num_layers", "padded_vocab_size", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
          "multi_query_group_num", "seq_length")


def _bad(key: str, value: Any, why: str, absent: bool = False) -> ValueError:
    shown = f"{value!r} (absent: ChatGLMConfig's default)" if absent else repr(value)
    return ValueError(f"config key '{key}' is {shown}: {why}")


def _get(d: Mapping[str, Any], key: str) -> Any:
    """A key's value, or ChatGLMConfig's default where it has one (a size without one is required)."""
    return d.get(key, _DEFAULTS[key]) if key in _DEFAULTS else d[key]


def _check(d: Mapping[str, Any]) -> None:
    """Refuse, naming the key and its value, a ChatGLM config whose layout does not map onto GLM."""
    if d.get("model_type", "chatglm") != "chatglm":
        raise _bad("model_type", d.get("model_type"), "funcpar's chatglm import reads 'chatglm' folders only")
    for key, (ok, why) in _ONLY.items():
        v = _get(d, key)
        if v != ok or isinstance(v, bool) != isinstance(ok, bool):
            raise _bad(key, v, f"only {ok!r} maps onto transformers' GLM ({why})", key not in d)
    for key in _SIZES:
        v = _get(d, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _bad(key, v, "expected a positive integer", key not in d)
    heads, groups, kv = d["num_attention_heads"], _get(d, "multi_query_group_num"), _get(d, "kv_channels")
    if heads % groups:
        raise _bad("multi_query_group_num", groups, f"num_attention_heads={heads} is not a multiple of it")
    if kv % 4:
        raise _bad("kv_channels", kv, "rotary turns kv_channels // 2 dimensions of each head in pairs, so that must "
                                      "be even (kv_channels a multiple of 4) for funcpar's GLM")
    ratio = _get(d, "rope_ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
        raise _bad("rope_ratio", ratio, "expected a positive number (rope_theta = 10000 * rope_ratio)")


def glm_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """The transformers GLM ``config.json`` a ChatGLM one maps onto (``convert_glm_weights_to_hf.py``'s mapping);
    a config whose layout does not map is refused with its key named."""
    _check(d)
    get = functools.partial(_get, d)
    g = dict(
        model_type="glm", architectures=["GlmForCausalLM"], vocab_size=d["padded_vocab_size"],
        hidden_size=d["hidden_size"], intermediate_size=d["ffn_hidden_size"], num_hidden_layers=d["num_layers"],
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=get("multi_query_group_num"),
        head_dim=get("kv_channels"), rms_norm_eps=float(get("layernorm_epsilon")),
        max_position_embeddings=get("seq_length"), attention_bias=get("add_qkv_bias"), tie_word_embeddings=False,
        rope_theta=10000.0 * get("rope_ratio"), partial_rotary_factor=0.5, hidden_act="silu", pad_token_id=None,
    )
    g |= {k: d[k] for k in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype") if d.get(k) is not None}
    return g


class Config(glm.Config):
    """A ChatGLM ``config.json`` read as the GLM config it maps onto: ``from_hf`` returns a
    :class:`funcpar.models.glm.Config` (this class only names the reading for the registry)."""

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> glm.Config:  # type: ignore[override]
        return glm.Config.from_hf(glm_config(d))


_LAYER_HF = {  # pytree key in a layer -> ChatGLM name under transformer.encoder.layers.{i}
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attention.query_key_value.weight", "wk": "self_attention.query_key_value.weight",
    "wv": "self_attention.query_key_value.weight", "bq": "self_attention.query_key_value.bias",
    "bk": "self_attention.query_key_value.bias", "bv": "self_attention.query_key_value.bias",
    "wo": "self_attention.dense.weight", "w_gate": "mlp.dense_h_to_4h.weight", "w_up": "mlp.dense_h_to_4h.weight",
    "w_down": "mlp.dense_4h_to_h.weight",
}
HF = fp.HFNames(
    [("embed", "transformer.embedding.word_embeddings.weight"), ("norm", "transformer.encoder.final_layernorm.weight"),
     ("lm_head", "transformer.output_layer.weight")]
    + [(f"layers.{{i}}.{k}", f"transformer.encoder.layers.{{i}}.{v}") for k, v in _LAYER_HF.items()],
    # query_key_value: heads * kv_channels q rows, then groups * kv_channels k rows, then as many v rows (the parts
    # as large as their leaves); dense_h_to_4h: gate rows, then up rows
    splits={**{f"layers.{{i}}.{w}{x}": (0, k, 3) for w in "wb" for k, x in enumerate("qkv")},
            "layers.{i}.w_gate": (0, 0, 2), "layers.{i}.w_up": (0, 1, 2)},
    vocab_padded=["embed", "lm_head"],  # rows beyond padded_vocab_size are funcpar's tp padding (not in files)
    ignored=[r"^transformer\.rotary_pos_emb\.inv_freq$"],  # ChatGLM's rotary buffer, recomputed
    export_as="glm",  # written as transformers' GLM folder
)

# the JSON types of the config.json keys from_hf reads, refused by name before it runs (funcpar.ModelSpec)
CONFIG_TYPES = {
    **dict.fromkeys(("padded_vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
                     "kv_channels", "multi_query_group_num", "seq_length", "quantization_bit"), (int,)),
    "pre_seq_len": (int, None), **dict.fromkeys(("layernorm_epsilon", "rope_ratio"), (float,)),
    **dict.fromkeys(("rmsnorm", "add_qkv_bias", "add_bias_linear", "multi_query_attention", "post_layer_norm",
                     "original_rope", "fp32_residual_connection", "tie_word_embeddings"), (bool,)),
    "model_type": (str,),
}

MODEL = fp.register_model(dataclasses.replace(glm.MODEL, name="chatglm", model_types=MODEL_TYPES, Config=Config,
                                               hf=HF, config_types=CONFIG_TYPES))
