"""GLM (transformers' GlmForCausalLM, model_type "glm") against transformers and against the single-process run.

Two tiny checkpoints made from configs: GQA with 8 query / 2 kv heads, head_dim 16 (q wider than the hidden size),
half of each head rotated, q/k/v bias and a padding token; and a tied head without bias, all of each head rotated,
on a vocabulary tp does not divide. Logits, loss and gradients against transformers at Mesh(), tp=2 and tp=4
(where the 2 kv heads are replicated); three AdamW steps at tp=2, tp=4, pp=2, tp=2 x dp=2 (ZeRO-1 and ZeRO-3)
against the single-process run and against transformers + torch.optim.AdamW; config.json and tensors round trips.
"""

import collections
import json
import math
import os
import tempfile

import pytest
import torch

import funcpar as fp
import harness
from funcpar import P
from funcpar.models import glm
from hf_fixtures import GLM_CONFIGS as CONFIGS, GLM_PAD as PAD, assert_identical, checkpoint_tensors

tf = pytest.importorskip("transformers")

Ref = collections.namedtuple("Ref", "path logits loss grads batch")
DROP = "(the key left out)"


def make_batch(vocab, seed=1, rows=2, T=12):
    ids = torch.randint(0, vocab, (rows, T), generator=torch.Generator().manual_seed(seed))
    ids[0, 7] = ids[rows - 1, 2] = PAD
    labels = ids.clone()
    labels[0, :3] = -100  # some ignored positions
    return {"input_ids": ids, "labels": labels}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    out = {}
    for kind, make in CONFIGS.items():
        torch.manual_seed(0)
        model = tf.GlmForCausalLM(make()).eval()
        with torch.no_grad():  # non-trivial norms and biases, so that a mix-up would show
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
            if model.config.pad_token_id is not None:  # a padding row that is not zero: lookups show it
                model.model.embed_tokens.weight[PAD] = torch.randn(model.config.hidden_size) * 0.02
        model.save_pretrained(root / kind)
        b = make_batch(model.config.vocab_size)
        res = model(**b)
        res.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        out[kind] = Ref(str(root / kind), res.logits.detach(), res.loss.item(), grads, b)
    return out


def raw_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def rel(a, b):
    return abs(a - b) / abs(b)


def leaves(tree):
    return fp.tree.leaves_with_path(tree)


def close(got, ref, what):
    """Every leaf within 1e-5 of the reference's largest entry (+1e-9 for a gradient that is mathematically zero:
    a key bias's pass-through dims, which softmax ignores)."""
    for (name, g), (name_r, r) in zip(leaves(got), leaves(ref), strict=True):
        assert name == name_r and g.shape == r.shape, (what, name, name_r)
        err = (g - r).abs().max().item()
        assert err <= 1e-5 * r.abs().max().item() + 1e-9, (what, name, err)


# ------------------------------------------------------------------------------------------------- config


def test_config_round_trips_through_config_json_and_transformers(ckpts):
    for kind, ref in ckpts.items():
        raw = raw_config(ref.path)
        cfg = glm.MODEL.config(raw)
        assert glm.Config.from_hf(cfg.to_hf()) == cfg
        assert cfg.to_hf() == raw  # nothing lost, nothing added
    cfg = glm.MODEL.config(raw_config(ckpts["glm"].path))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.pad_token_id) == (16, 8, 500.0, PAD)
    # transformers 4 style (rope settings at the top level) stays in that style
    old = {k: v for k, v in cfg.to_hf().items() if k != "rope_parameters"} | {"rope_theta": 500.0,
                                                                              "partial_rotary_factor": 0.25}
    c4 = glm.MODEL.config(old)
    assert (c4.rotary_dim, c4.rope_theta) == (4, 500.0) and c4.to_hf() == old
    hf4 = tf.GlmConfig.from_dict(old).rope_parameters
    assert (hf4["partial_rotary_factor"], hf4["rope_theta"]) == (0.25, 500.0)
    # an absent key means GlmConfig's default, as transformers reads it
    sizes = dict(model_type="glm", vocab_size=151552, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4)
    c, t = glm.MODEL.config(sizes), tf.GlmConfig.from_dict(sizes)
    assert (c.head_dim, c.num_key_value_heads, c.rms_norm_eps, c.pad_token_id, c.tie_word_embeddings,
            c.attention_bias, c.partial_rotary_factor, c.rope_theta) == (
        t.head_dim, t.num_key_value_heads, t.rms_norm_eps, t.pad_token_id, t.tie_word_embeddings,
        t.attention_bias, t.rope_parameters["partial_rotary_factor"], t.rope_parameters["rope_theta"])


@pytest.mark.parametrize("edit, message", [
    ({"vocab_size": DROP}, r"config key 'vocab_size' is missing"),
    ({"hidden_act": "gelu"}, r"config key 'hidden_act' is 'gelu': funcpar's glm model supports 'silu' only"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"config key 'rope_parameters' .*rope_type 'yarn'"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": "0.5"}},
     r"config key 'partial_rotary_factor' is '0.5': expected a number"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     r"config key 'partial_rotary_factor' is 1.5: expected a number in \(0, 1\]"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     r"config key 'partial_rotary_factor' is 0.1: it rotates int\(16 \* 0.1\) = 1 dimensions"),
    ({"pad_token_id": 151329}, r"config key 'pad_token_id' is 151329: .* \[0, 128\)"),
    ({"num_key_value_heads": 3}, r"config key 'num_attention_heads' is 8: not a multiple of num_key_value_heads=3"),
    ({"head_dim": None}, r"config key 'head_dim' is None"),
    ({"head_dim": "16"}, r"config key 'head_dim' is '16' \(a string\)"),
    ({"model_type": "chatglm"}, r"config key 'model_type' is 'chatglm'"),
])
def test_bad_config_keys_are_named(ckpts, edit, message):
    raw = raw_config(ckpts["glm"].path)
    d = {k: v for k, v in (raw | edit).items() if v is not DROP}
    with pytest.raises(ValueError, match=message):
        glm.MODEL.config(d)


# -------------------------------------------------------------------------------------------- Mesh()


def test_logits_loss_and_gradients_match_transformers(ckpts, tmp_path):
    mesh = fp.Mesh()
    for kind, ref in ckpts.items():
        params, cfg = fp.hf.load(ref.path)
        assert fp.get_model(cfg.model_type) is glm.MODEL
        logits = glm.forward(params, ref.batch["input_ids"], cfg, mesh)
        assert logits.shape == ref.logits.shape
        assert (logits - ref.logits).abs().max().item() <= 1e-5, kind
        grads, loss = torch.func.grad_and_value(lambda p: glm.loss(p, ref.batch, cfg, mesh))(params)
        assert rel(loss.item(), ref.loss) <= 1e-5, kind
        fp.hf.save(tmp_path / kind, grads, glm.MODEL, cfg)  # the gradients under transformers' names
        got = checkpoint_tensors(tmp_path / kind)
        assert sorted(got) == sorted(ref.grads), kind
        for name, r in ref.grads.items():
            assert (got[name] - r).abs().max().item() <= 1e-5 * r.abs().max().item() + 1e-9, (kind, name)
        if cfg.pad_token_id is not None:  # nn.Embedding(padding_idx=PAD): looked up, yet no gradient
            table = got["model.embed_tokens.weight"]
            assert table[PAD].abs().max() == 0 and ref.grads["model.embed_tokens.weight"][PAD].abs().max() == 0
            assert table[ref.batch["input_ids"][0, 0]].abs().max() > 0
        # recomputing each layer, and the staged form pipelines cut, give the same bits
        remat_g, remat_l = torch.func.grad_and_value(lambda p: glm.loss(p, ref.batch, cfg, mesh, remat=True))(params)
        assert torch.equal(remat_l, loss) and torch.equal(glm.MODEL.stages.loss(params, ref.batch, cfg, mesh), loss)
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(leaves(remat_g), leaves(grads), strict=True)), kind


# ------------------------------------------------------------------------------------- tensor parallel


def _sharded(path, tp, b, export):
    mesh = harness.mesh(tp=tp)
    params, cfg = fp.hf.load(path, mesh=mesh)
    specs = glm.specs(cfg, mesh)
    logits = glm.forward(params, b["input_ids"], cfg, mesh)
    grads, loss = torch.func.grad_and_value(lambda p: glm.loss(p, b, cfg, mesh))(params)
    staged = glm.MODEL.stages.loss(params, b, cfg, mesh)  # the form pipeline stages cut
    fp.hf.save(export, params, glm.MODEL, cfg, mesh)
    return (logits, loss.item(), fp.gather(grads, specs, mesh, dst=0), specs["layers"][0]["wk"], cfg.rows,
            staged.item())


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_transformers_and_single_process(ckpts, tp, tmp_path):
    for kind, ref in ckpts.items():
        params, cfg = fp.hf.load(ref.path)
        ref_grads = torch.func.grad(lambda p: glm.loss(p, ref.batch, cfg, fp.Mesh()))(params)
        export = str(tmp_path / kind)
        results = harness.run(tp, _sharded, ref.path, tp, ref.batch, export)
        logits = torch.cat([r[0] for r in results], dim=-1)  # vocab blocks in tp order, padding dropped
        assert logits.shape == ref.logits.shape
        assert (logits - ref.logits).abs().max().item() <= 1e-5, (kind, tp)
        for _, loss, _, wk_spec, rows, staged in results:
            assert rel(loss, ref.loss) <= 1e-5 and staged == loss, (kind, tp)
            assert rows == 128 and wk_spec == (P() if kind == "glm" and tp == 4 else P("tp", None)), (kind, tp)
        grads = results[0][2]
        close(grads, ref_grads, (kind, tp))
        assert grads["embed"][cfg.vocab_size:].abs().sum() == 0  # tp padding rows (if any) learn nothing
        assert_identical(checkpoint_tensors(ref.path), checkpoint_tensors(export))  # exported from the mesh: the same bytes


# -------------------------------------------------------------------------------------------- training

LR, WD, STEPS = 1e-3, 0.1, 3


def train_batches(vocab):
    out = []
    for s in range(STEPS):
        b = make_batch(vocab, seed=10 + s, rows=8)
        b["labels"][s + 1, : 4 + s] = -100  # micro-batches and dp ranks hold different numbers of targets
        out.append(b)
    return out


def train(path, mesh, zero=1):
    params, cfg = fp.hf.load(path, mesh=mesh)
    specs = glm.specs(cfg, mesh)
    step = fp.compile_step(glm.MODEL.loss_fn(cfg, mesh), specs, mesh=mesh,
                           optimizer=fp.optim.adamw(LR, weight_decay=WD), zero=zero, accum_steps=2)
    state = step.init(params)
    losses = []
    for b in train_batches(cfg.vocab_size):
        state, m = step(state, harness.dp_share(b, mesh))
        losses.append(m["loss"])
    return losses, fp.gather(step.gather_params(state) if zero == 3 else state.params, specs, mesh, dst=0)


def _train_on(path, runs):
    return [train(path, harness.mesh(**sizes), zero) for sizes, zero in runs]


def peer(path):
    """transformers' GlmForCausalLM + torch.optim.AdamW on the same weights and global batches."""
    model = tf.GlmForCausalLM.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for b in train_batches(model.config.vocab_size):
        opt.zero_grad()
        out = model(**b)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return losses, fp.hf.load(d)[0]


def test_adamw_steps_match_single_process_and_transformers(ckpts):
    path = ckpts["glm"].path
    init = fp.hf.load(path)[0]
    ref_losses, ref = train(path, fp.Mesh())

    def assert_same(losses, params, what):
        assert all(rel(a, b) <= 1e-5 for a, b in zip(losses, ref_losses, strict=True)), (what, losses, ref_losses)
        # within 1e-5 of the model's norm, not element by element: Adam's step m / sqrt(v) does not shrink with the
        # gradient, so an entry whose true gradient is zero (a key bias's pass-through dims: softmax ignores a shift
        # shared by all keys) or nearly so moves by up to the learning rate on round-off no two summation orders share
        diff = math.sqrt(sum((x - y).pow(2).sum().item() for (_, x), (_, y) in zip(leaves(params), leaves(ref), strict=True)))
        norm = math.sqrt(sum(y.pow(2).sum().item() for _, y in leaves(ref)))
        assert diff <= 1e-5 * norm, (what, diff / norm)
        # the padding row: no gradient, so no Adam step, only the weight decay
        decayed = init["embed"][PAD] * (1 - LR * WD) ** STEPS
        assert init["embed"][PAD].abs().min() > 0 and torch.allclose(params["embed"][PAD], decayed, rtol=1e-6), what

    p_losses, p_params = peer(path)
    assert_same(p_losses, p_params, "transformers + torch.optim.AdamW")
    runs2 = [({"tp": 2}, 1), ({"pp": 2}, 1)]
    runs4 = [({"tp": 2, "dp": 2}, 1), ({"tp": 2, "dp": 2}, 3), ({"tp": 4}, 1)]  # tp=4: the 2 kv heads replicated
    for runs, world in ((runs2, 2), (runs4, 4)):
        for (sizes, zero), (losses, params) in zip(runs, harness.run(world, _train_on, path, runs)[0], strict=True):
            assert_same(losses, params, f"{sizes} zero={zero}")


# ------------------------------------------------------------------------------------------ round trip


def test_round_trip_is_byte_identical_and_loads_in_transformers(ckpts, tmp_path):
    for kind, ref in ckpts.items():
        params, cfg = fp.hf.load(ref.path)
        out = tmp_path / kind
        fp.hf.save(out, params, glm.MODEL, cfg, max_shard_size="40KB")  # several files and an index
        assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
        assert_identical(checkpoint_tensors(ref.path), checkpoint_tensors(out))
        hf_model = tf.GlmForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            assert (hf_model(input_ids=ref.batch["input_ids"]).logits - ref.logits).abs().max().item() <= 1e-6, kind
        again, cfg2 = fp.hf.load(out)
        assert cfg2 == cfg and all(torch.equal(x, y) for (_, x), (_, y) in zip(leaves(again), leaves(params), strict=True))
