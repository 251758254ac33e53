"""``fp.verify`` on real gloo meshes: it passes correct models and finds planted mistakes, naming the leaf and kind.

The mistakes are the ones a person adding a model makes (tests/tinylm.py is such a model): a row-parallel output not
summed, a replicated input to sharded work without ``copy_to_region``, a collective applied twice, a leaf spec'd
replicated that the model uses as a shard, a leaf split on the wrong dimension.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import funcpar as fp
import harness
import tinylm
from funcpar import P
from funcpar.parallel import collectives as C

V = 64


def _cfg():
    return tinylm.Config(vocab_size=V, d_model=16, d_hidden=32, n_layers=2)


def _batches():
    return harness.token_batches(2, V, 4, 8, seed=7, masked=3)


# the planted mistakes: each a block or a spec change of tinylm
def _no_reduce(lp, x, i, cfg, mesh):  # the row-parallel output is never summed over tp
    h = C.copy_to_region(tinylm._norm(x, lp["norm"], cfg.eps), mesh, "tp")
    return x + F.linear(F.gelu(F.linear(h, lp["w_in"])), lp["w_out"])


def _no_copy(lp, x, i, cfg, mesh):  # the replicated input feeds sharded work without copy_to_region
    h = tinylm._norm(x, lp["norm"], cfg.eps)
    return x + C.reduce_from_region(F.linear(F.gelu(F.linear(h, lp["w_in"])), lp["w_out"]), mesh, "tp")


def _copy_twice(lp, x, i, cfg, mesh):  # copy_to_region twice: the backward sums the input's gradient twice
    h = C.copy_to_region(C.copy_to_region(tinylm._norm(x, lp["norm"], cfg.eps), mesh, "tp"), mesh, "tp")
    return x + C.reduce_from_region(F.linear(F.gelu(F.linear(h, lp["w_in"])), lp["w_out"]), mesh, "tp")


def _loss_with(block):
    def loss(params, batch, cfg, mesh):
        x = tinylm._embed(params, batch, cfg, mesh)
        for i, lp in enumerate(params["layers"]):
            x = block(lp, x, i, cfg, mesh)
        return tinylm._head(params, x, batch, cfg, mesh)
    return loss


def _specs(change=None):
    specs = tinylm.specs(_cfg())
    if change == "head_replicated":
        specs["head"] = P()
    if change == "w_in_columns":
        for layer in specs["layers"]:
            layer["w_in"] = P(None, "tp")
    return specs


CASES = {
    "correct": (tinylm._block, None),
    "no_reduce": (_no_reduce, None),
    "no_copy": (_no_copy, None),
    "copy_twice": (_copy_twice, None),
    "head_replicated": (tinylm._block, "head_replicated"),
    "w_in_columns": (tinylm._block, "w_in_columns"),
}


def _verify(name):
    mesh = harness.mesh(tp=2, dp=2)
    block, change = CASES[name]
    loss = _loss_with(block)
    report = fp.verify(lambda m: fp.Loss(fn=functools.partial(loss, cfg=_cfg(), mesh=m),
                                         batch_weight=fp.layers.count_targets), _specs(change),
                       tinylm.init(_cfg(), seed=0), _batches(), mesh)
    return report.ok, str(report), report.first.path if report.first else None


def _all():
    return {name: _verify(name) for name in CASES}


@pytest.fixture(scope="module")
def reports():
    out = harness.run(4, _all)
    assert all(o == out[0] for o in out)  # every rank reaches the same verdict
    return out[0]


def test_verify_passes_the_correct_model(reports):
    ok, text, first = reports["correct"]
    assert ok and first is None and "agrees with one process: 2 step(s)" in text, text


@pytest.mark.parametrize("name,expect", [
    ("no_reduce", r"the first step's loss already differs .*a row-parallel output without reduce_from_region"),
    ("no_copy", r"leaf 'layers\.\d\.norm' P\(\).*its copies over 'tp' get different gradients.*without copy_to_region"),
    ("copy_twice", r"leaf 'layers\.1\.norm' P\(\): gradient off by .* 2 times the reference, the size of 'tp'"),
    ("head_replicated", r"leaf 'head' P\(\).*its copies over 'tp' get different gradients: it is replicated over "
                        r"'tp' but used as a shard"),
    ("w_in_columns", r"raised: .*check the specs of the leaves"),
])
def test_verify_finds_a_planted_mistake_and_says_what_kind(reports, name, expect):
    import re

    ok, text, _ = reports[name]
    assert not ok and re.search(expect, text, re.S), text


def _builtin(name):
    """A built-in model on a small config (tests/hf_fixtures.py's) on tp=2 x dp=2, Mixtral on ep=2 x tp=2 (ep a data
    axis): each agrees with one process."""
    from hf_fixtures import CONFIGS

    sizes, data_axes = ({"ep": 2, "tp": 2}, ("dp", "ep")) if name == "mixtral" else ({"tp": 2, "dp": 2}, ("dp",))
    mesh = harness.mesh(**sizes)
    model = fp.get_model(name)
    cfg = model.config(_OTHERS[name] if name in _OTHERS else CONFIGS[name]().to_dict(), mesh)
    batches = harness.token_batches(2, cfg.vocab_size, 4, 8, seed=7, masked=3)
    report = fp.verify(lambda m: model.loss_fn(cfg, m), model.specs(cfg, mesh), model.init(cfg, seed=1), batches,
                       mesh, data_axes=data_axes)
    return report.ok, str(report)


_OTHERS = {  # the two not in tests/hf_fixtures.py: GLM (partial rotary, fused gate/up) and Baichuan2 (W_pack, NormHead)
    "glm": {"model_type": "glm", "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
            "pad_token_id": 3, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                "partial_rotary_factor": 0.5}},
    "baichuan": {"model_type": "baichuan", "vocab_size": V, "hidden_size": 64, "intermediate_size": 96,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "z_loss_weight": 0},
}


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt2", "bloom", "mixtral", "glm", "baichuan"])
def test_verify_passes_the_built_in_models(name):
    for ok, text in harness.run(4, _builtin, name):
        assert ok, text


def test_verify_on_one_process_and_its_report_fields():
    report = fp.verify(lambda m: tinylm.MODEL.loss_fn(_cfg(), m), tinylm.specs(_cfg()), tinylm.init(_cfg()),
                       _batches(), fp.Mesh())
    assert report.ok and len(report.losses) == 2 and all(a == b for a, b in report.losses)
    assert {leaf.path for leaf in report.leaves} >= {"embed", "head", "norm", "layers.0.w_in"}
    assert all(leaf.error == 0 and leaf.spread is None for leaf in report.leaves)
    assert torch.isfinite(torch.tensor(report.params_error))
