"""Models against transformers and the HF import/export layer: logits and loss at Mesh(), tp=2 and tp=4;
byte-identical round trips (single and multi-file); per-rank bytes read; errors that name the tensor."""

import json
import re
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

import funcpar as fp
import harness
from funcpar import P
from hf_fixtures import MAX_TP, assert_identical, batch, checkpoint_tensors, make_checkpoint

KINDS = ["llama", "mistral", "qwen2", "llama_tied", "gpt2"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in KINDS:
        model = make_checkpoint(kind, str(root / kind))
        b = batch()
        with torch.no_grad():
            ref = model(**b)
        out[kind] = (str(root / kind), ref.logits, ref.loss, b)
    return out


def test_logits_and_loss_match_transformers_single_process(ckpts):
    for kind in KINDS:
        path, logits_ref, loss_ref, b = ckpts[kind]
        params, cfg = fp.hf.load(path)
        model = fp.get_model(cfg.model_type)
        logits = model.forward(params, b["input_ids"], cfg, fp.Mesh())
        assert (logits - logits_ref).abs().max().item() <= 1e-5, kind
        loss = model.loss(params, b, cfg=cfg, mesh=fp.Mesh())
        assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item()), kind


def _sharded_forward(path, tp, b):
    mesh = harness.mesh(tp=tp)
    params, cfg = fp.hf.load(path, mesh=mesh)
    model = fp.get_model(cfg.model_type)
    logits = model.forward(params, b["input_ids"], cfg, mesh)
    loss = model.loss(params, b, cfg=cfg, mesh=mesh)
    # gradients flow through the vocab-parallel loss: every rank's gradient is finite and the loss is replicated
    grads = torch.func.grad(lambda p: model.loss(p, b, cfg=cfg, mesh=mesh))(params)
    return logits, loss, all(torch.isfinite(g).all() for g in fp.tree.leaves_with_path(grads) for g in [g[1]])


@pytest.mark.parametrize("tp", [2, 4])
def test_logits_and_loss_match_transformers_tensor_parallel(ckpts, tp):
    for kind in KINDS:
        if tp > MAX_TP[kind]:
            continue
        path, logits_ref, loss_ref, b = ckpts[kind]
        results = harness.run(tp, _sharded_forward, path, tp, b)
        logits = torch.cat([r[0] for r in results], dim=-1)  # vocab blocks in tp order
        assert results[0][0].shape[-1] == 128 // tp, "logits are vocab-sharded"
        assert (logits - logits_ref).abs().max().item() <= 1e-5, (kind, tp)
        for _, loss, finite in results:
            assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item()), (kind, tp)
            assert finite


def test_round_trip_is_byte_identical_and_loads_in_transformers(ckpts, tmp_path):
    import transformers as tf

    for kind in KINDS:
        path, logits_ref, _, b = ckpts[kind]
        params, cfg = fp.hf.load(path)
        model = fp.get_model(cfg.model_type)
        out = tmp_path / kind
        fp.hf.save(out, params, model, cfg)
        assert_identical(checkpoint_tensors(path), checkpoint_tensors(out))
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "no temporary folder left behind"
        # a sharded (multi-file) export: index + several files, same bytes, loads in transformers and in funcpar
        sharded = tmp_path / f"{kind}-sharded"
        fp.hf.save(sharded, params, model, cfg, max_shard_size="40KB")
        files = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
        assert len(files) > 2 and (sharded / "model.safetensors.index.json").exists()
        assert_identical(checkpoint_tensors(path), checkpoint_tensors(sharded))
        hf_model = tf.AutoModelForCausalLM.from_pretrained(sharded).eval()
        with torch.no_grad():
            assert (hf_model(input_ids=b["input_ids"]).logits - logits_ref).abs().max().item() <= 1e-6
        again, _ = fp.hf.load(sharded)
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(fp.tree.leaves_with_path(again), fp.tree.leaves_with_path(params), strict=True))


def _export_from_mesh(path, out, tp):
    mesh = harness.mesh(tp=tp)
    params, cfg = fp.hf.load(path, mesh=mesh)
    fp.hf.save(out, params, fp.get_model(cfg.model_type), cfg, mesh, max_shard_size="100KB")
    return mesh.rank


def test_export_from_a_tensor_parallel_mesh(ckpts, tmp_path):
    for kind in ("llama", "gpt2"):
        out = str(tmp_path / kind)
        harness.run(4, _export_from_mesh, ckpts[kind][0], out, 4)
        assert_identical(checkpoint_tensors(ckpts[kind][0]), checkpoint_tensors(out))


def _rchar():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _bytes_read(path, tp):
    mesh = harness.mesh(tp=tp)
    model = fp.get_model(json.load(open(os.path.join(path, "config.json")))["model_type"])
    before = _rchar()
    stats = {}
    params, cfg = fp.hf.load(path, model, mesh, stats=stats)
    io = _rchar() - before
    sharded = replicated = 0
    for (_, spec, x) in fp.spec.broadcast_specs(model.specs(cfg), params):
        nb = x.numel() * x.element_size() * (mesh.axis_size("tp") if "tp" in spec.axes else 1)
        if "tp" in spec.axes:
            sharded += nb
        else:
            replicated += nb
    return stats["bytes_read"], io, sharded, replicated


def test_each_rank_reads_only_its_slices(ckpts):
    for kind in ("llama", "gpt2"):
        for counted, io, sharded, replicated in harness.run(4, _bytes_read, ckpts[kind][0], 4):
            assert counted == sharded // 4 + replicated  # exactly its blocks
            # what the kernel saw this process read (headers and config.json included)
            assert io <= (sharded // 4 + replicated) * 1.02 + 16384, (kind, io, sharded, replicated)
            assert sharded > 4 * replicated  # the measurement is dominated by sharded tensors


# --------------------------------------------------------------------------------------------------- errors


def _copy(src, dst, edit=None, config_edit=None):
    shutil.copytree(src, dst)
    if edit:
        t = checkpoint_tensors(dst)
        edit(t)
        save_file(t, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if config_edit:
        c = json.load(open(os.path.join(dst, "config.json")))
        config_edit(c)
        json.dump(c, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_checkpoint_errors_name_the_tensor(ckpts, tmp_path):
    src = ckpts["llama"][0]
    from funcpar.models import llama

    def drop_layer(t):
        for k in [k for k in t if k.startswith("model.layers.1.")]:
            del t[k]
        t["model.extra.weight"] = torch.zeros(3)
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32)

    bad = _copy(src, str(tmp_path / "bad"), edit=drop_layer)
    with pytest.raises(fp.hf.HFError) as e:
        fp.hf.load(bad, llama)
    msg = str(e.value)
    assert "does not match model 'llama'" in msg
    assert "missing (9): model.layers.1.input_layernorm.weight [64]" in msg and "model.layers.1.mlp.down_proj.weight [64, 96]" in msg
    assert "unexpected (1): model.extra.weight [3] in model.safetensors" in msg
    assert "wrong shape (1): model.layers.0.self_attn.q_proj.weight is [64, 32], expected [64, 64]" in msg

    # a type neither funcpar nor transformers defines (transformers' own types take the generic path)
    unknown = _copy(src, str(tmp_path / "nobody"), config_edit=lambda c: c.update(model_type="nobody"))
    known = ", ".join(sorted(fp.known_models()))  # every built-in model_type (and any a test registered), sorted
    assert {"llama", "mistral", "qwen2", "gpt2", "bloom", "glm", "baichuan"} <= set(fp.known_models())
    with pytest.raises(fp.hf.HFError, match=r"model_type 'nobody', which funcpar does not know; it knows: "
                                            + re.escape(known) + r" \(register"):
        fp.hf.load(unknown)
    with pytest.raises(fp.hf.HFError, match=r"model_type 'gpt2', which model 'llama' does not implement \(llama, mistral, qwen2\)"):
        fp.hf.load(ckpts["gpt2"][0], llama)

    truncated = _copy(src, str(tmp_path / "trunc"))
    f = os.path.join(truncated, "model.safetensors")
    os.truncate(f, os.path.getsize(f) - 100)
    with pytest.raises(fp.hf.HFError, match=r"corrupt safetensors file .*trunc/model.safetensors: tensor '.*' ends at byte \d+ but the file has \d+ bytes"):
        fp.hf.load(truncated)
    garbage = _copy(src, str(tmp_path / "garbage"))
    with open(os.path.join(garbage, "model.safetensors"), "r+b") as fh:
        fh.seek(8)
        fh.write(b"{not json")
    with pytest.raises(fp.hf.HFError, match=r"corrupt safetensors file .*garbage/model.safetensors: its header is not valid JSON"):
        fp.hf.load(garbage)
    with pytest.raises(fp.hf.HFError, match=r"has neither model.safetensors nor model.safetensors.index.json"):
        os.remove(os.path.join(garbage, "model.safetensors"))
        fp.hf.load(garbage)
    with pytest.raises(fp.hf.HFError, match=r"has no config.json"):
        fp.hf.load(str(tmp_path))


def _heads_cut(path):
    from funcpar.models import llama

    mesh = harness.mesh(tp=4)
    params, cfg = fp.hf.load(path, llama, mesh, specs=llama.specs(cfg=llama.Config.from_hf(json.load(open(os.path.join(path, "config.json"))))))
    try:
        llama.forward(params, torch.zeros(1, 4, dtype=torch.long), cfg, mesh)
    except ValueError as e:
        return str(e)


def test_a_plan_that_cuts_kv_heads_is_refused(ckpts):
    # 2 kv heads x 16 rows split over tp=4 divides by rows but not by heads: the model must refuse, not compute garbage
    for msg in harness.run(4, _heads_cut, ckpts["mistral"][0]):
        assert "the tp plan cuts attention heads apart (local wq (16, 64), wk (8, 64), head_dim 16, tp=4)" in msg
        assert "specs(cfg, mesh)" in msg


def test_export_is_atomic_when_writing_fails(ckpts, tmp_path, monkeypatch):
    params, cfg = fp.hf.load(ckpts["llama"][0])
    from funcpar.models import llama

    out = tmp_path / "export"
    fp.hf.save(out, params, llama, cfg)
    before = checkpoint_tensors(out)
    import safetensors.torch as st

    calls = {"n": 0}
    real = st.save_file

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(st, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        fp.hf.save(out, {**params, "norm": params["norm"] + 1}, llama, cfg, max_shard_size="40KB")
    monkeypatch.undo()
    assert_identical(before, checkpoint_tensors(out))  # the previous export is untouched
    assert sorted(os.listdir(tmp_path)) == ["export"]  # and no temporary folder is left


# ----------------------------------------------------------------------------------------------- auto_specs


def test_auto_specs_match_the_hand_written_plans(ckpts):
    from funcpar.models import llama

    for kind, model in (("llama", llama), ("qwen2", llama), ("llama_tied", llama)):
        path = ckpts[kind][0]
        params, cfg = fp.hf.load(path)
        auto = fp.hf.auto_specs(path)
        plan = fp.hf.name_plan(model, [p for p, _ in fp.tree.leaves_with_path(params)])
        for (p, spec, _), mp in zip(fp.spec.broadcast_specs(model.specs(cfg), params), plan, strict=True):
            assert auto[mp.hf] == spec, (kind, p, mp.hf, auto[mp.hf], spec)
    auto = fp.hf.auto_specs(ckpts["gpt2"][0])
    assert auto["transformer.wte.weight"] == P("tp", None)
    assert auto["transformer.h.0.mlp.c_fc.weight"] == P(None, "tp")  # Conv1D (in, out): column = split dim 1
    assert auto["transformer.h.0.mlp.c_fc.bias"] == P("tp")
    assert auto["transformer.h.0.mlp.c_proj.weight"] == P("tp", None) and auto["transformer.h.0.mlp.c_proj.bias"] == P()
    assert auto["transformer.h.0.attn.c_attn.weight"] == P()  # fused q/k/v: replicated, never split blindly
    assert auto["transformer.h.0.ln_1.weight"] == P() and auto["transformer.wpe.weight"] == P()


def test_auto_specs_plan_an_unlisted_architecture():
    # GPT-NeoX / Pythia names, which funcpar has no model for
    names = {
        "gpt_neox.embed_in.weight": (512, 64),
        "gpt_neox.layers.0.input_layernorm.weight": (64,),
        "gpt_neox.layers.0.attention.query_key_value.weight": (192, 64),
        "gpt_neox.layers.0.attention.dense.weight": (64, 64),
        "gpt_neox.layers.0.attention.dense.bias": (64,),
        "gpt_neox.layers.0.mlp.dense_h_to_4h.weight": (256, 64),
        "gpt_neox.layers.0.mlp.dense_h_to_4h.bias": (256,),
        "gpt_neox.layers.0.mlp.dense_4h_to_h.weight": (64, 256),
        "embed_out.weight": (512, 64),
    }
    auto = fp.hf.auto_specs(names)
    assert auto == {
        "gpt_neox.embed_in.weight": P("tp", None),
        "gpt_neox.layers.0.input_layernorm.weight": P(),
        "gpt_neox.layers.0.attention.query_key_value.weight": P(),
        "gpt_neox.layers.0.attention.dense.weight": P(None, "tp"),
        "gpt_neox.layers.0.attention.dense.bias": P(),
        "gpt_neox.layers.0.mlp.dense_h_to_4h.weight": P("tp", None),
        "gpt_neox.layers.0.mlp.dense_h_to_4h.bias": P("tp"),
        "gpt_neox.layers.0.mlp.dense_4h_to_h.weight": P(None, "tp"),
        "embed_out.weight": P("tp", None),
    }


def test_load_converts_dtype(ckpts):
    params, _ = fp.hf.load(ckpts["qwen2"][0], dtype=torch.bfloat16)
    assert {x.dtype for _, x in fp.tree.leaves_with_path(params)} == {torch.bfloat16}


def _sharded_grads(path, tp, b):
    mesh = harness.mesh(tp=tp)
    params, cfg = fp.hf.load(path, mesh=mesh)
    model = fp.get_model(cfg.model_type)
    specs = model.specs(cfg, mesh)
    grads = torch.func.grad(lambda p: model.loss(p, b, cfg=cfg, mesh=mesh))(params)
    return fp.gather(grads, specs, mesh, dst=0)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])
def test_gathered_gradients_equal_single_process(ckpts, kind):
    path, _, _, b = ckpts[kind]
    params, cfg = fp.hf.load(path)
    model = fp.get_model(cfg.model_type)
    ref = torch.func.grad(lambda p: model.loss(p, b, cfg=cfg, mesh=fp.Mesh()))(params)
    got = harness.run(4, _sharded_grads, path, 4, b)[0]
    for (name, g), (_, r) in zip(fp.tree.leaves_with_path(got), fp.tree.leaves_with_path(ref), strict=True):
        err = (g - r).abs().max().item()
        # + 1e-9: GPT-2's key bias has a mathematically zero gradient (softmax ignores a shift shared by all keys)
        assert err <= 1e-5 * r.abs().max().item() + 1e-9, (kind, name, err)


def test_loss_mask_equals_ignored_labels_and_transformers(ckpts):
    import transformers as tf

    path, _, _, b = ckpts["qwen2"]
    params, cfg = fp.hf.load(path)
    from funcpar.models import llama

    mask = torch.ones_like(b["input_ids"])
    mask[:, 5:8] = 0  # e.g. prompt tokens of an SFT sample
    masked = llama.loss(params, {"input_ids": b["input_ids"], "loss_mask": mask}, cfg, fp.Mesh())
    labels = b["input_ids"].masked_fill(mask == 0, -100)
    as_labels = llama.loss(params, {"input_ids": b["input_ids"], "labels": labels}, cfg, fp.Mesh())
    with torch.no_grad():
        ref = tf.AutoModelForCausalLM.from_pretrained(path)(input_ids=b["input_ids"], labels=labels).loss
    assert masked.item() == as_labels.item()
    assert abs(masked.item() - ref.item()) <= 1e-5 * ref.item()
    unmasked = llama.loss(params, {"input_ids": b["input_ids"]}, cfg, fp.Mesh())
    assert abs(unmasked.item() - masked.item()) > 1e-4  # the mask changes the loss
