"""Megatron's sequence parallelism (``model.loss_fn(cfg, mesh, sequence_parallel=True)``): between tp regions each tp
rank holds its block of the sequence (norms, residuals and dropout-free element-wise work on T/tp positions), the
sequence gathered before the column-parallel linears and reduce-scattered after the row-parallel ones. Three AdamW
steps at tp=2, tp=4 and tp=2 x dp=2 against one process, in float32, for Llama with GQA and GPT-2 (layer norms
with biases, learned positions), and at tp=2 for Qwen2 (q/k/v biases)."""

import math

import pytest
import torch

import funcpar as fp
import harness
from hf_fixtures import CONFIGS

B, T = 4, 12


def _batches(vocab, n=3):
    return harness.token_batches(n, vocab, B, T, seed=31, masked=4)


def _train(name, sizes, sequence_parallel):
    mesh = harness.mesh(**sizes) if sizes else fp.Mesh()
    model = fp.get_model(name)
    cfg = model.config(CONFIGS[name]().to_dict(), mesh)
    specs = model.specs(cfg, mesh)
    loss = model.loss_fn(cfg, mesh, sequence_parallel=sequence_parallel)
    step = fp.compile_step(loss, specs, mesh=mesh, optimizer=fp.optim.adamw(1e-3, weight_decay=0.1), clip_norm=1.0)
    state = step.init(fp.shard(model.init(cfg, seed=3), specs, mesh))
    losses = []
    for b in _batches(cfg.vocab_size):
        state, m = step(state, harness.dp_share(b, mesh))
        losses.append(m["loss"])
    return losses, fp.gather(state.params, specs, mesh), loss.mesh.sequence_parallel


MESHES = [{"tp": 2}, {"tp": 4}, {"tp": 2, "dp": 2}]


CASES = [(name, sizes) for name in ("llama", "gpt2") for sizes in MESHES] + [("qwen2", {"tp": 2})]


@pytest.mark.parametrize("name, sizes", CASES,
                         ids=lambda v: "-".join(f"{a}{n}" for a, n in v.items()) if isinstance(v, dict) else str(v))
def test_sequence_parallel_training_equals_one_process(name, sizes):
    ref_losses, ref, _ = _train(name, {}, False)
    losses, params, on = harness.run(math.prod(sizes.values()), _train, name, sizes, True)[0]
    assert on
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
    pairs = list(zip(fp.tree.leaves_with_path(params), fp.tree.leaves_with_path(ref), strict=True))
    diff = math.sqrt(sum((x - y).pow(2).sum().item() for (_, x), (_, y) in pairs))
    assert diff <= 1e-5 * math.sqrt(sum(y.pow(2).sum().item() for _, (_, y) in pairs))


def _uneven():
    mesh = harness.mesh(tp=2)
    model = fp.get_model("llama")
    cfg = model.config(CONFIGS["llama"]().to_dict(), mesh)
    loss = model.loss_fn(cfg, mesh, sequence_parallel=True)
    params = fp.shard(model.init(cfg), model.specs(cfg, mesh), mesh)
    ids = torch.zeros(2, 7, dtype=torch.long)
    try:
        loss(params, {"input_ids": ids})
    except ValueError as e:
        return str(e)


def test_a_sequence_tp_does_not_divide_is_refused_and_models_without_it_say_so():
    for msg in harness.run(2, _uneven):
        assert msg.startswith("sequence parallelism splits the sequence over tp=2: a sequence of 7 positions"), msg
    bloom = fp.get_model("bloom")
    with pytest.raises(fp.ModelError, match="model 'bloom' does not support sequence parallelism yet"):
        bloom.loss_fn(bloom.config(CONFIGS["bloom"]().to_dict()), fp.Mesh(), sequence_parallel=True)
