"""The model contract: a model defined outside the package (tests/tinylm.py) registers, trains on a real mesh and
round-trips through HF export/import; the staged form equals the loss; the registry's errors."""

import json

import pytest
import torch

import funcpar as fp
import harness
import tinylm
from funcpar.models import gpt2, llama

V, B, T = 101, 8, 12  # a vocabulary tp=2 does not divide: padded rows, masked in the loss, dropped on export


def cfg():
    return tinylm.Config(vocab_size=V, d_model=16, d_hidden=32, n_layers=2)


def batches(n=3):
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(7 + s)
        ids = torch.randint(0, V, (B, T), generator=g)
        labels = ids.clone()
        labels[s, :5] = -100  # uneven targets across micro-batches and dp ranks
        out.append({"input_ids": ids, "labels": labels})
    return out


def _train(mesh, folder=None):
    model = fp.get_model("tinylm")  # found in the registry by its model_type
    c = model.config(cfg().to_hf(), mesh)
    specs = model.specs(c, mesh)
    params = fp.shard(model.init(c, seed=0), specs, mesh)
    step = fp.compile_step(model.loss_fn(c, mesh), specs, mesh=mesh, optimizer=fp.optim.adamw(1e-2, weight_decay=0.1),
                           zero=1, accum_steps=2, clip_norm=0.5)
    state = step.init(params)
    dp, k = mesh.axis_size("dp"), mesh.coord("dp")
    losses = []
    for b in batches():
        state, m = step(state, {n: x.chunk(dp)[k] for n, x in b.items()})
        losses.append(m["loss"])
    out = {"losses": losses, "params": fp.gather(state.params, specs, mesh)}
    if folder is not None:
        fp.hf.save(folder, state.params, model, c, mesh)  # no model module of funcpar involved
        back, c2 = fp.hf.load(folder, mesh=mesh)  # model found from config.json's model_type
        out["back"] = fp.gather(back, model.specs(c2, mesh), mesh)
        out["config"] = json.loads(open(f"{folder}/config.json").read())
    return out


def _train_on_mesh(folder):
    return _train(harness.mesh(tp=2, dp=2), folder)


def test_an_external_model_trains_at_tp2_dp2_and_round_trips_through_hf(tmp_path):
    ref = _train(fp.Mesh())
    got = harness.run(4, _train_on_mesh, str(tmp_path / "hf"))[0]
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    for (p, x), (_, y) in zip(fp.tree.leaves_with_path(got["params"]), fp.tree.leaves_with_path(ref["params"]), strict=True):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6), p
    for (p, x), (_, y) in zip(fp.tree.leaves_with_path(got["back"]), fp.tree.leaves_with_path(got["params"]), strict=True):
        assert torch.equal(x, y), p  # export then import at tp=2 x dp=2: the same bits
    assert got["config"]["model_type"] == "tinylm"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("tiny.embed.weight").shape == (V, 16)  # padding dropped
        assert f.get_tensor("tiny.h.1.fc_out.weight").shape == (32, 16)  # stored transposed, as the table says
    single, c = fp.hf.load(tmp_path / "hf")  # and at Mesh(), again through the registry
    assert torch.equal(single["layers"][1]["w_out"], got["params"]["layers"][1]["w_out"])


def _staged(mesh, which):
    model = fp.get_model(which)
    if which == "gpt2":
        c = model.config(dict(model_type="gpt2", vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32), mesh)
    elif which == "llama":
        c = model.config(dict(model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=24,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=True), mesh)
    else:
        c = model.config(cfg().to_hf(), mesh)
    specs = model.specs(c, mesh)
    params = fp.shard(model.init(c, seed=1), specs, mesh)
    b = batches(1)[0]
    whole = torch.func.grad_and_value(lambda p: model.loss(p, b, c, mesh))(params)
    staged = torch.func.grad_and_value(lambda p: model.stages.loss(p, b, c, mesh))(params)
    used = set(model.stages.embed_leaves(c)) | set(model.stages.head_leaves(c)) | {model.stages.layers}
    return whole, staged, used == set(params)


def _staged_tp2(which):
    return _staged(harness.mesh(tp=2), which)


@pytest.mark.parametrize("which", ["llama", "gpt2", "tinylm"])
def test_the_staged_form_equals_the_loss(which):
    for whole, staged, covers in [_staged(fp.Mesh(), which), *harness.run(2, _staged_tp2, which)]:
        assert covers  # embed leaves + blocks + head leaves name every top-level leaf
        assert torch.equal(whole[1], staged[1])
        for (p, x), (_, y) in zip(fp.tree.leaves_with_path(whole[0]), fp.tree.leaves_with_path(staged[0]), strict=True):
            assert torch.equal(x, y), p


def test_registry_lookups_and_errors():
    assert fp.get_model(llama) is llama.MODEL and fp.get_model("qwen2") is llama.MODEL
    assert fp.get_model(gpt2.MODEL) is gpt2.MODEL
    assert set(fp.known_models()) >= {"llama", "mistral", "qwen2", "gpt2", "tinylm"}
    with pytest.raises(fp.ModelError, match=r"no model is registered for 'nobody', and the installed transformers "
                                            r"defines no causal LM of that type; funcpar knows: baichuan, bloom"):
        fp.get_model("nobody")
    assert fp.get_model("falcon").name == "falcon (transformers)"  # (transformers' own: the generic path)
    other = fp.ModelSpec(**{**tinylm.MODEL.__dict__, "name": "impostor"})
    with pytest.raises(fp.ModelError, match=r"model_type 'tinylm' is already registered to model 'tinylm'"):
        fp.register_model(other)

    class NoHF:
        pass

    with pytest.raises(fp.ModelError, match=r"model 'broken': its Config has no from_hf\(\)"):
        fp.ModelSpec(**{**tinylm.MODEL.__dict__, "name": "broken", "Config": NoHF})
    with pytest.raises(fp.ModelError, match=r"model 'gpt2' does not support remat"):
        gpt2.MODEL.loss_fn(None, fp.Mesh(), remat=True)


def test_a_loss_carries_its_capabilities_as_fields():
    """``Loss.of`` is the one place a loss's capabilities are read: a model's ``loss_fn`` and a
    ``functools.partial`` of its ``loss`` carry the same ones (tokens as the weight, the batch check, the model for
    its staged form, remat); a bare function carries none, so it weighs rows and has no staged form."""
    import functools

    cfg = llama.Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    mesh = fp.Mesh()
    built = llama.MODEL.loss_fn(cfg, mesh, remat=True)
    named = fp.Loss.of(functools.partial(llama.loss, cfg=cfg, mesh=mesh, remat=True))
    for loss in (built, named):
        assert isinstance(loss, fp.Loss) and loss.model is llama.MODEL and loss.cfg is cfg and loss.mesh is mesh
        assert loss.remat and loss.batch_weight is fp.layers.count_targets and loss.stages is llama.MODEL.stages
        assert loss.init is llama.MODEL.init and loss.name == "llama"  # (the model's, for a pipeline's plan)
        assert loss.check_batch({"input_ids": torch.tensor([[cfg.vocab_size]])})  # out of range: named
    assert fp.Loss.of(built) is built
    partial = fp.Loss.of(functools.partial(llama.loss, cfg=None))  # no mesh: weighs tokens, no model to stage
    assert partial.batch_weight is fp.layers.count_targets and partial.model is None and not partial.remat
    bare = fp.Loss.of(lambda p, b: 0)
    assert (bare.model, bare.remat, bare.batch_weight, bare.check_batch, bare.stages) == (None, False, None, None, None)
    assert (bare.init, bare.name, bare.shapes()) == (None, None, None)
    with pytest.raises(fp.StepError, match="zero=3 gathers the model block by block"):
        fp.compile_step(bare, {}, mesh=mesh, zero=3)


def _no_hf_model(**kw):
    """tinylm without its HF form: no name table, no model_types, no Config (its config is any object)."""
    fields = {k: v for k, v in tinylm.MODEL.__dict__.items() if k not in ("hf", "model_types", "Config")}
    return fp.ModelSpec(**{**fields, "name": "nohf", **kw})


def test_a_model_without_an_hf_form_trains_and_hf_refuses_it_by_name(tmp_path):
    model = _no_hf_model()
    assert model.hf is None and model.model_types == ()
    mesh = fp.Mesh()
    c = cfg().with_mesh(mesh)
    specs = model.specs(c, mesh)
    step = fp.compile_step(model.loss_fn(c, mesh), specs, mesh=mesh, zero=3)  # the staged form, no HF needed
    _, metrics = step(step.init(model.init(c, seed=0)), batches(1)[0])
    assert metrics["loss"] > 0
    fp.register_model(model)
    assert fp.get_model("nohf") is model and "nohf" not in fp.known_models()  # (known_models: HF model_types)
    no_form = r"model 'nohf' has no HF form: {} needs its HF name table and config"
    with pytest.raises(fp.hf.HFError, match=no_form.format(r"fp\.hf\.save \(a transformers folder\)")):
        fp.hf.save(tmp_path / "out", model.init(c), model, c)
    tinylm_folder = tmp_path / "tiny"
    fp.hf.save(tinylm_folder, tinylm.init(c), tinylm.MODEL, c)
    with pytest.raises(fp.hf.HFError, match=no_form.format("reading .*tiny")):
        fp.hf.load(tinylm_folder, model)
    with pytest.raises(fp.ModelError, match=no_form.format("reading a config.json")):
        model.config(cfg().to_hf())
    with pytest.raises(fp.hf.HFError, match=no_form.format("mapping its leaves to HF tensor names")):
        fp.hf.name_plan(model, ["embed"])
    with pytest.raises(fp.ModelError, match=r"model 'half': model_types must be a non-empty tuple"):
        fp.ModelSpec(**{**tinylm.MODEL.__dict__, "name": "half", "model_types": ()})  # an HF table needs them
    with pytest.raises(fp.ModelError, match=r"config_types\['d_model'\] must be a tuple of JSON types"):
        _no_hf_model(config_types={"d_model": int})


def test_each_model_declares_the_json_types_of_its_own_config_keys():
    """A model's config_types check the keys it reads (its own with it: gpt2's n_embd is gpt2's, not llama's);
    the decoders share fp.DECODER_CONFIG_TYPES."""
    assert gpt2.MODEL.config_types["n_embd"] == (int,) and "n_embd" not in llama.MODEL.config_types
    assert fp.get_model("chatglm").config_types["multi_query_group_num"] == (int,)
    assert set(fp.DECODER_CONFIG_TYPES) <= set(llama.MODEL.config_types)
    with pytest.raises(fp.ModelError, match=r"config key 'd_model' is '16' \(a string\), expected an integer"):
        tinylm.MODEL.config({**cfg().to_hf(), "d_model": "16"})
    with pytest.raises(fp.ModelError, match=r"config key 'n_embd' is '16' \(a string\), expected an integer"):
        gpt2.MODEL.config(dict(model_type="gpt2", vocab_size=V, n_embd="16", n_layer=2, n_head=2))
    llama_keys = dict(model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4)
    assert llama.MODEL.config({**llama_keys, "n_embd": "ignored"}).hidden_size == 16  # not a llama key
