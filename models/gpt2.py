"""GPT-2 as transformers defines it: learned positions, LayerNorm with bias, gelu (tanh), tied embeddings.

Its checkpoint differs in kind from Llama's: Conv1D weights are stored ``(in, out)`` (this model keeps
``(out, in)``, so the table lists them as transposes) and q/k/v are one fused ``c_attn`` tensor, split here into
three leaves so that tp can shard each by heads (the table lists the splits). Per-shard code as in llama.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import einops
import torch
import torch.nn.functional as F

import funcpar as fp
from funcpar import P
from funcpar import decoder as D
from funcpar import layers as L

MODEL_TYPES = ("gpt2",)


@dataclasses.dataclass(frozen=True)
class Config(L.VocabPadding):
    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_positions: int = 1024
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    tie_word_embeddings: bool = True
    model_type: str = "gpt2"
    vocab_rows: int | None = None  # rows of wte when padded for tp (see with_mesh); None = vocab_size
    hf: dict = dataclasses.field(default_factory=dict, hash=False, compare=False, repr=False)

    def __post_init__(self):
        """Validated however it was built."""
        L.check_sizes(self, "vocab_size", "n_embd", "n_layer", "n_head", "n_positions")
        if self.n_inner is not None:
            L.check_sizes(self, "n_inner")
        if self.n_embd % self.n_head:
            raise ValueError(f"gpt2.Config: n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"gpt2.Config: layer_norm_epsilon={self.layer_norm_epsilon} must be positive")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner(self) -> int:
        """The MLP's width: ``n_inner``, or 4 * n_embd where config.json leaves it null."""
        return self.n_inner or 4 * self.n_embd

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Config":
        D.check_model_type(d, "gpt2")
        act = d.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"activation_function '{act}' is not supported (gelu_new, gelu_pytorch_tanh, gelu)")
        for flag in ("scale_attn_by_inverse_layer_idx",):
            if d.get(flag):
                raise ValueError(f"GPT-2 option {flag}=True is not supported")
        if d.get("tie_word_embeddings", True) is False:
            raise ValueError("GPT-2 with an untied lm_head is not supported")
        return cls(
            vocab_size=d["vocab_size"],
            n_embd=d["n_embd"],
            n_layer=d["n_layer"],
            n_head=d["n_head"],
            n_positions=d.get("n_positions", 1024),
            n_inner=d.get("n_inner"),
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
            activation_function=act,
            hf=dict(d),
        )

    def to_hf(self) -> dict[str, Any]:
        d = dict(self.hf)
        d.update(
            model_type="gpt2",
            architectures=d.get("architectures") or ["GPT2LMHeadModel"],
            vocab_size=self.vocab_size, n_embd=self.n_embd, n_layer=self.n_layer, n_head=self.n_head,
            n_positions=self.n_positions, n_inner=self.n_inner, layer_norm_epsilon=self.layer_norm_epsilon,
            activation_function=self.activation_function, tie_word_embeddings=True,
        )
        return d


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    w, ones, zeros = D.normal_init(seed, dtype, device)
    d, inner = cfg.n_embd, cfg.inner

    layers = [
        {
            "ln1_w": ones(d), "ln1_b": zeros(d),
            "wq": w(d, d), "wk": w(d, d), "wv": w(d, d), "bq": zeros(d), "bk": zeros(d), "bv": zeros(d),
            "wo": w(d, d), "bo": zeros(d),
            "ln2_w": ones(d), "ln2_b": zeros(d),
            "w_fc": w(inner, d), "b_fc": zeros(inner), "w_proj": w(d, inner), "b_proj": zeros(d),
        }
        for _ in range(cfg.n_layer)
    ]
    wte = D.vocab_table(w(cfg.rows, d), cfg)
    return {"wte": wte, "wpe": w(cfg.n_positions, d), "layers": layers,
            "ln_f_w": ones(d), "ln_f_b": zeros(d)}


def specs(cfg: Config, mesh=None):
    cfg.check_mesh(mesh)
    layer = {
        "ln1_w": P(), "ln1_b": P(), "ln2_w": P(), "ln2_b": P(),
        "wq": P("tp", None), "wk": P("tp", None), "wv": P("tp", None),
        "bq": P("tp"), "bk": P("tp"), "bv": P("tp"),
        "wo": P(None, "tp"), "bo": P(),
        "w_fc": P("tp", None), "b_fc": P("tp"), "w_proj": P(None, "tp"), "b_proj": P(),
    }
    return {"wte": P("tp", None), "wpe": P(), "layers": [dict(layer) for _ in range(cfg.n_layer)],
            "ln_f_w": P(), "ln_f_b": P()}


HF_NAMES = [
    ("wte", "transformer.wte.weight"),
    ("wpe", "transformer.wpe.weight"),
    ("ln_f_w", "transformer.ln_f.weight"),
    ("ln_f_b", "transformer.ln_f.bias"),
    ("layers.{i}.ln1_w", "transformer.h.{i}.ln_1.weight"),
    ("layers.{i}.ln1_b", "transformer.h.{i}.ln_1.bias"),
    ("layers.{i}.wq", "transformer.h.{i}.attn.c_attn.weight"),
    ("layers.{i}.wk", "transformer.h.{i}.attn.c_attn.weight"),
    ("layers.{i}.wv", "transformer.h.{i}.attn.c_attn.weight"),
    ("layers.{i}.bq", "transformer.h.{i}.attn.c_attn.bias"),
    ("layers.{i}.bk", "transformer.h.{i}.attn.c_attn.bias"),
    ("layers.{i}.bv", "transformer.h.{i}.attn.c_attn.bias"),
    ("layers.{i}.wo", "transformer.h.{i}.attn.c_proj.weight"),
    ("layers.{i}.bo", "transformer.h.{i}.attn.c_proj.bias"),
    ("layers.{i}.ln2_w", "transformer.h.{i}.ln_2.weight"),
    ("layers.{i}.ln2_b", "transformer.h.{i}.ln_2.bias"),
    ("layers.{i}.w_fc", "transformer.h.{i}.mlp.c_fc.weight"),
    ("layers.{i}.b_fc", "transformer.h.{i}.mlp.c_fc.bias"),
    ("layers.{i}.w_proj", "transformer.h.{i}.mlp.c_proj.weight"),
    ("layers.{i}.b_proj", "transformer.h.{i}.mlp.c_proj.bias"),
]
HF = fp.HFNames(
    HF_NAMES,
    vocab_padded=["wte"],  # rows beyond the real vocabulary are padding (absent from checkpoints)
    # Conv1D stores (in, out); these leaves are (out, in)
    transposed=["layers.{i}.wq", "layers.{i}.wk", "layers.{i}.wv", "layers.{i}.wo", "layers.{i}.w_fc",
                "layers.{i}.w_proj"],
    # leaf = part k of n of the fused HF tensor along HF dimension `dim`: (dim, k, n)
    splits={
        "layers.{i}.wq": (1, 0, 3), "layers.{i}.wk": (1, 1, 3), "layers.{i}.wv": (1, 2, 3),
        "layers.{i}.bq": (0, 0, 3), "layers.{i}.bk": (0, 1, 3), "layers.{i}.bv": (0, 2, 3),
    },
    # causal-mask buffers older GPT-2 checkpoints carry, and a copy of the tied head
    ignored=[r".*\.attn\.bias$", r".*\.attn\.masked_bias$", r"^lm_head\.weight$"],
)


def _norm(x, w, b, cfg: Config, mesh):
    """A layer norm, its weight and bias shared over tp under sequence parallelism (each rank holds a block of
    the sequence, so their gradients are summed)."""
    return F.layer_norm(x, (cfg.n_embd,), L.sequence_shared(w, mesh), L.sequence_shared(b, mesh),
                        cfg.layer_norm_epsilon)


def _gelu(x, cfg: Config):
    return F.gelu(x) if cfg.activation_function == "gelu" else F.gelu(x, approximate="tanh")


def _attention_half(p, x, i: int | None, cfg: Config, mesh):
    """Attention and its residual (a pipeline's first half of a layer)."""
    hd = cfg.head_dim
    h = _norm(x, p["ln1_w"], p["ln1_b"], cfg, mesh)
    # (B, T, d) -> (B, T, H/tp*hd) each; h's gradient summed over tp
    q, k, v = L.column_parallel(h, [p["wq"], p["wk"], p["wv"]], mesh, "tp", [p["bq"], p["bk"], p["bv"]])
    q, k, v = (einops.rearrange(t, "b t (h d) -> b h t d", d=hd) for t in (q, k, v))  # (B, H/tp, T, hd)
    o = D.causal(q, k, v, mesh)  # (B, H/tp, T, hd)
    o = einops.rearrange(o, "b h t d -> b t (h d)")  # (B, T, H/tp*hd)
    # (B, T, H/tp*hd) -> (B, T, d), or (B, T/tp, d) under sequence parallelism
    return x + L.row_parallel_sum_(F.linear(o, p["wo"]), mesh) + L.sequence_shared(p["bo"], mesh)


ATTENTION_LEAVES = ("ln1_w", "ln1_b", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo")  # the rest: the MLP's


def _mlp_half(p, x, i: int | None, cfg: Config, mesh):
    """The MLP and its residual (a pipeline's second half of a layer)."""
    h = _norm(x, p["ln2_w"], p["ln2_b"], cfg, mesh)
    h = _gelu(L.column_parallel(h, [p["w_fc"]], mesh, "tp", [p["b_fc"]])[0], cfg)  # (B, T, d) -> (B, T, I/tp)
    # (B, T, I/tp) -> (B, T, d), or (B, T/tp, d) under sequence parallelism
    return x + L.row_parallel_sum_(F.linear(h, p["w_proj"]), mesh) + L.sequence_shared(p["b_proj"], mesh)


def _embed(params, batch: dict, cfg: Config, mesh) -> torch.Tensor:
    T = batch["input_ids"].shape[1]
    if T > cfg.n_positions:
        raise ValueError(f"sequence length {T} exceeds GPT-2's n_positions={cfg.n_positions}")
    docs = mesh.documents  # packed samples: each token at its own position in its sample
    wpe = params["wpe"][:T] if docs is None else F.embedding(docs.positions, params["wpe"])  # (T, d) or (B, T, d)
    pos = L.sequence_block(wpe, mesh, wpe.dim() - 2)  # this rank's (.., T/tp, d) under sequence parallelism
    return L.vocab_embedding(params["wte"], batch["input_ids"], mesh, "tp") + pos  # (B, T, d)


def _block(lp, x, i: int, cfg: Config, mesh) -> torch.Tensor:
    return _mlp_half(lp, _attention_half(lp, x, i, cfg, mesh), i, cfg, mesh)


def _head_logits(params, x: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    x = _norm(x, params["ln_f_w"], params["ln_f_b"], cfg, mesh)
    return L.column_parallel(x, [params["wte"]], mesh)[0]  # (B, T, d) @ (d, V/tp) -> (B, T, V/tp)


def _head(params, x: torch.Tensor, batch: dict, cfg: Config, mesh, reduction: str = "mean") -> torch.Tensor:
    return D.head_loss(_norm(x, params["ln_f_w"], params["ln_f_b"], cfg, mesh), params["wte"], batch, cfg, mesh,
                       reduction)


STAGES = fp.Stages(_embed, _block, _head, embed_leaves=lambda cfg: ["wte", "wpe"],
                   head_leaves=lambda cfg: ["ln_f_w", "ln_f_b", "wte"],
                   halves=(_attention_half, _mlp_half), first_leaves=lambda cfg: ATTENTION_LEAVES)


def forward(params, tokens: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    """This rank's logits (B, T, V/tp), vocab-sharded over tp, padded vocabulary columns dropped."""
    x = STAGES.hidden(params, {"input_ids": tokens}, cfg, mesh)  # (B, T, d)
    return L.unpad_logits(_head_logits(params, x, cfg, mesh), mesh, "tp", cfg.vocab_size)


def loss(params, batch: dict, cfg: Config, mesh, reduction: str = "mean") -> torch.Tensor:
    """transformers' ``labels=`` loss (shifted cross-entropy, ``-100`` ignored, ``loss_mask`` optional), computed
    vocab-parallel."""
    return STAGES.loss(params, batch, cfg, mesh, reduction)


# the JSON types of the config.json keys from_hf reads, refused by name before it runs (funcpar.ModelSpec)
CONFIG_TYPES = {**dict.fromkeys(("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"), (int,)),
                "n_inner": (int, None), "layer_norm_epsilon": (float,),
                **dict.fromkeys(("scale_attn_by_inverse_layer_idx", "tie_word_embeddings"), (bool,)),
                **dict.fromkeys(("model_type", "activation_function"), (str,))}

MODEL = fp.register_model(fp.ModelSpec(
    name="gpt2", model_types=MODEL_TYPES, Config=Config, init=init, specs=specs, forward=forward, loss=loss,
    hf=HF, batch_weight=L.count_targets, check_batch=L.token_range_errors, remat=False, stages=STAGES,
    sequence_parallel=True, documents=True,
    config_types=CONFIG_TYPES,
))
