"""The generic transformers path (``funcpar.models.transformers_auto``) held to transformers + ``torch.optim.AdamW``:
a tiny random config of any causal-LM type, 3 steps on a mesh against 3 steps of the transformers module itself.

Shared by tests/test_generic.py (a representative subset in CI) and scripts/supported.py (every type of the installed
transformers, the table in docs/SUPPORTED.md). Gloo workers import this module by name.

The bar (issue 55): per step the loss and the gradient norm within 1e-5 relative, and after the 3 steps each
leaf's update (final minus initial) within 1e-4 of its size, or within 4 times what transformers' own run differs
by when the same batches are summed in another order (two micro-batches each: ``reference``'s ``noise``). Adam
divides each gradient entry by its own root mean square, so an entry that is round-off (a cancelled sum; a
parameter barely used) moves a whole learning rate either way: such leaves (a gated-delta ``dt_bias``, rare
embedding rows) differ from transformers by what transformers differs from itself. Nor is an update seen more
finely than its parameter's float32 spacing (2 ulp of the leaf's norm: a ``dt_bias`` of values near 1 moved 1e-3).
"""

from __future__ import annotations

import math
import os
import re

import torch

import harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS, B, T, V = 3, 4, 16, 128  # (V: transformers_auto.SMALL's vocabulary)
LR, WD, CLIP = 1e-3, 0.1, 1.0
# Adam's eps: at torch's default 1e-8 a gradient entry at round-off level (a key bias's, whose true gradient is zero;
# an embedding row no token used) is divided by a square root of its own size, so a 1e-10 difference in the order of
# a tp sum becomes an lr-sized step: up to 5e-4 of a leaf's update apart at 1e-8 (gemma2, starcoder2, gpt_neox; the
# losses and norms within 1e-6), every leaf within 1e-4 at 1e-6. GENERIC_EPS sets it (for both sides).
EPS = float(os.environ.get("GENERIC_EPS", "1e-6"))

def tiny_config(model_type: str) -> dict:
    """A small config of ``model_type`` as a ``config.json`` dict: the type's defaults, shrunk as the generic path's
    own probe shrinks a user's (``transformers_auto.small_config``)."""
    from funcpar.models import transformers_auto as G

    return G.small_config({"model_type": model_type})


def batches(n: int = STEPS) -> list[dict]:
    return harness.token_batches(n, V, B, T, seed=55, masked=3)


def reference(hf: dict, steps: int = STEPS, micro: int = 1) -> dict:
    """transformers' run: the initial named parameters, per-step loss and gradient norm, final parameters;
    ``micro``: each batch as that many micro-batches (each one's mean loss weighted by its share of the targets:
    the same objective, summed in another order), and without ``noise``. With ``micro=1`` the result also holds
    ``noise``: per leaf, how far the final parameters of the two-micro-batch run are from this one's (transformers
    against itself: the round-off the bar allows beside its 1e-4 of the update's size)."""
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    cfg = CONFIG_MAPPING[hf["model_type"]].from_dict({k: v for k, v in hf.items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.train()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = [], []
    for b in batches(steps):
        total, loss = _targets(b["labels"]), 0.0
        for ids, labels in zip(b["input_ids"].chunk(micro), b["labels"].chunk(micro), strict=True):
            out = model(input_ids=ids, labels=labels)
            (out.loss * (_targets(labels) / total if micro > 1 else 1)).backward()
            loss += out.loss.item() * _targets(labels) / total
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        losses.append(loss)
        opt.step()
        opt.zero_grad()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"init": init, "losses": losses, "norms": norms, "final": final}
    if micro == 1 and steps:
        other = reference(hf, steps, micro=2)["final"]
        out["noise"] = {n: (other[n] - final[n]).norm().item() for n in final}
    return out


def _targets(labels) -> int:
    return int((labels[:, 1:] != -100).sum())


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
        noise = ref.get("noise", {}).get(n, 0.0)
        ulp = 2 * torch.finfo(torch.float32).eps * want.norm().item()  # (an update is seen through float32 values)
        if not err <= max(1e-4 * size, 4 * noise, ulp) + 1e-12 or not math.isfinite(err):
            bad.append(f"update of '{n}' off by {err:.3g} ({err / max(size, 1e-30):.2g} of its size; transformers "
                       f"against itself {noise:.2g})")
    return bad


def _reason(text: str) -> str:
    """A failed world's traceback as one line: ``refused: why`` for funcpar's refusals, else ``failed: ...``."""
    if "did not finish" in text:
        return "failed: timed out"
    line = next((ln for ln in reversed(text.splitlines()) if "Error" in ln), text.strip().splitlines()[-1]).strip()
    refused = any(k in line for k in ("GenericError", "ModelError", "StepError", "SpecError"))
    line = re.sub(r"^[\w.]*(GenericError|ModelError): ", "", line)
    return ("refused: " if refused else "failed: ") + line[:300]


MESHES = {  # name -> (world, mesh axes, step options)
    "one process": (1, {}, {}),
    "tp=2": (2, {"tp": 2}, {}),
    "tp=2 x dp=2 zero3": (4, {"dp": 2, "tp": 2}, {"zero": 3}),
    "pp=2": (2, {"pp": 2}, {"accum_steps": 2}),
    "pp=2 x tp=2": (4, {"pp": 2, "tp": 2}, {"accum_steps": 2}),
}


def check(model_type: str, meshes=("tp=2",), hf: dict | None = None, timeout: float = 120) -> dict:
    """``{mesh: "exact" | "refused: why" | "failed: why"}`` for ``model_type`` on each of ``meshes`` (a mesh
    whose run takes over ``timeout`` seconds fails as such, and so do the meshes after it)."""
    hf = hf or tiny_config(model_type)
    ref = reference(hf)
    out = {}
    for name in meshes:
        world, axes, options = MESHES[name]
        if any("timed out" in v for v in out.values()):
            out[name] = "failed: not run (an earlier mesh timed out)"
            continue
        try:
            res = harness.run(world, train_generic, hf, ref["init"], axes, options, timeout=timeout)
        except harness.WorldError as e:
            out[name] = _reason(str(e))
            continue
        bad = compare(ref, res[0])
        out[name] = "exact" if not bad else "failed: " + "; ".join(bad[:3])
    return out
