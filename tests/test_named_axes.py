"""Named mesh axes, the mesh in scope, and compile_step with nothing but the loss and the specs."""

import functools

import pytest
import torch

import funcpar as fp
from funcpar.nn.remat import grad_and_value
import harness
from funcpar.models import llama

V, B, T = 64, 8, 16


def config():
    return llama.Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, sliding_windows=(None, None))


def batches(n=3):
    out = []
    for s in range(n):
        ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(50 + s))
        labels = ids.clone()
        labels[s, :4] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _run(step, specs, params, mesh, data_axes=("dp",)):
    state = step.init(params)
    n = 1
    k = 0
    for a in data_axes:  # this rank's rows: data axes major first, as the mesh orders them
        k, n = k * mesh.axis_size(a) + mesh.coord(a), n * mesh.axis_size(a)
    losses = []
    for b in batches():
        state, m = step(state, {key: x.chunk(n)[k] for key, x in b.items()})
        losses.append(m["loss"])
    return losses, fp.gather(state.params, specs, mesh)


def _in_scope():
    mesh = harness.mesh(tp=2, dp=2)
    cfg = config()
    specs = llama.specs(cfg, mesh)
    params = fp.shard(llama.init(cfg, seed=0), specs, mesh)
    model_fn = functools.partial(llama.loss, cfg=cfg, mesh=mesh)
    with mesh:
        assert fp.Mesh.current() is mesh
        implicit = fp.compile_step(model_fn, specs)  # the promised call: mesh in scope, default optimizer
    explicit = fp.compile_step(model_fn, specs, mesh=mesh, optimizer=fp.optim.adamw(1e-3, weight_decay=0.01))
    return implicit.mesh is mesh, _run(implicit, specs, params, mesh), _run(explicit, specs, params, mesh)


def test_compile_step_with_only_loss_and_specs_under_with_mesh_equals_the_explicit_call():
    for same_mesh, (l1, p1), (l2, p2) in harness.run(4, _in_scope):
        assert same_mesh
        assert l1 == l2 and l1[-1] < l1[0]
        for (path, x), (_, y) in zip(fp.tree.leaves_with_path(p1), fp.tree.leaves_with_path(p2), strict=True):
            assert torch.equal(x, y), path


def test_default_optimizer_is_torch_adamw_defaults():
    cfg = config()
    params = llama.init(cfg, seed=0)
    model_fn = functools.partial(llama.loss, cfg=cfg, mesh=fp.Mesh())
    step = fp.compile_step(model_fn, llama.specs(cfg))  # one process: Mesh() is the mesh in scope
    state = step.init(params)
    state, _ = step(state, batches(1)[0])
    ref = {k: v for k, v in fp.tree.leaves_with_path(params)}
    tparams = [torch.nn.Parameter(v.clone()) for v in ref.values()]
    opt = torch.optim.AdamW(tparams)  # lr 1e-3, weight_decay 1e-2
    # the gradients the step computes (an Adam step amplifies float rounding of near-zero gradients)
    grads, _ = grad_and_value(lambda p: (llama.loss(p, batches(1)[0], cfg, fp.Mesh()), None))(params)
    for p, g in zip(tparams, [g for _, g in fp.tree.leaves_with_path(grads)], strict=True):
        p.grad = g
    opt.step()
    for (path, x), p in zip(fp.tree.leaves_with_path(state.params), tparams, strict=True):
        assert torch.allclose(x, p.detach(), rtol=1e-5, atol=1e-7), path


def _ep_vs_dp():
    cfg = config()
    specs = llama.specs(cfg)
    params = llama.init(cfg, seed=0)
    model_fn = functools.partial(llama.loss, cfg=cfg)
    out = {}
    for sizes, axes in [({"dp": 4}, ("dp",)), ({"dp": 2, "ep": 2}, ("dp", "ep"))]:
        mesh = harness.mesh(**sizes)
        # SGD: element-wise comparable (Adam amplifies round-off where a gradient is near zero)
        step = fp.compile_step(functools.partial(model_fn, mesh=mesh), specs, mesh=mesh, data_axes=axes,
                               optimizer=fp.optim.sgd(0.5, momentum=0.9), clip_norm=0.5, accum_steps=2)
        out[axes] = _run(step, specs, params, mesh, axes)
    return out


def test_a_mesh_with_another_axis_name_trains_as_data_parallel_when_told():
    for out in harness.run(4, _ep_vs_dp):
        (l1, p1), (l2, p2) = out[("dp",)], out[("dp", "ep")]
        assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(l1, l2, strict=True))
        for (path, x), (_, y) in zip(fp.tree.leaves_with_path(p1), fp.tree.leaves_with_path(p2), strict=True):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-7), path


def test_any_axis_names_order_and_coordinates():
    m = fp.Mesh.abstract(tp=2, ep=2, dp=2)
    assert m.axis_names == ("pp", "dp", "ep", "tp") and m.size == 8 and repr(m) == "Mesh(pp=1, dp=2, ep=2, tp=2)"
    for r in range(8):
        assert m.rank_of(**m.coords_of(r)) == r
    assert m.coords_of(5) == {"pp": 0, "dp": 1, "ep": 0, "tp": 1}  # tp innermost, then ep, then dp
    with pytest.raises(fp.MeshError, match=r"mesh axis name '2x' is not an identifier"):
        fp.Mesh(**{"2x": 2})
    with pytest.raises(fp.MeshError, match=r"unknown mesh axis 'sp': the axes are pp, dp, ep, tp"):
        m.axis_size("sp")


def _scope_errors():
    harness.mesh(tp=2, dp=2), harness.mesh(dp=4)
    try:
        fp.Mesh.current()
    except fp.MeshError as e:
        return str(e)


def test_no_unique_mesh_in_scope_is_an_error_that_says_what_to_do():
    for msg in harness.run(4, _scope_errors):
        assert "several meshes exist in this process" in msg and "`with mesh:` or pass mesh=" in msg
    with pytest.raises(fp.StepError, match=r"data_axes names 'ep', which is not a data axis of Mesh\(pp=1, dp=1, tp=1\)"):
        fp.compile_step(lambda p, b: 0, {}, mesh=fp.Mesh(), data_axes=("ep",))
