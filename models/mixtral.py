"""Mixtral, the sparse mixture of experts, as transformers defines it, with expert parallelism on the ``ep`` axis.

Attention and norms are Llama's (GQA, rope, RMSNorm, an optional sliding window). Each layer's MLP is a sparse MoE
block: a router (a linear map to ``num_local_experts`` logits, softmax, the top ``num_experts_per_tok``
probabilities renormalised to sum to one) and SwiGLU experts; a token's output is the weighted sum of its experts'.
The loss is transformers' ``outputs.loss`` with ``output_router_logits``: the causal-LM loss plus
``router_aux_loss_coef`` times the load-balancing loss (added when ``cfg.output_router_logits``, as transformers does;
``loss(..., aux=True/False)`` overrides).

Parallelism (per-shard code, docs/ARCHITECTURE.md). tp: Megatron's plan for attention, the vocab-parallel embedding,
head and loss; inside every expert, w_gate/w_up column-parallel and w_down row-parallel. ep: the experts' weights are
stacked ``(E, ...)`` leaves split over ``ep`` on the expert dimension (``P("ep", "tp", None)``), so a rank holds
E/ep whole experts and checkpoints and ``fp.gather`` see ordinary sharded leaves; the router and everything else
is replicated. ep is a *data* axis: every ep rank holds its own rows of the batch (``compile_step(...,
data_axes=("dp", "ep"))``). In each layer a rank routes its tokens, lays each expert's tokens out in a block of a
capacity the ep group agrees on, exchanges the blocks with ``all_to_all`` so each reaches the rank holding its
expert, runs its experts on what it received and sends the results back the same way.

Dropless, as transformers' Mixtral (each expert takes every token routed to it). The capacity is the largest number of
tokens any rank of the ep group routes to any one expert in this layer and batch (an all-reduce max), so every
assignment has a slot and none is dropped; the slots a block does not use are zero rows whose results are never
read (compute spent on padding when the load is uneven; even blocks make the exchange one ``all_to_all`` that is its
own conjugate).

The load-balancing loss is transformers' ``load_balancing_loss_func`` without attention mask (funcpar batches have
none: every token counts): ``E * sum_e f_e * p_e``, ``f_e`` the share of top-k assignments to expert e and ``p_e``
its mean router probability, both over every token of every layer of the whole batch. Sharded, ``f`` comes from
counts all-reduced over the data axes (no gradient) and ``p`` from a sum over them whose backward all-reduces the
gradient too (:func:`_data_sum`), so each data rank's loss carries the global load-balancing loss and each rank's
router the whole gradient of it (the step weighs each rank's loss by its share of the targets, and the shares sum
to one). Under ``accum_steps > 1`` it is computed per micro-batch (over every data rank's share of it).

Not supported: pipeline stages and ``zero=3`` (no staged form: the router statistics of every layer would have to
ride along the stage carry), ``remat``, ``funcpar plan`` (the capacity depends on the routing, which meta tensors
do not have), rope scaling, router jitter. Checkpoints are read and written with one tensor per expert, as on the
Hub and as ``save_pretrained`` writes them by default; the fused layout transformers 5 holds in memory is read too
(see ``HF``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import einops
import torch
import torch.nn.functional as F

import funcpar as fp
from funcpar import P
from funcpar import collectives as C
from funcpar import decoder as D
from funcpar import layers as L

DATA_AXES = ("dp", "ep")  # the axes the batch is split over (the load-balancing statistics are summed over them)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(D.RotaryConfig):
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6  # (transformers' MixtralConfig default)
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = None
    model_type: str = "mixtral"

    def __post_init__(self):
        L.check_sizes(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
                      "num_experts_per_tok", "max_position_embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"mixtral.Config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"mixtral.Config: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_local_experts={self.num_local_experts}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"mixtral.Config: sliding_window={w!r}, expected a positive int or None")
        L.check_pad_token_id(self)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Config":
        if d.get("model_type", "mixtral") != "mixtral":
            raise ValueError(f"model_type '{d.get('model_type')}' is not 'mixtral'")
        for key, want in (("hidden_act", "silu"), ("router_jitter_noise", 0)):
            if d.get(key, want) != want:
                raise ValueError(f"config key '{key}' is {d[key]!r}: funcpar's mixtral supports only {want!r}")
        rp = d.get("rope_parameters") or {}
        kind = rp.get("rope_type", (d.get("rope_scaling") or {}).get("rope_type", "default"))
        if kind != "default":
            raise ValueError(f"rope type '{kind}' is not supported by funcpar's mixtral (only 'default')")
        heads = d["num_attention_heads"]
        return cls(
            **cls.sizes_of(d),
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            num_local_experts=d.get("num_local_experts", 8), num_experts_per_tok=d.get("num_experts_per_tok", 2),
            router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
            output_router_logits=bool(d.get("output_router_logits", False)),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5), rope_theta=float(rp.get("rope_theta", d.get("rope_theta", 1e6))),
            max_position_embeddings=d.get("max_position_embeddings", 4096 * 32),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), sliding_window=d.get("sliding_window"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict: the original one where this config came from a folder, with our fields set."""
        d = dict(self.hf)
        d.update(
            model_type="mixtral", architectures=d.get("architectures") or ["MixtralForCausalLM"], **self.hf_sizes(),
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            num_local_experts=self.num_local_experts, num_experts_per_tok=self.num_experts_per_tok,
            router_aux_loss_coef=self.router_aux_loss_coef, output_router_logits=self.output_router_logits,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, sliding_window=self.sliding_window, hidden_act="silu",
            pad_token_id=self.pad_token_id,
        )
        if "rope_theta" in self.hf and "rope_parameters" not in self.hf:  # transformers 4 style
            d["rope_theta"] = self.rope_theta
        else:
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        return d


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """Global parameters, N(0, 0.02) weights and unit norms as transformers initialises them. ``device="meta"``
    gives shapes only. Expert weights are stacked: ``w_gate``/``w_up`` (E, I, d), ``w_down`` (E, d, I)."""
    w, ones, _ = D.normal_init(seed, dtype, device)
    d, hd, inter, E = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_local_experts
    layers = [{
        "attn_norm": ones(d), "wq": w(cfg.num_attention_heads * hd, d), "wk": w(cfg.num_key_value_heads * hd, d),
        "wv": w(cfg.num_key_value_heads * hd, d), "wo": w(d, cfg.num_attention_heads * hd), "mlp_norm": ones(d),
        "router": w(E, d), "w_gate": w(E, inter, d), "w_up": w(E, inter, d), "w_down": w(E, d, inter),
    } for _ in range(cfg.num_hidden_layers)]
    return D.tables(w, ones, cfg, layers)


def _size(mesh, axis: str) -> int:
    """The size of ``axis`` on ``mesh``; 1 where the mesh has no such axis (``ep`` is named only where used)."""
    return mesh.axis_size(axis) if mesh is not None and axis in mesh.axis_names else 1


def specs(cfg: Config, mesh=None):
    """Megatron's plan for attention, embedding and head; experts split over ``ep`` (expert dimension) and, inside
    each, over tp (w_gate/w_up column-, w_down row-parallel); the router replicated. Refuses, by config key and
    axis, sizes the mesh does not divide."""
    cfg.check_mesh(mesh)
    ep, tp = _size(mesh, "ep"), _size(mesh, "tp")
    for key, axis, n in (("num_local_experts", "ep", ep), ("intermediate_size", "tp", tp),
                         ("num_attention_heads", "tp", tp), ("num_key_value_heads", "tp", tp)):
        if getattr(cfg, key) % n:
            raise ValueError(f"mixtral: {key}={getattr(cfg, key)} is not divisible by mesh axis '{axis}' of size {n}")
    e = "ep" if mesh is not None and "ep" in mesh.axis_names else None  # P names only the mesh's axes
    layer = {"attn_norm": P(), "mlp_norm": P(), "wq": P("tp", None), "wk": P("tp", None), "wv": P("tp", None),
             "wo": P(None, "tp"), "router": P(), "w_gate": P(e, "tp", None), "w_up": P(e, "tp", None),
             "w_down": P(e, None, "tp")}
    out = {"embed": P("tp", None), "layers": [dict(layer) for _ in range(cfg.num_hidden_layers)], "norm": P()}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = P("tp", None)
    return out


# transformers name <-> pytree path, in the two layouts transformers 5 knows. Written (and read): the original one,
# which save_pretrained writes by default and every Mixtral on the Hub has: one tensor per expert,
# block_sparse_moe.experts.{j}.w1 (gate, (I, d)), w3 (up, (I, d)), w2 (down, (d, I)), stacked by funcpar into its
# (E, ...) leaves ({j}: an ep rank reads only its own experts' tensors), and the router block_sparse_moe.gate. Read
# too: the experts fused as transformers 5 holds them in memory (save_pretrained(..., save_original_format=False)):
# mlp.experts.gate_up_proj (E, 2I, d), gate rows first, mlp.experts.down_proj (E, d, I) and the router mlp.gate.
_ATTENTION_HF = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
}
_PER_EXPERT_HF = {
    "router": "block_sparse_moe.gate.weight", "w_gate": "block_sparse_moe.experts.{j}.w1.weight",
    "w_up": "block_sparse_moe.experts.{j}.w3.weight", "w_down": "block_sparse_moe.experts.{j}.w2.weight",
}
_FUSED_HF = {
    "router": "mlp.gate.weight", "w_gate": "mlp.experts.gate_up_proj", "w_up": "mlp.experts.gate_up_proj",
    "w_down": "mlp.experts.down_proj",
}


def _hf_names(experts: dict[str, str], **kw) -> fp.HFNames:
    return fp.HFNames(
        [("embed", "model.embed_tokens.weight"), ("norm", "model.norm.weight"), ("lm_head", "lm_head.weight")]
        + [(f"layers.{{i}}.{k}", f"model.layers.{{i}}.{v}") for k, v in {**_ATTENTION_HF, **experts}.items()],
        vocab_padded=["embed", "lm_head"], ignored=[r".*\.rotary_emb\.inv_freq$"],
        ignored_if_tied=[r"^lm_head\.weight$"], **kw,
    )


HF = _hf_names(_PER_EXPERT_HF, alternates=[
    _hf_names(_FUSED_HF, splits={"layers.{i}.w_gate": (1, 0, 2), "layers.{i}.w_up": (1, 1, 2)}),
])


# ------------------------------------------------------------------------------------------------- the model


def _rope_cos_sin(cfg: Config, T: int, device, dtype):
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))  # (hd/2,)
    freqs = torch.arange(T, device=device).float()[:, None] * inv.to(device)[None, :]  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)



def _attention(p, x, cos, sin, cfg: Config, mesh):
    hd = cfg.head_dim
    q, k, v = (einops.rearrange(t, "b t (h d) -> b h t d", d=hd)  # (B, T, d) -> (B, H/tp, T, hd)
               for t in L.column_parallel(x, [p["wq"], p["wk"], p["wv"]], mesh))
    q = L.rotary(q, cos, sin)  # (B, Hq/tp, T, hd)
    k = L.rotary(k, cos, sin)  # (B, Hkv/tp, T, hd)
    return D.attend(q, k, v, p["wo"], mesh, cfg.sliding_window)  # (B, T, d)


def _route(p, h: torch.Tensor, cfg: Config):
    """The router on tokens ``h`` (N, d): top-k expert ids (N, k), their renormalised weights (N, k, float32), and
    the load-balancing statistics: top-k assignments per expert (E,) and the sum of router probabilities (E,),
    computed as transformers' loss computes them (a softmax in the logits' dtype)."""
    logits = F.linear(h, p["router"])  # (N, d) -> (N, E)
    top, ids = torch.topk(F.softmax(logits.float(), dim=-1), cfg.num_experts_per_tok, dim=-1)  # (N, k)
    probs = F.softmax(logits, dim=-1)  # (N, E)
    chosen = torch.topk(probs, cfg.num_experts_per_tok, dim=-1).indices  # (N, k)
    counts = torch.bincount(chosen.reshape(-1), minlength=cfg.num_local_experts).float()  # (E,)
    return ids, top / top.sum(-1, keepdim=True), counts, probs.float().sum(0)


def _experts(p, x: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's experts on their tokens ``x`` (E/ep, R, d), tp inside each: gate/up column-, down row-parallel."""
    x = C.copy_to_region(x, mesh, "tp")
    g = torch.bmm(x, p["w_gate"].transpose(1, 2))  # (E/ep, R, d) @ (E/ep, d, I/tp) -> (E/ep, R, I/tp)
    u = torch.bmm(x, p["w_up"].transpose(1, 2))  # (E/ep, R, d) @ (E/ep, d, I/tp) -> (E/ep, R, I/tp)
    y = torch.bmm(L.swiglu(g, u), p["w_down"].transpose(1, 2))  # (E/ep, R, I/tp) @ (E/ep, I/tp, d) -> (E/ep, R, d)
    return C.reduce_from_region_(y, mesh, "tp")  # summed over tp, in place (y: a fresh temporary)


def _exchange(x: torch.Tensor, mesh, ep: int) -> torch.Tensor:
    """``all_to_all`` over ep of (ep, ...) blocks: block j to ep rank j (nothing to do without an ep axis)."""
    return C.all_to_all(x, mesh, "ep", 0) if ep > 1 else x


# what a plan (meta tensors, no values) takes for an expert's capacity: the tokens' even share (a router's busiest
# expert takes more, up to every token)
CAPACITY = "each expert's capacity taken as its even share of the tokens (N x top-k / experts; the busiest takes more)"


def _moe(p, x: torch.Tensor, cfg: Config, mesh):
    """The sparse MoE block on this rank's tokens ``x`` (B, T, d), experts over ep (see the module docstring);
    returns the output (B, T, d) and the load-balancing statistics of :func:`_route`. Under sequence parallelism
    ``x`` is this tp rank's block (B, T/tp, d): the blocks are gathered (each rank then routes every token, as
    without it; its input gradient is already whole on every rank, so the backward keeps this rank's block) and
    the output split back (the MoE's activations are not divided: the norms and residuals around it are)."""
    if L.sequence_parallel(mesh):  # x: this tp rank's block of the sequence; router and experts see every block
        out, counts, prob_sum = _moe(p, C.gather_from_region(x, mesh, "tp", 1), cfg, mesh.with_sequence_parallel(False))
        return C.scatter_to_region(out, mesh, "tp", 1), counts, prob_sum  # (B, T/tp, d): this rank's block again
    B, T, d = x.shape
    E, k, ep = cfg.num_local_experts, cfg.num_experts_per_tok, _size(mesh, "ep")
    h = x.reshape(B * T, d)  # (N, d)
    ids, weights, counts, prob_sum = _route(p, h, cfg)
    flat = ids.reshape(-1)  # (N*k,): assignment a is token a // k's (a % k)-th choice
    onehot = F.one_hot(flat, E)  # (N*k, E)
    pos = (onehot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)  # (N*k,): its place among its expert's
    cap = L.data_size(onehot.sum(0).max(), -(-B * T * k // E), CAPACITY)
    if ep > 1:  # one capacity for the ep group: the exchanged blocks are even
        cap = L.data_size(C.all_reduce(torch.tensor(cap, device=x.device), mesh, "ep", "max"), cap, CAPACITY)
    slot = flat * cap + pos  # (N*k,): row of the (E * cap, d) dispatch buffer
    buf = h.new_zeros(E * cap, d).index_copy(0, slot, h.repeat_interleave(k, dim=0))  # (E*cap, d)
    recv = _exchange(buf.view(ep, E // ep * cap, d), mesh, ep)  # (ep source ranks, E/ep*cap, d)
    xe = einops.rearrange(recv, "s (e c) d -> e (s c) d", c=cap)  # (E/ep, ep*cap, d): each local expert's tokens
    ye = einops.rearrange(_experts(p, xe, mesh), "e (s c) d -> s (e c) d", c=cap)  # (ep, E/ep*cap, d)
    y = _exchange(ye, mesh, ep).reshape(E * cap, d)[slot].view(B * T, k, d)  # (N, k, d): each choice's output
    out = (y * weights[..., None]).sum(1).to(x.dtype)  # (N, k, d) x (N, k, 1) -> (N, d)
    return out.view(B, T, d), counts, prob_sum


def _layer(lp, x, cos, sin, cfg: Config, mesh):
    x = D.attention_residual(lp, x, lambda h: _attention(lp, h, cos, sin, cfg, mesh), cfg.rms_norm_eps, mesh)
    y, counts, prob_sum = _moe(lp, L.rms_norm(x, L.sequence_shared(lp["mlp_norm"], mesh), cfg.rms_norm_eps), cfg, mesh)
    return x + y, counts, prob_sum


def _trunk(params, tokens: torch.Tensor, cfg: Config, mesh):
    """The last layer's output (B, T, d), replicated over tp, and the load-balancing statistics summed over the
    layers (assignments per expert, router probability per expert)."""
    x = D.embed(params, {"input_ids": tokens}, cfg, mesh)  # (B, T) -> (B, T, d)
    cos, sin = (L.position_rows(t, mesh) for t in _rope_cos_sin(cfg, tokens.shape[1], x.device, x.dtype))  # (T, hd)
    counts = prob_sum = 0
    for lp in params["layers"]:
        x, c, s = _layer(lp, x, cos, sin, cfg, mesh)
        counts, prob_sum = counts + c, prob_sum + s
    return x, counts, prob_sum


def _data_sum(x: torch.Tensor, mesh) -> torch.Tensor:
    """The sum of ``x`` over the data axes, on every data rank; backward, the sum of every data rank's gradient.
    For a term that each data rank's loss carries whole (reduce_from_region, then copy_to_region)."""
    axes = [a for a in DATA_AXES if _size(mesh, a) > 1]
    for a in axes:
        x = C.reduce_from_region(x, mesh, a)
    for a in reversed(axes):
        x = C.copy_to_region(x, mesh, a)
    return x


def _balance_loss(counts: torch.Tensor, prob_sum: torch.Tensor, rows: int, cfg: Config, mesh) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over every data rank's ``rows`` (tokens x layers)."""
    axes = [a for a in DATA_AXES if _size(mesh, a) > 1]
    stats = torch.cat([counts, counts.new_tensor([float(rows)])])  # (E + 1,)
    stats = C.all_reduce(stats, mesh, axes) if axes else stats  # statistics: no gradient
    total = stats[-1]
    return (stats[:-1] / total * (_data_sum(prob_sum, mesh) / total)).sum() * cfg.num_local_experts


def forward(params, tokens: torch.Tensor, cfg: Config, mesh) -> torch.Tensor:
    """This rank's logits (B, T, V/tp) for its rows ``tokens``: vocab-sharded over tp (full logits at tp=1)."""
    x, _, _ = _trunk(params, tokens, cfg, mesh)
    return L.unpad_logits(D.rms_head_logits(params, x, cfg, mesh), mesh, "tp", cfg.vocab_size)


def loss(params, batch: dict, cfg: Config, mesh, reduction: str = "mean", aux: bool | None = None) -> torch.Tensor:
    """transformers' ``labels=`` loss (mean over counted targets of the shifted cross-entropy, ``-100`` ignored,
    ``batch["loss_mask"]`` optional), plus ``router_aux_loss_coef`` times the load-balancing loss of the global
    batch when ``aux`` (default ``cfg.output_router_logits``, as transformers decides). Under ``reduction="sum"``
    the load-balancing term is added as it is."""
    tokens, mesh = batch["input_ids"], D.documents_of(mesh, batch)
    x, counts, prob_sum = _trunk(params, tokens, cfg, mesh)
    ce = D.rms_head_loss(params, x, batch, cfg, mesh, reduction)
    if not (cfg.output_router_logits if aux is None else aux):
        return ce
    rows = tokens.numel() * cfg.num_hidden_layers
    return ce + cfg.router_aux_loss_coef * _balance_loss(counts, prob_sum, rows, cfg, mesh)


# ------------------------------------------------------------------------------------------ the staged form
# Pipeline stages and ZeRO-3 run the model as embed -> layer ... -> head, a tensor carried between them. The
# load-balancing loss sums router statistics over every layer, which that carry does not hold: with
# output_router_logits the staged form refuses to start (zero 0-2 without pipeline stages run `loss`, which has it).


def _staged_embed(params, batch: dict, cfg: Config, mesh) -> torch.Tensor:
    if cfg.output_router_logits:
        raise ValueError("mixtral: pipeline stages and zero=3 run the model layer by layer, and the load-balancing "
                         "loss (output_router_logits=True) sums router statistics over every layer, which is not "
                         "carried between them: set output_router_logits=False in config.json to train without it, "
                         "or train at zero 0-2 without pipeline stages")
    return D.embed(params, batch, cfg, mesh)


def _attention_half(lp, x: torch.Tensor, i: int, cfg: Config, mesh) -> torch.Tensor:
    cos, sin = (L.position_rows(t, mesh) for t in _rope_cos_sin(cfg, L.sequence_length(x, mesh), x.device, x.dtype))
    return D.attention_residual(lp, x, lambda h: _attention(lp, h, cos, sin, cfg, mesh), cfg.rms_norm_eps, mesh)


def _moe_half(lp, x: torch.Tensor, i: int, cfg: Config, mesh) -> torch.Tensor:
    return x + _moe(lp, L.rms_norm(x, L.sequence_shared(lp["mlp_norm"], mesh), cfg.rms_norm_eps), cfg, mesh)[0]


def _staged_block(lp, x: torch.Tensor, i: int, cfg: Config, mesh) -> torch.Tensor:
    return _moe_half(lp, _attention_half(lp, x, i, cfg, mesh), i, cfg, mesh)


def _staged_head(params, x: torch.Tensor, batch: dict, cfg: Config, mesh, reduction: str = "mean") -> torch.Tensor:
    return D.rms_head_loss(params, x, batch, cfg, mesh, reduction)


STAGES = fp.Stages(_staged_embed, _staged_block, _staged_head, embed_leaves=lambda cfg: ["embed"],
                   head_leaves=lambda cfg: ["norm", "embed" if cfg.tie_word_embeddings else "lm_head"],
                   halves=(_attention_half, _moe_half),  # first_leaves: the attention's; the rest, the MoE's
                   first_leaves=lambda cfg: ("attn_norm", "wq", "wk", "wv", "wo"), half_names=("attention", "moe"))

# the JSON types of the config.json keys from_hf reads, refused by name before it runs (funcpar.ModelSpec)
CONFIG_TYPES = {**fp.DECODER_CONFIG_TYPES, "sliding_window": (int, None), "num_local_experts": (int,),
                "num_experts_per_tok": (int,), "router_aux_loss_coef": (float,), "output_router_logits": (bool,)}

MODEL = fp.register_model(fp.ModelSpec(
    name="mixtral", model_types=("mixtral",), Config=Config, init=init, specs=specs, forward=forward, loss=loss,
    hf=HF, batch_weight=L.count_targets, check_batch=L.token_range_errors, stages=STAGES, sequence_parallel=True,
    documents=True, data_axes=DATA_AXES,
    config_types=CONFIG_TYPES,
))
