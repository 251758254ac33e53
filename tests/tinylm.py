"""A model defined outside funcpar, registered the way docs/ARCHITECTURE.md ("Adding a model") says.

A tiny pre-norm MLP language model: embedding -> [RMSNorm -> column-parallel fc_in -> GELU -> row-parallel fc_out,
residual] x n -> RMSNorm -> vocab-parallel head. Its HF checkpoint names are its own ("tiny.*") and it stores
fc_out transposed, so the name table exercises transposes. Importing this module registers model_type "tinylm".
(Its HF form is what HF import and export need; a model without one needs no ModelSpec at all to train, on any mesh:
examples/custom_pipeline.py.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

import funcpar as fp
from funcpar import P
from funcpar.parallel import collectives as C
from funcpar.nn import layers as L


# step 1: a config with from_hf / to_hf / with_mesh (VocabPadding gives with_mesh)
@dataclasses.dataclass(frozen=True)
class Config(L.VocabPadding):
    vocab_size: int
    d_model: int
    d_hidden: int
    n_layers: int
    eps: float = 1e-6
    model_type: str = "tinylm"
    vocab_rows: int | None = None

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Config":
        return cls(d["vocab_size"], d["d_model"], d["d_hidden"], d["n_layers"], d.get("eps", 1e-6))

    def to_hf(self) -> dict[str, Any]:
        return {"model_type": "tinylm", "vocab_size": self.vocab_size, "d_model": self.d_model,
                "d_hidden": self.d_hidden, "n_layers": self.n_layers, "eps": self.eps}


# step 2: init (global shapes) and specs (one P per leaf)
def init(cfg: Config, seed: int = 0, dtype=torch.float32, device=None):
    g = torch.Generator().manual_seed(seed)
    meta = torch.device(device or "cpu").type == "meta"

    def w(*shape):
        return torch.empty(shape, dtype=dtype, device="meta") if meta else (torch.randn(shape, generator=g) * 0.1).to(dtype)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    layers = [{"norm": ones(cfg.d_model), "w_in": w(cfg.d_hidden, cfg.d_model), "w_out": w(cfg.d_model, cfg.d_hidden)}
              for _ in range(cfg.n_layers)]
    embed, head = w(cfg.rows, cfg.d_model), w(cfg.rows, cfg.d_model)
    if not meta:  # vocab padding rows (tp does not divide vocab_size) are zeros no token uses
        embed[cfg.vocab_size:], head[cfg.vocab_size:] = 0, 0
    return {"embed": embed, "layers": layers, "norm": ones(cfg.d_model), "head": head}


def specs(cfg: Config, mesh=None):
    cfg.check_mesh(mesh)
    layer = {"norm": P(), "w_in": P("tp", None), "w_out": P(None, "tp")}
    return {"embed": P("tp", None), "layers": [dict(layer) for _ in range(cfg.n_layers)], "norm": P(),
            "head": P("tp", None)}


# step 3: the per-shard model, with the conjugate collectives where Megatron puts them
def _norm(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _block(lp, x, i, cfg: Config, mesh):
    h = C.copy_to_region(_norm(x, lp["norm"], cfg.eps), mesh, "tp")
    h = F.gelu(F.linear(h, lp["w_in"]))  # (B, T, d) -> (B, T, h/tp)
    return x + C.reduce_from_region(F.linear(h, lp["w_out"]), mesh, "tp")  # (B, T, h/tp) -> (B, T, d)


def _embed(params, batch, cfg: Config, mesh):
    return L.vocab_embedding(params["embed"], batch["input_ids"], mesh, "tp")  # (B, T, d)


def _logits(params, x, cfg: Config, mesh):
    x = C.copy_to_region(_norm(x, params["norm"], cfg.eps), mesh, "tp")
    return F.linear(x, params["head"])  # (B, T, d) -> (B, T, V/tp)


def _head(params, x, batch, cfg: Config, mesh, reduction="mean"):
    labels = batch.get("labels", batch["input_ids"])
    return L.causal_lm_loss(_logits(params, x, cfg, mesh), labels, mesh, "tp", batch.get("loss_mask"), reduction,
                            cfg.vocab_size)


# step 4: the staged form (what ZeRO-3 and pipeline stages cut), and loss and forward composed from it
STAGES = fp.Stages(_embed, _block, _head, embed_leaves=lambda cfg: ["embed"], head_leaves=lambda cfg: ["norm", "head"])


def loss(params, batch, cfg: Config, mesh, reduction="mean"):
    return STAGES.loss(params, batch, cfg, mesh, reduction)


def forward(params, tokens, cfg: Config, mesh):
    x = STAGES.hidden(params, {"input_ids": tokens}, cfg, mesh)
    return L.unpad_logits(_logits(params, x, cfg, mesh), mesh, "tp", cfg.vocab_size)


# step 5 (optional: a model without it trains alike, only HF import and export refuse it): the HF name table
HF = fp.HFNames(
    [("embed", "tiny.embed.weight"), ("norm", "tiny.norm.weight"), ("head", "tiny.head.weight"),
     ("layers.{i}.norm", "tiny.h.{i}.norm.weight"), ("layers.{i}.w_in", "tiny.h.{i}.fc_in.weight"),
     ("layers.{i}.w_out", "tiny.h.{i}.fc_out.weight")],
    transposed=["layers.{i}.w_out"],
    vocab_padded=["embed", "head"],
)

# step 6: one ModelSpec, registered (config_types: the JSON types of the config.json keys from_hf reads)
MODEL = fp.register_model(fp.ModelSpec(
    name="tinylm", model_types=("tinylm",), Config=Config, init=init, specs=specs, forward=forward, loss=loss,
    hf=HF, batch_weight=L.count_targets, stages=STAGES,
    config_types={**dict.fromkeys(("vocab_size", "d_model", "d_hidden", "n_layers"), (int,)), "eps": (float,)},
))
