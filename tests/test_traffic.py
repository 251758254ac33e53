"""Issue 14, part 2: the bytes funcpar's collectives send per step, counted on real gloo meshes (``mesh.traffic``, by
axis, as a ring algorithm sends them: (n-1)/n of each all-gather or reduce-scatter, twice that for an all-reduce),
equal the analytic figures: Megatron tensor parallelism sends two all-reduces of b*s*h per layer forward and two
backward (plus the vocab-parallel embedding's forward and the head's backward), ZeRO-1 a reduce-scatter of the
gradients and an all-gather of the parameters."""

import math

import pytest
import torch

import funcpar as fp
import harness
from funcpar.models import llama

B, S = 4, 16  # rows per rank, sequence length


def _cfg():
    return llama.Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _one_step(sizes, zero):
    mesh = harness.mesh(**sizes)
    cfg, model = _cfg(), fp.get_model("llama")
    specs = model.specs(cfg, mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, zero=zero, clip_norm=1.0, check=False,
                           optimizer=fp.optim.adamw(1e-3))
    state = step.init(fp.shard(model.init(cfg, seed=0), specs, mesh))
    dp = mesh.axis_size("dp")
    ids = torch.randint(0, 128, (B * dp, S), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids.chunk(dp)[mesh.coord("dp")]}
    state, _ = step(state, batch)  # warm: the first step may check and set up
    mesh.traffic.clear()
    step(state, batch)
    n_params = sum(math.prod(x.shape) for _, x in fp.tree.leaves_with_path(model.init(cfg, device="meta")))
    return dict(mesh.traffic), n_params


def test_tensor_parallel_bytes_per_step_are_megatrons():
    traffic, _ = harness.run(2, _one_step, {"tp": 2}, 0)[0]
    cfg = _cfg()
    activation = B * S * cfg.hidden_size * 4  # one b*s*h float32 tensor
    all_reduce = 2 * activation * (2 - 1) / 2  # ring: reduce-scatter + all-gather, each (n-1)/n of it
    analytic = (4 * cfg.num_hidden_layers + 2) * all_reduce
    assert traffic["tp"] / analytic == pytest.approx(1.0, abs=0.02), (traffic, analytic)


def test_zero1_bytes_per_step_are_a_reduce_scatter_and_an_all_gather_of_the_parameters():
    traffic, n_params = harness.run(2, _one_step, {"dp": 2}, 1)[0]
    analytic = 2 * n_params * 4 * (2 - 1) / 2  # gradients reduce-scattered, parameters all-gathered
    assert traffic["dp"] / analytic == pytest.approx(1.0, abs=0.02), (traffic, analytic)
