"""A model of one's own, with no HF form and no registry, on ZeRO-3 and pipeline stages: ``fp.Loss(stages=, init=)``.

examples/custom_pipeline.py trains one at Mesh(pp=2, dp=2), zero=3, under torchrun and passes fp.verify; the rest
holds such a loss to what the step reads of it, on one process."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import funcpar as fp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.subprocess
def test_the_custom_pipeline_example_passes_verify_at_pp2_dp2_zero3_and_trains():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        "examples/custom_pipeline.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]  # (it asserts fp.verify's report is ok)
    m = re.search(r"verified on Mesh\(pp=2, dp=2, tp=1\); loss ([\d.]+) -> ([\d.]+) after 40 steps", p.stdout)
    assert m, p.stdout
    assert float(m[2]) < 0.5 * float(m[1])  # it trains


D, H = 4, 8


def init(cfg=None, device=None):
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.empty(shape, device="meta") if device == "meta" else torch.randn(shape, generator=g) / 2
    return {"w_in": w(H, D), "b_in": w(H), "layers": [{"w": w(H, H)} for _ in range(3)], "w_out": w(D, H)}


STAGES = fp.Stages(
    embed=lambda p, b, cfg, mesh: F.linear(b["x"], p["w_in"], p["b_in"]),
    block=lambda lp, x, i, cfg, mesh: x + torch.tanh(F.linear(x, lp["w"])),
    head=lambda p, x, b, cfg, mesh, reduction="mean": F.mse_loss(F.linear(x, p["w_out"]), b["y"], reduction=reduction),
    embed_leaves=lambda cfg: ["w_in", "b_in"], head_leaves=lambda cfg: ["w_out"])


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, D, generator=g), "y": torch.randn(4, D, generator=g)}


def test_a_loss_built_from_stages_is_their_loss_and_gives_their_shapes():
    mesh = fp.Mesh()
    loss = fp.Loss(stages=STAGES, init=init, mesh=mesh, remat=True)
    params, b = init(), _batch(0)
    assert loss.model is None and loss.name is None and loss.stages is STAGES
    assert torch.equal(loss(params, b), STAGES.loss(params, b, None, mesh))
    shapes = loss.shapes()
    assert shapes["layers"][2]["w"].device.type == "meta" and shapes["w_out"].shape == (D, H)
    assert fp.Loss(fn=lambda p, b: 0).shapes() is None
    with pytest.raises(fp.ModelError, match=r"give fn \(loss\(params, batch\) -> scalar\), or stages= and mesh="):
        fp.Loss(stages=STAGES)


def _train(zero):
    mesh = fp.Mesh()
    step = fp.compile_step(fp.Loss(stages=STAGES, init=init, mesh=mesh), fp.P(), mesh=mesh, zero=zero,
                           optimizer=fp.optim.adamw(1e-2))
    state, losses = step.init(init()), []
    for i in range(3):
        state, m = step(state, _batch(i))
        losses.append(m["loss"])
    return losses, step.gather_params(state)


def test_zero3_trains_a_loss_of_stages_as_zero0_does():
    (plain, p0), (zero3, p3) = _train(0), _train(3)
    assert zero3 == pytest.approx(plain, rel=1e-6)
    for (path, x), (_, y) in zip(fp.tree.leaves_with_path(p3), fp.tree.leaves_with_path(p0), strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), path


def test_zero3_and_pipelines_name_what_a_loss_lacks():
    bare = fp.Loss(fn=lambda p, b: 0)
    with pytest.raises(fp.StepError, match=r"zero=3 gathers the model block by block through its staged form: .*"
                                           r"fp.Loss\(stages=fp.Stages\(embed, block, head, ...\), init=init"):
        fp.compile_step(bare, fp.P(), mesh=fp.Mesh(), zero=3)
    no_mesh = fp.Loss(fn=lambda p, b: 0, stages=STAGES)
    with pytest.raises(fp.StepError, match=r"zero=3 .* on the loss's mesh \(it has none\)"):
        fp.compile_step(no_mesh, fp.P(), mesh=fp.Mesh(), zero=3)
    pp = fp.Mesh.abstract(pp=2)
    with pytest.raises(fp.StepError, match=r"pipeline stages cut the model through its staged form: .*custom_pipeline"):
        fp.compile_step(bare, fp.P(), mesh=pp, accum_steps=2)
    with pytest.raises(fp.StepError, match=r"pipeline stages cut the model by its parameters' shapes: give the loss "
                                           r"init="):
        fp.compile_step(fp.Loss(stages=STAGES, mesh=pp), fp.P(), mesh=pp, accum_steps=2)
    odd = fp.Loss(stages=STAGES, init=lambda cfg, device=None: {**init(cfg, device), "extra": torch.empty(1)},
                  mesh=pp, name="mine")
    with pytest.raises(fp.StepError, match=r"model 'mine': its staged form does not say which stage holds leaf "
                                           r"'extra'"):
        fp.compile_step(odd, fp.P(), mesh=pp, accum_steps=2)
    step = fp.compile_step(fp.Loss(stages=STAGES, init=init, mesh=pp), fp.P(), mesh=pp, accum_steps=2, zero=3)
    assert step.executor.plan.describe().splitlines()[0].startswith("pp rank 0: stage 0: embed + layer")
