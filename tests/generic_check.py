"""The generic transformers path (``funcpar.models.transformers_auto``) held to transformers + ``torch.optim.AdamW``:
a tiny random config of any causal-LM type, 3 steps on a mesh against 3 steps of the transformers module itself.

Shared by tests/test_generic.py (a representative subset in CI) and scripts/supported.py (every type of the installed
transformers, the table in docs/SUPPORTED.md). Gloo workers import this module by name.

The bar (issue 55): per step the loss and the gradient norm within 1e-5 relative, and after the 3 steps each
leaf's update (final minus initial) within 1e-4 of its size.
"""

from __future__ import annotations

import math
import os

import torch

import harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS, B, T, V = 3, 4, 16, 128
LR, WD, CLIP = 1e-3, 0.1, 1.0
EPS = float(os.environ.get("GENERIC_EPS", "1e-8"))

# the sizes a tiny config gets, where the type's config has the key (names as transformers spells them)
_TINY = dict(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8, window_size=8,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False, tie_word_embeddings=None,
    layer_types=None, mlp_layer_types=None, decoder_sparse_step=1, global_attn_every_n_layers=None,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_nextn_predict_layers=0, num_shared_experts=1, attention_chunk_size=8, router_aux_loss_coef=0.0,
)


def tiny_config(model_type: str) -> dict:
    """A small config of ``model_type`` as a ``config.json`` dict: the type's defaults with the sizes of ``_TINY``
    where it has those keys, dropout off, per-layer lists cut to the layer count."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls().to_dict()
    keys = set(default) | set(getattr(cls, "attribute_map", {}))
    over = {k: v for k, v in _TINY.items() if k in keys and v is not None}
    if "qk_rope_head_dim" in keys:  # (latent attention: its head_dim is the rotary part's)
        over["head_dim"] = over["qk_rope_head_dim"]
    n = over.get("num_hidden_layers", 2)
    for k in ("layer_types", "mlp_layer_types"):
        if isinstance(default.get(k), list):
            over[k] = default[k][:n] if len(default[k]) >= n else (default[k] * n)[:n]
    for k, v in default.items():
        if "dropout" in k and isinstance(v, float):
            over[k] = 0.0
    cfg = cls(**{**{k: v for k, v in default.items() if k not in ("architectures",)}, **over})
    out = cfg.to_dict()
    out["model_type"] = model_type
    return out


def batches(n: int = STEPS) -> list[dict]:
    return harness.token_batches(n, V, B, T, seed=55, masked=3)


def reference(hf: dict, steps: int = STEPS) -> dict:
    """transformers' run: the initial named parameters, per-step loss and gradient norm, final parameters."""
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    cfg = CONFIG_MAPPING[hf["model_type"]].from_dict({k: v for k, v in hf.items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.train()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = [], []
    for b in batches(steps):
        out = model(input_ids=b["input_ids"], labels=b["labels"])
        out.loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        losses.append(out.loss.item())
        opt.step()
        opt.zero_grad()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"init": init, "losses": losses, "norms": norms, "final": final}


def train_generic(hf: dict, init: dict, axes: dict, options: dict, steps: int = STEPS):
    """On every rank of a harness world: the generic model of ``hf`` trained ``steps`` steps on ``Mesh(**axes)``
    from ``init`` (named tensors); per-step loss and norm, and (rank 0) the final parameters by name."""
    import funcpar as fp
    from funcpar.models import transformers_auto as G

    mesh = harness.mesh(**axes)
    options = dict(options)
    remat = options.pop("remat", False)
    spec = fp.get_model(hf["model_type"], generic=True)
    cfg = spec.config(hf, mesh)
    G.check_mesh(cfg, mesh, staged=remat or options.get("zero") == 3)
    specs = spec.specs(cfg, mesh)
    step = fp.compile_step(spec.loss_fn(cfg, mesh, remat=remat), specs, mesh=mesh,
                           optimizer=fp.optim.adamw(LR, eps=EPS, weight_decay=WD), clip_norm=CLIP, **options)
    state = step.init(fp.shard(G.tree_of(cfg, init), specs, mesh))
    losses, norms = [], []
    for b in batches(steps):
        state, m = step(state, harness.dp_share(b, mesh))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    final = G.named_of(cfg, fp.gather(step.gather_params(state), specs, mesh))
    return losses, norms, final if mesh.rank == 0 else None


def compare(ref: dict, got: tuple) -> list[str]:
    """What differs between the reference and a run, in words (empty: exact to the bar)."""
    losses, norms, final = got
    bad = []
    for k, (a, b) in enumerate(zip(losses, ref["losses"], strict=True)):
        if not abs(a - b) <= 1e-5 * abs(b):
            bad.append(f"step {k + 1} loss {a:.7g} vs transformers {b:.7g}")
    for k, (a, b) in enumerate(zip(norms, ref["norms"], strict=True)):
        if not abs(a - b) <= 1e-5 * abs(b):
            bad.append(f"step {k + 1} grad norm {a:.7g} vs {b:.7g}")
    if set(final) != set(ref["final"]):
        bad.append(f"leaves differ: {sorted(set(final) ^ set(ref['final']))[:3]}")
        return bad
    for n, want in ref["final"].items():
        du, dr = final[n] - ref["init"][n], want - ref["init"][n]
        err, size = (du - dr).norm().item(), dr.norm().item()
        if not err <= 1e-4 * size + 1e-12 or not math.isfinite(err):
            bad.append(f"update of '{n}' off by {err:.3g} ({err / max(size, 1e-30):.2g} of its size)")
    return bad


MESHES = {  # name -> (world, mesh axes, step options)
    "one process": (1, {}, {}),
    "tp=2": (2, {"tp": 2}, {}),
    "tp=2 x dp=2 zero3": (4, {"dp": 2, "tp": 2}, {"zero": 3}),
    "pp=2": (2, {"pp": 2}, {"accum_steps": 2}),
    "pp=2 x tp=2": (4, {"pp": 2, "tp": 2}, {"accum_steps": 2}),
}


def check(model_type: str, meshes=("tp=2",), hf: dict | None = None) -> dict:
    """``{mesh: "exact" | "refused: why" | "failed: why"}`` for ``model_type`` on each of ``meshes``."""
    hf = hf or tiny_config(model_type)
    ref = reference(hf)
    out = {}
    for name in meshes:
        world, axes, options = MESHES[name]
        try:
            res = harness.run(world, train_generic, hf, ref["init"], axes, options, timeout=180)
        except harness.WorldError as e:
            text = str(e)
            refused = "GenericError" in text or "ModelError" in text
            line = next((ln for ln in reversed(text.splitlines()) if "Error" in ln), text.splitlines()[-1])
            out[name] = ("refused: " if refused else "failed: ") + line.strip()[:300]
            continue
        bad = compare(ref, res[0])
        out[name] = "exact" if not bad else "failed: " + "; ".join(bad[:3])
    return out
