"""Vocabularies tp does not divide (101 tokens on tp = 2 and 4; GPT-2's 50257 in real life): padded rows that no
token uses, excluded from the loss, dropped on export. Exact against transformers and the single-process run."""

import functools

import pytest
import torch

import funcpar as fp
import harness
from funcpar.nn.layers import padded_vocab
from hf_fixtures import assert_identical, checkpoint_tensors

tf = pytest.importorskip("transformers")

V = 101


def test_padding_rule():
    assert padded_vocab(128, 4) == 128 and padded_vocab(264, 8) == 264
    assert [padded_vocab(V, tp) for tp in (1, 2, 4, 8)] == [128] * 4  # the same on every mesh
    assert padded_vocab(50257, 2) == 50304 and padded_vocab(264, 16) == 384


def test_an_unpadded_odd_vocabulary_is_refused_by_name():
    from funcpar.models import gpt2, llama

    mesh = fp.Mesh.abstract(tp=2)
    cfg = llama.Config.from_hf(dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, model_type="llama"))
    with pytest.raises(ValueError, match=r"vocab_size 101 \(101 rows\) is not divisible by tp=2: use cfg.with_mesh"):
        llama.specs(cfg, mesh)
    llama.specs(cfg.with_mesh(mesh), mesh)  # padded: fine
    g = gpt2.Config.from_hf(dict(vocab_size=V, n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(ValueError, match=r"vocab_size 101 \(101 rows\) is not divisible by tp=2"):
        gpt2.specs(g, mesh)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    out = {}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 12), generator=g)
    for kind, cfg in {
        "llama": tf.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        "gpt2": tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=32),
    }.items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg).eval()
        model.save_pretrained(root / kind)
        with torch.no_grad():
            ref = model(input_ids=ids, labels=ids)
        out[kind] = (str(root / kind), ref.logits, ref.loss.item(), {"input_ids": ids})
    return out


def _sharded(path, tp, b, export):
    mesh = harness.mesh(tp=tp)
    params, cfg = fp.hf.load(path, mesh=mesh)
    model = fp.get_model(cfg.model_type)
    specs = model.specs(cfg, mesh)
    logits = model.forward(params, b["input_ids"], cfg, mesh)
    loss, grads = torch.func.grad_and_value(lambda p: model.loss(p, b, cfg=cfg, mesh=mesh))(params)[::-1]
    fp.hf.save(export, params, model, cfg, mesh)
    return logits, loss.item(), fp.gather(grads, specs, mesh, dst=0), cfg.rows


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_odd_vocabulary_on_tp_2_and_4(ckpts, kind, tmp_path):
    path, logits_ref, loss_ref, b = ckpts[kind]
    params, cfg = fp.hf.load(path)
    model = fp.get_model(cfg.model_type)
    assert cfg.rows == 128 and (params["embed"] if kind == "llama" else params["wte"]).shape[0] == 128
    assert (model.forward(params, b["input_ids"], cfg, fp.Mesh()) - logits_ref).abs().max() <= 1e-5
    ref_grads = torch.func.grad(lambda p: model.loss(p, b, cfg=cfg, mesh=fp.Mesh()))(params)
    for tp in (2, 4):
        export = str(tmp_path / f"tp{tp}")
        results = harness.run(tp, _sharded, path, tp, b, export)
        logits = torch.cat([r[0] for r in results], -1)  # padded columns are not returned
        assert logits.shape == logits_ref.shape
        assert (logits - logits_ref).abs().max() <= 1e-5, (kind, tp)
        for _, loss, _, rows in results:
            assert abs(loss - loss_ref) <= 1e-5 * loss_ref and rows == 128
        grads = results[0][2]
        for (name, g), (_, r) in zip(fp.tree.leaves_with_path(grads), fp.tree.leaves_with_path(ref_grads), strict=True):
            assert (g - r).abs().max() <= 1e-5 * r.abs().max() + 1e-9, (kind, tp, name)
        table = grads["embed"] if kind == "llama" else grads["wte"]
        assert table[V:].abs().max() == 0  # padding rows learn nothing
        assert_identical(checkpoint_tensors(path), checkpoint_tensors(export))  # exports drop the padding


def _train(sizes, path, steps):
    mesh = harness.mesh(**sizes) if sizes else fp.Mesh()
    params, cfg = fp.hf.load(path, mesh=mesh)
    model = fp.get_model(cfg.model_type)
    step = fp.compile_step(functools.partial(model.loss, cfg=cfg, mesh=mesh), model.specs(cfg, mesh), mesh=mesh,
                           optimizer=fp.optim.adamw(1e-2, weight_decay=0.1), zero=1, clip_norm=1.0)
    state = step.init(params)
    losses = []
    dp, c = mesh.axis_size("dp"), mesh.coord("dp")
    for k in range(steps):
        ids = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(k))
        state, m = step(state, {"input_ids": ids.chunk(dp)[c]})
        losses.append(m["loss"])
    return losses


def test_training_with_an_odd_vocabulary_matches_single_process(ckpts):
    path = ckpts["llama"][0]
    single = _train(None, path, 3)
    for losses in harness.run(4, _train, {"tp": 2, "dp": 2}, path, 3):
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, single, strict=True)), (losses, single)
