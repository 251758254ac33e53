"""The generic transformers path (``funcpar.models.transformers_auto``): any causal LM transformers defines, run as
its own module split by its config's tp plan, held to transformers + ``torch.optim.AdamW`` (tests/generic_check.py:
3 steps, losses and gradient norms within 1e-5, every leaf's update within 1e-4 of its size) on real gloo meshes;
its HF folders in and out; what it refuses, by name, before step 1; the command line on a Qwen3 folder.

The whole table over every type is scripts/supported.py's (docs/SUPPORTED.md); this is its representative subset.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import funcpar as fp
import generic_check as g
import harness
from funcpar.models import transformers_auto as G

# the list: q/k norms, soft-capping + sliding window + scaled tied embeddings, packed qkv and gate/up,
# biases + LayerNorm, parallel residual, logit scale, multipliers, MoE experts over tp, latent attention
MUST = ["qwen3", "gemma2", "gemma3_text", "olmo2", "phi3", "starcoder2", "gpt_neox", "cohere", "granite",
        "smollm3", "olmoe", "deepseek_v3"]


@pytest.mark.parametrize("model_type", MUST)
def test_exact_against_transformers_at_tp2(model_type):
    assert g.check(model_type, ["tp=2"]) == {"tp=2": "exact"}


@pytest.mark.parametrize("model_type", ["phi", "apertus", "qwen3_moe", "granitemoehybrid"])
def test_more_of_what_the_path_does(model_type):
    """An LM head with a bias (Phi); an activation's scales that act on each rank's columns, which the plan leaves
    replicated and the probe routes through copy_to_region (Apertus); experts over tp (Qwen3-MoE); a hybrid of
    linear and full attention with Mamba and MoE layers (Granite-MoE-hybrid)."""
    assert g.check(model_type, ["tp=2"]) == {"tp=2": "exact"}


@pytest.mark.parametrize("model_type", ["aria_text", "doge", "inkling_text", "dory"])
def test_plans_that_need_more_than_their_styles_say(model_type):
    """Experts stored transposed, their fused gate|up split per half along the last dimension (`packed_rowwise`:
    Aria); a dynamic mask computed for every head, cut to each rank's heads (Doge); a fused gate|up the plan calls
    `colwise`, split per half, shared experts summed over tp, an embedding norm and a muP head scale (Inkling); an
    LM head with a learned per-token scale, run as an equivalent plain weight (Dory)."""
    assert g.check(model_type, ["tp=2"]) == {"tp=2": "exact"}


def test_leaves_no_gradient_reaches_are_left_alone_as_torch_does():
    """GLM-MoE-DSA's sparse-attention indexer runs under torch.no_grad: its weights get no gradient, so
    torch.optim.AdamW skips them (no weight decay either); the generic model names them (``ModelSpec.frozen``) and
    the step masks them out of the optimizer."""
    spec = fp.get_model("glm_moe_dsa")
    cfg = spec.config(g.tiny_config("glm_moe_dsa"))
    off = sorted(p for p, f in fp.tree.leaves_with_path(G.frozen(cfg)) if f)
    assert off and all(".indexer." in p for p in off), off
    assert G.frozen(spec.config(g.tiny_config("qwen3"))) is None
    assert g.check("glm_moe_dsa", ["tp=2"]) == {"tp=2": "exact"}  # (weight decay 0.1 on every other leaf)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "phi3", "deepseek_v3"])
def test_exact_at_zero3_and_on_pipeline_stages(model_type):
    meshes = ["tp=2 x dp=2 zero3", "pp=2 x tp=2"]
    assert g.check(model_type, meshes) == dict.fromkeys(meshes, "exact")


@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_pipeline_schedules_exact(schedule):
    hf = g.tiny_config("gemma2")
    ref = g.reference(hf)
    res = harness.run(2, g.train_generic, hf, ref["init"], {"pp": 2}, {"pipeline": schedule, "accum_steps": 4})
    assert g.compare(ref, res[0]) == []


def test_remat_and_accumulation_exact():
    hf = g.tiny_config("qwen3")
    ref = g.reference(hf)
    res = harness.run(2, g.train_generic, hf, ref["init"], {"tp": 2}, {"remat": True, "accum_steps": 2})
    assert g.compare(ref, res[0]) == []


def test_a_planted_difference_is_caught():
    """The bar can fail: the same run with one head scaling dropped (Cohere's logit_scale) is not exact."""
    ref = g.reference(g.tiny_config("cohere"))
    res = harness.run(2, _without_logit_scale, g.tiny_config("cohere"), ref["init"])
    assert any("loss" in line for line in g.compare(ref, res[0]))


def _without_logit_scale(hf, init):
    own = G._scaled
    G._scaled = lambda x, cfg: x
    try:
        return g.train_generic(hf, init, {"tp": 2}, {})
    finally:
        G._scaled = own


def _llama_runs(folder, generic):
    """3 steps of the llama folder at tp=2, built-in or generic; losses, norms and the exported tensors."""
    mesh = harness.mesh(tp=2)
    model = fp.get_model("llama", generic=generic)
    params, cfg = fp.hf.load(folder, model=model, mesh=mesh)
    specs = model.specs(cfg, mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, clip_norm=g.CLIP,
                           optimizer=fp.optim.adamw(g.LR, eps=g.EPS, weight_decay=g.WD))
    state = step.init(params)
    losses, norms = [], []
    for b in g.batches():
        state, m = step(state, b)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    out = f"{folder}-{'generic' if generic else 'builtin'}"
    fp.hf.save(out, step.gather_params(state), model, cfg, mesh, specs, overwrite=True)
    return losses, norms, out


def test_llama_generic_equals_builtin(tmp_path):
    """The built-in llama and transformers' llama through the generic path: the same folder in, the same
    losses and norms, the same exported tensors (to round-off)."""
    from hf_fixtures import folder_tensors

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    hf = g.tiny_config("llama")
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["llama"].from_dict(hf))
    model.save_pretrained(tmp_path / "llama")
    built = harness.run(2, _llama_runs, str(tmp_path / "llama"), False)[0]
    generic = harness.run(2, _llama_runs, str(tmp_path / "llama"), True)[0]
    for a, b in zip(built[0] + built[1], generic[0] + generic[1], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    ta, tb = folder_tensors(built[2]), folder_tensors(generic[2])
    assert sorted(ta) == sorted(tb)
    for n in ta:
        assert torch.allclose(ta[n], tb[n], rtol=0, atol=1e-5), n


def test_llama_rotary_runs_through_funcpar_bit_for_bit():
    """A module whose forward calls a word-for-word copy of Llama's ``apply_rotary_pos_emb`` calls funcpar's
    rotation instead (through the forward's decorators): the values and gradients bit for bit, fewer transient
    tensors (benchmarks/run.py: the generic path's step allocated 136 MB more than the built-in Llama's, 1154 MB
    with it)."""
    from transformers.models.llama import modeling_llama as ml

    cfg = fp.get_model("qwen3").config(g.tiny_config("qwen3"))
    attn = [m for m in G.built(cfg).module.modules() if type(m).__name__.endswith("Attention")]
    assert attn and all("forward" in vars(m) for m in attn)  # (each rebound on the instance)
    import inspect

    inner = inspect.unwrap(attn[0].forward.__func__)
    assert inner.__globals__["apply_rotary_pos_emb"] is G._rotary_pair
    assert ml.apply_rotary_pos_emb is not G._rotary_pair  # (transformers' own module untouched)
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16, 8, requires_grad=True), torch.randn(2, 2, 16, 8, requires_grad=True)
    ang = torch.randn(2, 16, 4)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    want, got = ml.apply_rotary_pos_emb(q, k, cos, sin), G._rotary_pair(q, k, cos, sin)
    gw = torch.autograd.grad(sum((w * w.detach().sin()).sum() for w in want), (q, k))
    gg = torch.autograd.grad(sum((w * w.detach().sin()).sum() for w in got), (q, k))
    for a, b in zip(want + gw, got + gg, strict=True):
        assert torch.equal(a, b)


def test_build_allocates_no_weight_on_the_host():
    """The meta build makes ``torch.empty`` weights on meta (a host tensor of a weight's size allocated and freed
    raises glibc's mmap threshold: the loaded weights and optimizer state then fragment the heap); a module that
    fills a ``torch.empty`` table in ``__init__`` is found and built with host tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Devices(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format:
                self.seen.append((tuple(out.shape), out.device.type))
            return out

    with G._parameters_on_meta(), Devices():
        lin = torch.nn.Linear(512, 256)
    assert lin.weight.device.type == "meta" and ((256, 512), "meta") in Devices.seen
    assert not any(d == "cpu" and s == (256, 512) for s, d in Devices.seen)

    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.empty(4, 3))
            self.table.copy_(torch.arange(12.0).view(4, 3))

    with G._parameters_on_meta():
        t = Table()
    assert G._host_tensors_on_meta(t)
    with G._parameters_on_meta(empty_on_meta=False):
        t = Table()
    assert not G._host_tensors_on_meta(t) and torch.equal(t.table, torch.arange(12.0).view(4, 3))
    assert not G._host_tensors_on_meta(G.built(fp.get_model("qwen3").config(g.tiny_config("qwen3"))).module)


def _load_sharded(folder):
    mesh = harness.mesh(tp=2)
    stats = {}
    params, cfg = fp.hf.load(folder, mesh=mesh, dtype=torch.float32, stats=stats)
    model = fp.get_model(cfg.model_type)
    fp.hf.save(folder + "-out", params, model, cfg, mesh, model.specs(cfg, mesh), overwrite=True)
    return model.name, stats["bytes_read"], {k: tuple(v.shape) for k, v in G.named_of(cfg, params).items()}


def test_hub_folder_in_and_out(tmp_path):
    """A sharded bf16 folder as save_pretrained writes it (Qwen3 untied; Gemma-3 tied, its head not stored; OLMoE's
    fused expert gate/up, two leaves of one tensor): each
    rank reads only its slices (half the bytes of the split leaves), and the export is the same tensors."""
    from hf_fixtures import folder_tensors
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    for mt in ("qwen3", "gemma3_text", "phi3", "olmoe"):  # (olmoe: experts' gate/up read and written per half)
        folder = str(tmp_path / mt)
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[mt].from_dict(g.tiny_config(mt)))
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="20KB")
        assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
        (name, read, shapes), (_, read1, _) = harness.run(2, _load_sharded, folder)
        total = sum(v.numel() * 2 for v in folder_tensors(folder).values())
        assert name == f"{mt} (transformers)" and read < 0.8 * total and read1 < 0.8 * total, (mt, read, total)
        a, b = folder_tensors(folder), folder_tensors(folder + "-out")
        if mt != "olmoe":  # (the same tensors, byte for byte)
            assert sorted(a) == sorted(b), mt
            for n in a:
                assert torch.equal(a[n].float(), b[n].float()), (mt, n)
        else:  # save_pretrained wrote one tensor per expert; the export is transformers' fused in-memory layout
            assert any(".experts.0.gate_proj." in n for n in a) and any(".experts.gate_up_proj" in n for n in b)
        sa = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
        sb = AutoModelForCausalLM.from_pretrained(folder + "-out", dtype=torch.float32).state_dict()
        assert sorted(sa) == sorted(sb) and all(torch.equal(sa[n], sb[n]) for n in sa), mt


def test_refusals_name_the_model_and_the_reason():
    """Before step 1, in one line naming the model type: a style the path does not run at tp=2, a type without a
    pipeline plan whose layers its staged form cannot run alone (the probe's finding), dropout, heads tp does not
    divide, a type transformers does not define."""
    mesh = fp.Mesh.abstract(tp=2)
    cases = [
        ("qwen3", {}, fp.Mesh.abstract(tp=2), None),  # (a supported one: no refusal)
        ("biogpt", {}, fp.Mesh.abstract(pp=2), r"its staged form\) fails .*pipeline stages, ZeRO-3 and remat"),
        ("qwen3", {"attention_dropout": 0.1}, mesh, "attention_dropout"),
        ("qwen3", {"num_key_value_heads": 1}, mesh, "tp=2 does not divide"),
    ]
    for mt, edits, m, want in cases:
        hf = {**g.tiny_config(mt), **edits}
        spec = fp.get_model(mt)
        cfg = spec.config(hf)
        if want is None:
            spec.loss_fn(cfg, m)
            continue
        with pytest.raises(fp.ModelError, match=want) as e:
            spec.loss_fn(cfg, m)
        assert f"model_type '{mt}'" in str(e.value)
    with pytest.raises(fp.ModelError, match="no causal LM"):
        fp.get_model("not_a_model_type")


def test_refused_style_at_tp2():
    """A tp plan style the generic path does not run is named with the module it is on (every style transformers
    5.24's causal LMs use runs now: a plan naming sequence-parallel norms stands for the next one it adds)."""
    from transformers import CONFIG_MAPPING

    hf = g.tiny_config("qwen3")
    plan = dict(CONFIG_MAPPING["qwen3"]().base_model_tp_plan)
    hf["base_model_tp_plan"] = {**plan, "layers.*.post_attention_layernorm": "sequence_parallel"}
    spec = fp.get_model("qwen3", generic=True)
    cfg = spec.config(hf)
    assert G.built(cfg).refusals[0] == ("sequence_parallel", "model.layers.0.post_attention_layernorm")
    with pytest.raises(fp.ModelError, match=r"tp plan style 'sequence_parallel' \(model.layers.0.post_attention_"
                                            r"layernorm\): sequence-parallel norms; the generic path does not split"):
        spec.loss_fn(cfg, fp.Mesh.abstract(tp=2))
    spec.loss_fn(cfg, fp.Mesh.abstract(dp=2))  # (tp=1: nothing to split, nothing refused)


def test_a_type_without_a_pipeline_plan_says_so_and_names_funcpars_own_model():
    """GPT-2 has no base_model_pp_plan in transformers: the staged forms (pipelines, ZeRO-3, remat) are refused
    with that reason (not a missing 'layers' list) and what the hand-written gpt2 runs of them named (not remat:
    it has none); tp and dp still run."""
    spec = fp.get_model("gpt2", generic=True)
    cfg = spec.config({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64,
                       "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    with pytest.raises(G.GenericError, match=r"model_type 'gpt2': the installed transformers gives it no pipeline "
                                             r"plan \(base_model_pp_plan\).*\(funcpar's own gpt2, without "
                                             r"--generic, runs pipeline stages, ZeRO-3\)$"):
        G.check_mesh(cfg, fp.Mesh.abstract(pp=2))
    G.check_mesh(cfg, fp.Mesh.abstract(dp=2))


def test_probe_refuses_what_differs_from_transformers(monkeypatch):
    cfg = G.Config.from_hf(g.tiny_config("cohere"))
    G.probe(cfg)
    monkeypatch.setattr(G, "_scaled", lambda x, cfg: x)  # (Cohere's logit_scale forgotten)
    monkeypatch.setattr(G, "_PROBED", {})  # (a probe's verdict is kept per config)
    with pytest.raises(G.GenericError, match="does not reproduce transformers"):
        G.probe(cfg)


def test_cli_trains_a_qwen3_folder_resumes_on_another_mesh_and_exports(tmp_path):
    """The README's command on a user's Qwen3 folder (sharded, bf16, its tokenizer): tp=2 says which path it
    takes, resumes on dp=2, and the export loads in transformers with the logits funcpar computes."""
    from hf_fixtures import chatml_tokenizer
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    folder = tmp_path / "qwen3"
    hf = {**g.tiny_config("qwen3"), "vocab_size": 320, "tie_word_embeddings": False}
    AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3"].from_dict(hf)).to(torch.bfloat16).save_pretrained(
        folder, max_shard_size="200KB")
    chatml_tokenizer(folder, ["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=320)
    run = [sys.executable, "-m", "funcpar", "train", "--model", str(folder), "--out", str(tmp_path / "run"),
           "--eval-every", "0", "--save-every", "2", "--seq-len", "32", "--global-batch", "8", "--warmup", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(run + ["--mesh", "tp=2", "--steps", "2"], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "qwen3 (transformers' module split by its tp plan) on Mesh(" in first.stdout
    again = subprocess.run(run + ["--mesh", "dp=2", "--steps", "3", "--resume"], capture_output=True, text=True,
                           env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    params, cfg = fp.hf.load(tmp_path / "run" / "hf")
    ids = torch.randint(0, 320, (1, 12))
    ours = fp.get_model("qwen3").forward(params, ids, cfg, fp.Mesh())
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert generated.shape == (1, 16)


def _lora_run(folder, out):
    from funcpar.train.lora import Lora, LoraConfig

    mesh = harness.mesh(tp=2)
    model = fp.get_model("qwen3")
    params, cfg = fp.hf.load(folder, mesh=mesh)
    lora = Lora(model, cfg, LoraConfig.parse("r=4,alpha=8,targets=q,v"), mesh)
    init = lora.init(seed=0)
    lora.save_peft(out, init, base_model=folder)
    step = fp.compile_step(lora.loss_fn(model.loss_fn(cfg, mesh), params), lora.specs(), mesh=mesh, clip_norm=g.CLIP,
                           optimizer=fp.optim.adamw(g.LR, eps=g.EPS, weight_decay=g.WD))
    state = step.init(init)
    losses = []
    for b in g.batches():
        state, m = step(state, b)
        losses.append(m["loss"])
    return losses


def test_lora_by_hf_module_names_against_peft(tmp_path):
    """LoRA on q/v of a generic Qwen3 at tp=2, held to peft + torch AdamW from the same adapters (funcpar's initial
    adapters exported as a PEFT folder, which peft loads): the same losses."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    folder = str(tmp_path / "qwen3")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3"].from_dict(g.tiny_config("qwen3"))).save_pretrained(folder)
    losses = harness.run(2, _lora_run, folder, str(tmp_path / "a0"))[0]
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), str(tmp_path / "a0"),
                                           is_trainable=True)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trained, lr=g.LR, weight_decay=g.WD, eps=g.EPS)
    for b, got in zip(g.batches(), losses, strict=True):
        loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, g.CLIP)
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - got) <= 1e-5 * loss.item(), (loss.item(), got)


def _verify(hf, init):
    mesh = harness.mesh(pp=2, tp=2)
    spec = fp.get_model(hf["model_type"])
    cfg = spec.config(hf)
    report = fp.verify(lambda m: spec.loss_fn(cfg, m), spec.specs(cfg, mesh), G.tree_of(cfg, init), g.batches(2),
                       mesh, zero=3, accum_steps=2)
    return report.ok, str(report)


def test_verify_passes_a_generic_model_on_pipeline_stages_at_zero3():
    hf = g.tiny_config("gemma2")
    ok, text = harness.run(4, _verify, hf, g.reference(hf, steps=0)["init"])[0]
    assert ok, text
