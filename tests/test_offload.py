"""Optimizer state offloaded to the host (compile_step(..., offload="cpu")): the same numbers as without, and the
optimizer state and master parts on the host. On this CPU-only machine the host is the device, so these tests pin
the code path (the gradient parts moved to the host, updated there, copied back) and its numbers."""

import functools

import pytest
import torch

import funcpar as fp
import harness
from funcpar.models import llama

V, B, T = 64, 8, 16


def config():
    return llama.Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, sliding_windows=(None, None))


def _train(mesh, offload, param_dtype=None, zero=1):
    cfg = config()
    specs = llama.specs(cfg, mesh)
    params = fp.shard(llama.init(cfg, seed=0), specs, mesh)
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), specs, mesh=mesh, zero=zero,
                           optimizer=fp.optim.adamw(1e-2, weight_decay=0.1), clip_norm=0.5, accum_steps=2,
                           offload=offload, param_dtype=param_dtype)
    state = step.init(params)
    dp, k = mesh.axis_size("dp"), mesh.coord("dp")
    losses = []
    for s in range(3):
        ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(s))
        state, m = step(state, {"input_ids": ids.chunk(dp)[k]})
        losses.append(m["loss"])
    devices = {x.device.type for _, x in fp.tree.leaves_with_path(state.opt_state) if isinstance(x, torch.Tensor)}
    return losses, fp.gather(state.params, specs, mesh), devices, type(state.opt_state).__name__


def _both(sizes, param_dtype=None, zero=1):
    mesh = harness.mesh(**sizes) if sizes else fp.Mesh()
    return _train(mesh, None, param_dtype, zero), _train(mesh, "cpu", param_dtype, zero)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_offload_gives_the_same_numbers_on_one_process(param_dtype):
    (l0, p0, _, _), (l1, p1, devices, kind) = _both({}, param_dtype)
    assert l0 == l1 and devices == {"cpu"} and kind == "MixedState"  # fp32 masters on the host even without bf16
    for (path, x), (_, y) in zip(fp.tree.leaves_with_path(p0), fp.tree.leaves_with_path(p1), strict=True):
        assert torch.equal(x, y), path


@pytest.mark.parametrize("zero", [0, 2])
def test_offload_gives_the_same_numbers_at_tp2_dp2(zero):
    for (l0, p0, _, _), (l1, p1, devices, _) in harness.run(4, _both, {"tp": 2, "dp": 2}, None, zero):
        assert l0 == l1 and devices == {"cpu"}
        for (path, x), (_, y) in zip(fp.tree.leaves_with_path(p0), fp.tree.leaves_with_path(p1), strict=True):
            assert torch.equal(x, y), path


def test_offload_names_what_it_takes():
    with pytest.raises(fp.StepError, match=r"offload must be None or 'cpu', got 'nvme'"):
        fp.compile_step(lambda p, b: 0, {}, mesh=fp.Mesh(), offload="nvme")
