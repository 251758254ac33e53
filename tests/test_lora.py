"""LoRA (funcpar.train.lora): adapters as their own pytree, the base frozen outside the train state; at Mesh(tp=2, dp=2)
training equals Mesh(), only the adapters change, no gradient or optimizer state exists for a base weight; the
merged export is W + (alpha/r)·B·A and loads in transformers; the PEFT folder loads with peft."""

import json

import pytest
import torch

import funcpar as fp
import harness
from funcpar.train.lora import Lora, LoraConfig, LoraError
from hf_fixtures import batch, make_checkpoint

LCFG = LoraConfig(r=4, alpha=8.0, targets=("q", "v", "o_proj", "down"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora") / "base"
    make_checkpoint("llama", str(folder))
    return str(folder)


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


def _map_b(tree, g):
    import optree

    return optree.tree_map_with_path(
        lambda path, x: torch.randn(x.shape, generator=g) * 0.05 if path[-1] == "lora_B" else x, tree)


def test_config_parse_and_errors(base):
    c = LoraConfig.parse("r=16,alpha=32,targets=q,v,dropout=0.05")
    assert (c.r, c.alpha, c.targets, c.dropout, c.scale) == (16, 32.0, ("q", "v"), 0.05, 2.0)
    for text, msg in [("r=0", "the rank must be an integer >= 1"), ("rank=4", "unknown key 'rank'"),
                      ("r=4,bogus", "'bogus' is not key=value"), ("alpha=-1", "alpha=-1.0: must be a positive number"),
                      ("dropout=1", "dropout=1.0: must be in"), ("r=x", "invalid literal")]:
        with pytest.raises(LoraError, match=msg):
            LoraConfig.parse(text)
    params, cfg = fp.hf.load(base)
    with pytest.raises(LoraError, match=r"LoRA target 'qq' matches no weight of model 'llama'; its modules are: "
                                        r"down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        Lora("llama", cfg, LoraConfig(targets=("qq",)))
    with pytest.raises(LoraError, match=r"matches leaf 'layers.0.attn_norm' of shape \(64,\), not a 2-D weight"):
        Lora("llama", cfg, LoraConfig(targets=(r"layers\.0\.attn_norm",)))
    # the adapters are made where the mesh's parameters live (cuda:$LOCAL_RANK on a GPU), unless told
    on_meta = Lora("llama", cfg, LCFG, fp.Mesh.abstract(device="meta")).init()
    assert {x.device.type for x in _leaves(on_meta)} == {"meta"}
    assert {x.device.type for x in _leaves(Lora("llama", cfg, LCFG, fp.Mesh.abstract(device="meta")).init(
        device="cpu"))} == {"cpu"}


def test_adapted_layer_equals_the_merged_weight(base):
    """x Wᵀ + s·(x Aᵀ) Bᵀ (never forming B·A) against the loss on W + s·B·A, value and adapter gradients."""
    params, cfg = fp.hf.load(base)
    model, mesh, b = fp.get_model("llama"), fp.Mesh(), batch()
    lora = Lora(model, cfg, LCFG, mesh)
    assert sorted(lora.targets) == sorted(f"layers.{i}.{n}" for i in range(2) for n in ("wq", "wv", "wo", "w_down"))
    ad = _map_b(lora.init(seed=0), torch.Generator().manual_seed(1))
    loss = lora.loss_fn(model.loss_fn(cfg, mesh), params)
    got = loss(ad, b)
    via_merge = model.loss(lora.merge(params, ad), b, cfg=cfg, mesh=mesh)
    assert abs(got.item() - via_merge.item()) <= 1e-6 * abs(via_merge.item())
    assert got.item() != model.loss(params, b, cfg=cfg, mesh=mesh).item()  # the adapters do something

    def merged_loss(a):
        p = lora._over(params, a, lambda path, w, x: w + x["lora_B"] @ x["lora_A"] * LCFG.scale)
        return model.loss(p, b, cfg=cfg, mesh=mesh)

    def grad(f):
        return [g for _, g in fp.tree.leaves_with_path(torch.func.grad(f)(ad))]
    remat_loss = lora.loss_fn(model.loss_fn(cfg, mesh, remat=True), params)
    # under remat the recomputed blocks take tensors: the adapters enter as W + s·B·A, the same gradients
    g1, g2, g3 = grad(lambda a: loss(a, b)), grad(merged_loss), grad(lambda a: remat_loss(a, b))
    paths = [p for p, _ in fp.tree.leaves_with_path(ad)]
    for p, x, y, z in zip(paths, g1, g2, g3, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-7) and torch.allclose(x, z, rtol=1e-5, atol=1e-7), p
        assert x.abs().sum() > 0, p
    with pytest.raises(LoraError, match=r"LoRA dropout=0.1 with remat: the recomputed forward would draw other masks"):
        Lora(model, cfg, LoraConfig(dropout=0.1), mesh).loss_fn(model.loss_fn(cfg, mesh, remat=True), params)


def _counting_gradients(step):
    """The bytes of the gradients ``step``'s gradient function returns, one entry per micro-batch (this rank's)."""
    import optree

    seen, grad = [], step.mode.grad

    def counted(*args, **kwargs):
        grads, out = grad(*args, **kwargs)
        seen.append(sum(g.numel() * g.element_size() for g in optree.tree_leaves(grads)))
        return grads, out
    step.mode.grad = counted
    return seen


def _train(folder, mesh, out=None, steps=3):
    model = fp.get_model("llama")
    params, cfg = fp.hf.load(folder, mesh=mesh)
    before = [x.clone() for _, x in fp.tree.leaves_with_path(params)]
    lora = Lora(model, cfg, LCFG, mesh)
    step = fp.compile_step(lora.loss_fn(model.loss_fn(cfg, mesh), params), lora.specs(), mesh=mesh,
                           optimizer=fp.optim.adamw(1e-2, weight_decay=0.01), zero=1, clip_norm=1.0)
    grad_bytes = _counting_gradients(step)
    state = step.init(lora.init(seed=0))
    losses = []
    for s in range(steps):
        state, m = step(state, harness.dp_share(batch(seed=s), mesh) if mesh.size > 1 else batch(seed=s))
        losses.append(m["loss"])
    base_same = all(torch.equal(x, y) for x, (_, y) in zip(before, fp.tree.leaves_with_path(params), strict=True))
    state_bytes = sum(x.numel() * x.element_size() for _, x in fp.tree.leaves_with_path(state.opt_state)
                      if isinstance(x, torch.Tensor) and x.ndim)
    out_d = {"losses": losses, "adapters": fp.gather(state.params, lora.specs(), mesh), "base_same": base_same,
             "state_bytes": state_bytes, "buffer_numel": sum(b.numel() for b in step.buffers.params),
             "adapter_numel": sum(x.numel() for _, x in fp.tree.leaves_with_path(state.params)),
             "grad_bytes": grad_bytes, "model_bytes": sum(x.numel() * 4 for x in before)}
    if out is not None:
        fp.hf.save(f"{out}/merged", lora.merge(params, state.params), model, cfg, mesh)
        lora.save_peft(f"{out}/adapter", state.params, base_model=folder)
        out_d["logits"] = fp.gather(model.forward(lora.apply(params, state.params, training=False),
                                                  batch(seed=9)["input_ids"], cfg, mesh), fp.P(None, None, "tp"), mesh)
    return out_d


def _full_fine_tuning_gradient_bytes(folder, mesh):
    """The gradient bytes of one step of full fine-tuning (every weight trained) on the same mesh and batch."""
    model = fp.get_model("llama")
    params, cfg = fp.hf.load(folder, mesh=mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh), model.specs(cfg, mesh), mesh=mesh,
                           optimizer=fp.optim.adamw(1e-2, weight_decay=0.01), zero=1, clip_norm=1.0)
    grad_bytes = _counting_gradients(step)
    step(step.init(params), harness.dp_share(batch(seed=0), mesh))
    return grad_bytes


def _train_tp2dp2(folder, out):
    mesh = harness.mesh(tp=2, dp=2)
    return {**_train(folder, mesh, out), "full_grad_bytes": _full_fine_tuning_gradient_bytes(folder, mesh)}


def test_lora_at_tp2_dp2_equals_one_process_and_exports(base, tmp_path):
    import transformers

    ref = _train(base, fp.Mesh())
    got = harness.run(4, _train_tp2dp2, base, str(tmp_path))
    for g in got:
        assert g["base_same"]  # the base weights are never written
        for a, b in zip(g["losses"], ref["losses"], strict=True):
            assert abs(a - b) <= 2e-6 * abs(b)
        for (p, x), (_, y) in zip(fp.tree.leaves_with_path(g["adapters"]), fp.tree.leaves_with_path(ref["adapters"]), strict=True):
            # the gradients agree to 1e-5 (test above); AdamW's m/sqrt(v) amplifies their round-off where an element's
            # gradient is tiny: per leaf 3.5e-6 of its norm with torch's fused AdamW kernel (9e-7 with the chain)
            assert (x - y).norm() <= 1e-5 * y.norm() and torch.allclose(x, y, rtol=1e-4, atol=1e-5), p
    assert ref["losses"][2] < ref["losses"][0]
    # what the step holds and differentiates: the adapters alone, counted from the targeted weights' shapes (out, in):
    # A (r, in) and B (out, r) each. Per rank at tp=2 x dp=2 the factors split as their weight: the column-parallel q,
    # v by rows (B halved, A whole over tp), the row-parallel o, down by columns (A halved, B whole over tp)
    n_adapters, local = 0, {"dp": 0, "dp+tp": 0}  # per rank: elements replicated over dp only, over dp and tp
    for layer in fp.hf.load(base)[0]["layers"]:
        for name, rows in (("wq", True), ("wv", True), ("wo", False), ("w_down", False)):
            a, b = LCFG.r * layer[name].shape[1], layer[name].shape[0] * LCFG.r
            n_adapters += a + b
            local["dp"] += (b if rows else a) // 2
            local["dp+tp"] += a if rows else b
    assert ref["grad_bytes"] == [4 * n_adapters] * 3  # each step's gradients: the adapters' (fp32), nothing else
    assert ref["buffer_numel"] == ref["adapter_numel"] == n_adapters
    assert ref["state_bytes"] == 2 * 4 * n_adapters  # AdamW's two moments
    for g in got:
        # the gradients the step computes: this rank's adapter shards alone, against every local weight's when the
        # same step trains the whole model on the same mesh
        assert g["grad_bytes"] == [4 * sum(local.values())] * 3
        assert g["full_grad_bytes"] == [g["model_bytes"]] and g["model_bytes"] > 10 * g["grad_bytes"][0]
        assert g["buffer_numel"] == g["adapter_numel"] == sum(local.values())
        # ZeRO-1: a bucket per set of replicated axes, cut in equal parts over them (padded), the moments of one part
        assert g["state_bytes"] == 2 * 4 * (-(-local["dp"] // 2) + -(-local["dp+tp"] // 4))
    r0 = got[0]
    # the merged export: W + (alpha/r)·B·A, loading in transformers with the adapted model's logits
    base_sd = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ad = ref["adapters"]["layers"]["1"]["wq"]
    want = base_sd["model.layers.1.self_attn.q_proj.weight"] + LCFG.scale * r0["adapters"]["layers"]["1"]["wq"][
        "lora_B"] @ r0["adapters"]["layers"]["1"]["wq"]["lora_A"]
    assert torch.allclose(merged.state_dict()["model.layers.1.self_attn.q_proj.weight"], want, atol=1e-6)
    assert torch.equal(merged.state_dict()["model.layers.1.mlp.up_proj.weight"],
                       base_sd["model.layers.1.mlp.up_proj.weight"])  # not a target: unchanged
    assert ad["lora_A"].shape == (4, 64)
    with torch.no_grad():
        logits = merged(input_ids=batch(seed=9)["input_ids"]).logits
    assert (logits - r0["logits"]).abs().max().item() <= 1e-5
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (4, 8.0, "LORA")
    assert cfg["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    peft = pytest.importorskip("peft")  # (in the test extra)

    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base),
                                           str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        logits = model(input_ids=batch(seed=9)["input_ids"]).logits
    assert (logits - r0["logits"]).abs().max().item() <= 1e-5


@pytest.mark.subprocess
def test_funcpar_train_with_lora_exports_merged_and_peft_folders(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import transformers

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)

    (tmp_path / "d.txt").write_text("\n\n".join(f"{a} plus {b} is {a + b}." for a in range(9) for b in range(9)))

    def train(*args, mesh="tp=2,dp=2"):
        return subprocess.run([sys.executable, "-m", "funcpar", "train", "--model", "llama-micro", "--mesh", mesh,
                               "--data", "d.txt", "--seq-len", "32", "--global-batch", "8", "--steps", "4",
                               "--eval-every", "2", "--schedule", "constant", "--lr", "1e-2", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
    p = train("--lora", "r=4,alpha=8,targets=zz", mesh="1")
    assert p.returncode == 1 and p.stderr.startswith("funcpar: LoRA target 'zz' matches no weight of model 'llama'"), \
        p.stderr
    assert not (tmp_path / "out").exists()
    p = train("--lora", "r=16,alpha=32,targets=q,v")  # as the issue writes it
    assert p.returncode == 0, p.stderr
    out = tmp_path / "out"
    assert "(the adapters merged); adapter: out/adapter" in p.stdout
    paths = [q["path"] for q in fp.checkpoint.metadata(out / "checkpoints")["params"]]
    assert paths and all(".lora_" in q for q in paths), paths  # the checkpoint holds the adapters alone
    adapter_cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter_cfg["r"], adapter_cfg["lora_alpha"], adapter_cfg["target_modules"]) == (16, 32.0,
                                                                                           ["q_proj", "v_proj"])
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.config.num_hidden_layers == 2
    # the merged export against the base the run started from (llama-micro, seed 0): W + (32/16)·B·A in exactly the
    # q and v projections of every layer, every other tensor the base's bit for bit
    from safetensors.torch import load_file

    from funcpar.cli.options import BUILTIN_MODELS

    llama = fp.get_model("llama")
    cfg = llama.config(BUILTIN_MODELS["llama-micro"], fp.Mesh())
    fp.hf.save(tmp_path / "base", llama.init(cfg, seed=0), llama, cfg)
    base_t, merged = load_file(tmp_path / "base" / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert sorted(merged) == sorted(base_t)
    adapted = [k for k in merged if not torch.equal(merged[k], base_t[k])]
    assert sorted(adapted) == sorted(f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qv")
    for k in adapted:
        lora_a, lora_b = (adapter[f"base_model.model.{k.removesuffix('.weight')}.lora_{x}.weight"] for x in "AB")
        assert lora_a.shape == (16, 64) and lora_b.shape == (base_t[k].shape[0], 16), k
        assert torch.allclose(merged[k], base_t[k] + 2.0 * lora_b @ lora_a, rtol=0, atol=1e-6), k
    # --zero 3: the frozen base 1/dp per rank (ShardedBase), the adapters at ZeRO-2; the export gathers the base
    p = train("--lora", "r=16,alpha=32,targets=q,v", "--zero", "3", "--out", "out3", mesh="dp=2")
    assert p.returncode == 0, p.stderr
    merged3 = load_file(tmp_path / "out3" / "hf" / "model.safetensors")
    assert sorted(k for k in merged3 if not torch.equal(merged3[k], base_t[k])) == sorted(adapted)


def _dropout_losses(folder, tp):
    mesh = harness.mesh(tp=tp) if tp > 1 else fp.Mesh()
    model = fp.get_model("llama")
    params, cfg = fp.hf.load(folder, mesh=mesh)
    lcfg = LoraConfig(r=4, alpha=8.0, targets=("q", "o"), dropout=0.3)
    lora = Lora(model, cfg, lcfg, mesh)
    whole = _map_b(Lora(model, fp.hf.load(folder)[1], lcfg).init(seed=0), torch.Generator().manual_seed(1))
    ad = fp.shard(whole, lora.specs(), mesh)  # the same adapters as at Mesh(), this rank's shards
    loss = lora.loss_fn(model.loss_fn(cfg, mesh), params)
    return [loss(ad, batch()).item() for _ in range(2)] + [model.loss(lora.merge(params, ad), batch(), cfg=cfg,
                                                                      mesh=mesh).item()]


def test_dropout_masks_are_the_same_on_every_tp_rank_and_new_each_call(base):
    ref = _dropout_losses(base, 1)
    assert len({round(v, 7) for v in ref}) == 3  # two calls, two masks; both differ from no dropout
    for got in harness.run(2, _dropout_losses, base, 2):  # column- (q) and row-parallel (o) adapters
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, ref, strict=True)), (got, ref)


class _DroppedRef:
    """The reference of an adapted weight in training with dropout, written out: ``F.linear(x, w)`` is
    ``x Wᵀ + s·((x·mask/(1−p)) Aᵀ) Bᵀ``, each call's mask ``rand(x.shape) >= p`` drawn from ``gen`` (the base path
    sees ``x``, the adapters ``x`` dropped and rescaled, feeding ``A``)."""

    def __init__(self, w, a, b, s, p, gen):
        self.w, self.a, self.b, self.s, self.p, self.gen, self.shape = w, a, b, s, p, gen, w.shape

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        import torch.nn.functional as F

        x, w, bias = (*args, None)[:3]
        assert func is F.linear and isinstance(w, cls) and bias is None and not kwargs, func  # (Llama: no bias)
        mask = (torch.rand(x.shape, generator=w.gen, dtype=torch.float32) >= w.p).to(x.dtype)
        return F.linear(x, w.w) + w.s * F.linear(F.linear(x * mask / (1 - w.p), w.a), w.b)


def test_dropout_feeds_the_adapters_the_input_masked_and_rescaled(base):
    """The dropout's arithmetic against the reference above on the same masks (the same generator): one adapted
    layer's value and input gradient, and the model's loss and adapter gradients (one generator drawn through the
    layers in call order, as funcpar draws it for a call of the loss)."""
    import torch.nn.functional as F

    params, cfg = fp.hf.load(base)
    model, mesh, b, p = fp.get_model("llama"), fp.Mesh(), batch(), 0.3
    lcfg = LoraConfig(r=4, alpha=8.0, targets=("q", "o"), dropout=p)
    lora = Lora(model, cfg, lcfg, mesh)
    ad = _map_b(lora.init(seed=0), torch.Generator().manual_seed(1))
    lora._dropout = lambda: torch.Generator().manual_seed(7)  # each call of the loss: the masks' generator

    def ref_params(a):
        g = torch.Generator().manual_seed(7)
        return lora._over(params, a, lambda path, w, x: _DroppedRef(w, x["lora_A"], x["lora_B"], lcfg.scale, p, g))

    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y = F.linear(x, lora.apply(params, ad)["layers"][0]["wq"])
    want = F.linear(x, ref_params(ad)["layers"][0]["wq"])
    assert torch.allclose(y, want, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(y, F.linear(x, lora.merge(params, ad)["layers"][0]["wq"]), rtol=1e-3)  # it drops
    gx, wx = (torch.autograd.grad((t * torch.linspace(-1, 1, t.shape[-1])).sum(), x)[0] for t in (y, want))
    assert torch.allclose(gx, wx, rtol=1e-6, atol=1e-7)  # the base path's gradient undropped, the adapters' masked

    loss = lora.loss_fn(model.loss_fn(cfg, mesh), params)
    ref = lambda a: model.loss(ref_params(a), b, cfg=cfg, mesh=mesh)  # noqa: E731
    got, want = loss(ad, b).item(), ref(ad).item()
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)
    g1, g2 = torch.func.grad(lambda a: loss(a, b))(ad), torch.func.grad(ref)(ad)
    for (path, u), (_, v) in zip(fp.tree.leaves_with_path(g1), fp.tree.leaves_with_path(g2), strict=True):
        assert torch.allclose(u, v, rtol=1e-5, atol=1e-7) and v.abs().sum() > 0, path


def _sharded_base(folder):
    """LoRA with the frozen base held 1/dp per rank (shard_base) against the base held whole, both with the adapters
    merged into the weights as remat needs them; on tp=2 x dp=2, adapters at zero=2."""
    mesh = harness.mesh(tp=2, dp=2)
    model = fp.get_model("llama")
    out = {}
    for shard_base in (False, True):
        params, cfg = fp.hf.load(folder, mesh=mesh)
        lora = Lora(model, cfg, LCFG, mesh)
        loss = lora.loss_fn(model.loss_fn(cfg, mesh, remat=True), params, shard_base=shard_base)
        held = loss.fn.parts if shard_base else fp.tree.leaves_with_path(params)
        out[f"held{int(shard_base)}"] = sum((x[1] if isinstance(x, tuple) else x).numel() for x in held)
        del params
        step = fp.compile_step(loss, lora.specs(), mesh=mesh, optimizer=fp.optim.adamw(1e-2), zero=2, clip_norm=1.0)
        state = step.init(lora.init(seed=0))
        losses = []
        for s in range(3):
            state, m = step(state, harness.dp_share(batch(seed=s), mesh))
            losses.append(m["loss"])
        out[shard_base] = (losses, fp.gather(state.params, lora.specs(), mesh))
    return out


def test_lora_with_the_base_sharded_like_zero3_equals_the_base_held_whole(base):
    """The frozen base 1/dp per rank, gathered block by block, only the adapters in the optimizer: the same losses
    (1e-6 relative) and adapters (1e-5 of their norm) as with the base held whole; each rank holds half the base."""
    for out in harness.run(4, _sharded_base, base):
        (l0, a0), (l1, a1) = out[False], out[True]
        assert all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(l1, l0, strict=True)), (l1, l0)
        diff = sum((x - y).pow(2).sum().item() for x, y in zip(_leaves(a1), _leaves(a0), strict=True)) ** 0.5
        assert diff <= 1e-5 * sum(y.pow(2).sum().item() for y in _leaves(a0)) ** 0.5
        assert abs(out["held1"] - out["held0"] / 2) <= 0.01 * out["held0"]
    with pytest.raises(LoraError, match="shard_base gathers the base block by block"):
        model = fp.get_model("llama")
        params, cfg = fp.hf.load(base)
        Lora(model, cfg, LCFG).loss_fn(lambda p, b: 0.0, params, shard_base=True)
