"""Megatron's sequence parallelism (``model.loss_fn(cfg, mesh, sequence_parallel=True)``): between tp regions each tp
rank holds its block of the sequence (norms, residuals and dropout-free element-wise work on T/tp positions), the
sequence gathered before the column-parallel linears and reduce-scattered after the row-parallel ones. Three AdamW
steps at tp=2, tp=4 and tp=2 x dp=2 against one process, in float32, for Llama with GQA, at tp=2 and tp=2 x dp=2
for GPT-2 (layer norms with biases, learned positions), and at tp=2 for Qwen2 (q/k/v biases), GLM (partial
rotary), Baichuan2 (NormHead) and Mixtral (the router and experts on the gathered sequence, with its load-balancing
loss)."""

import math

import pytest
import torch

import funcpar as fp
import harness
from hf_fixtures import CONFIGS, config_dict

B, T = 4, 12


def _batches(vocab, n=3):
    return harness.token_batches(n, vocab, B, T, seed=31, masked=4)


def _train(name, sizes, sequence_parallel, zero=1, micro=1):
    mesh = harness.mesh(**sizes) if sizes else fp.Mesh()
    model = fp.get_model(name)
    cfg = model.config(config_dict(name), mesh)
    specs = model.specs(cfg, mesh)
    loss = model.loss_fn(cfg, mesh, sequence_parallel=sequence_parallel)
    step = fp.compile_step(loss, specs, mesh=mesh, optimizer=fp.optim.adamw(1e-3, weight_decay=0.1), clip_norm=1.0,
                           zero=zero, accum_steps=micro)
    params = fp.shard(model.init(cfg, seed=3), specs, mesh)
    state = step.init(step.executor.plan.select(params) if step.executor is not None else params)
    losses = []
    for b in _batches(cfg.vocab_size):
        state, m = step(state, harness.dp_share(b, mesh))
        losses.append(m["loss"])
    return losses, fp.gather(step.gather_params(state), specs, mesh), loss.mesh.sequence_parallel


MESHES = [{"tp": 2}, {"tp": 4}, {"tp": 2, "dp": 2}]


CASES = [("llama", sizes) for sizes in MESHES] + [("gpt2", sizes) for sizes in MESHES if sizes != {"tp": 4}] + [
    (name, {"tp": 2}) for name in ("qwen2", "glm", "baichuan", "mixtral")]  # (qwen2: q/k/v biases; glm: partial
# rotary; mixtral: the MoE on the gathered blocks, with its load-balancing loss)


@pytest.mark.parametrize("name, sizes", CASES,
                         ids=lambda v: "-".join(f"{a}{n}" for a, n in v.items()) if isinstance(v, dict) else str(v))
def test_sequence_parallel_training_equals_one_process(name, sizes):
    ref_losses, ref, _ = _train(name, {}, False)
    losses, params, on = harness.run(math.prod(sizes.values()), _train, name, sizes, True)[0]
    assert on
    harness.assert_same_training((losses, params), (ref_losses, ref))


@pytest.mark.parametrize("sizes, zero, micro", [({"pp": 2, "tp": 2}, 1, 2), ({"tp": 2, "dp": 2}, 3, 1)],
                         ids=["pp2-tp2", "tp2-dp2-zero3"])
def test_sequence_parallelism_on_pipeline_stages_and_at_zero3(sizes, zero, micro):
    """The staged form carries each tp rank's block of the sequence between pipeline stages, and ZeRO-3 gathers
    each block's parameters around it: both equal the one-process run."""
    ref_losses, ref, _ = _train("llama", {}, False, 0, micro)
    losses, params, on = harness.run(math.prod(sizes.values()), _train, "llama", sizes, True, zero, micro)[0]
    assert on
    harness.assert_same_training((losses, params), (ref_losses, ref))


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
