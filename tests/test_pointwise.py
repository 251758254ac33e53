"""The fused element-wise kernels (``funcpar.nn.pointwise``): RMSNorm, SwiGLU and the cross-entropy's exp compiled by
``torch.compile`` on large float32 host tensors. They must give the eager Functions' values and gradients to
float32 round-off (no further from a float64 reference), be taken only where the policy says, never under
``torch.func`` transforms or a backward differentiated again, fail over to eager with a warning, and leave a whole
model's gradients equal to transformers' and a sharded train step equal to the single-process one."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import funcpar as fp
import harness
from funcpar.nn import layers as L
from funcpar.nn import pointwise as Pw
from hf_fixtures import batch, checkpoint_tensors, make_checkpoint

KERNELS = ("_rms_forward", "_rms_backward_kernel", "_swiglu_forward", "_swiglu_backward", "_exp_and_sum")


def _count(setattr_) -> dict:
    """Counts each fused kernel's calls (the Functions look the kernels up in the module at call time)."""
    n = dict.fromkeys(KERNELS, 0)
    for name in KERNELS:
        real = getattr(Pw, name)

        def counted(*a, real=real, name=name):
            n[name] += 1
            return real(*a)

        setattr_(Pw, name, counted)
    return n


@pytest.fixture
def calls(monkeypatch):
    yield _count(monkeypatch.setattr)
    assert not Pw._failed  # a kernel that fell back to eager would pass the comparisons: it must have compiled


def _rms(x, w, g):
    return (L.rms_norm(x, w, 1e-5) * g).sum()


def _swiglu(a, b, g):
    return (L.swiglu(a, b) * g).sum()


def _ce(logits, g):  # the cross-entropy's forward through exp_and_sum; labels every 7th class
    labels = torch.arange(logits.shape[0] * logits.shape[1]).view(logits.shape[:2]) % logits.shape[-1]
    return (L.vocab_cross_entropy(logits, labels, fp.Mesh(), "tp") * g).sum()


CASES = {  # name: (function, input shapes (the last is the output's cotangent), which need gradients, kernels used)
    "rms_norm": (_rms, [(3, 37, 64), (64,), (3, 37, 64)], [True, True, False],
                 ("_rms_forward", "_rms_backward_kernel")),
    "rms_norm_frozen_weight": (_rms, [(5, 64), (64,), (5, 64)], [True, False, False],
                               ("_rms_forward", "_rms_backward_kernel")),
    "swiglu": (_swiglu, [(2, 29, 48), (2, 29, 48), (2, 29, 48)], [True, True, False],
               ("_swiglu_forward", "_swiglu_backward")),
    "cross_entropy": (_ce, [(2, 13, 96), (2, 13)], [True, False], ("_exp_and_sum",)),
}


def _run(fn, xs, need, dtype=torch.float32):
    ins = [x.to(dtype).detach().requires_grad_(n) for x, n in zip(xs, need, strict=True)]
    y = fn(*ins)
    return [y.detach(), *torch.autograd.grad(y, [x for x, n in zip(ins, need, strict=True) if n])]


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_kernels_equal_the_eager_functions_to_round_off(name, calls, monkeypatch):
    fn, shapes, need, used = CASES[name]
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    if name == "rms_norm":  # a transposed (non-contiguous) input takes the kernel too
        xs[0] = xs[0].transpose(0, 1).contiguous().transpose(0, 1)
    monkeypatch.setattr(Pw, "FUSE", "off")
    ref = _run(fn, xs, need, torch.float64)
    eager = _run(fn, xs, need)
    assert not any(calls.values())
    monkeypatch.setattr(Pw, "FUSE", "on")
    fused = _run(fn, xs, need)
    assert all(calls[k] == 1 for k in used), calls  # forward and backward each ran the compiled kernel once
    for i, (f, e, r) in enumerate(zip(fused, eager, ref, strict=True)):
        scale = r.abs().max().item()
        err_f, err_e = (f.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
        assert (f - e).abs().max().item() <= 2e-6 * scale, (name, i)
        assert err_f <= 4 * err_e + 1e-7 * scale, (name, i, err_f, err_e)  # no further from float64 than eager


def test_auto_fuses_only_large_float32_host_tensors(calls, monkeypatch):
    monkeypatch.setattr(Pw, "FUSE", "auto")
    monkeypatch.setattr(Pw, "MIN_NUMEL", 4096)
    a, b, g = (torch.randn(4, 16, 32) for _ in range(3))  # 2048 elements: under the threshold
    small = _run(_swiglu, [a, b, g], [True, True, False])
    assert not any(calls.values())
    monkeypatch.setattr(Pw, "FUSE", "off")
    assert all(torch.equal(s, o) for s, o in zip(small, _run(_swiglu, [a, b, g], [True, True, False]), strict=True))
    monkeypatch.setattr(Pw, "FUSE", "auto")
    _run(_swiglu, [a, b, g], [True, True, False], torch.float64)  # float64: unmeasured, eager
    assert not any(calls.values())
    big = [torch.randn(4, 32, 32) for _ in range(3)]  # 4096 elements
    _run(_swiglu, big, [True, True, False])
    assert calls["_swiglu_forward"] == calls["_swiglu_backward"] == 1


def test_never_under_torch_func_transforms_or_a_differentiated_backward(calls, monkeypatch):
    monkeypatch.setattr(Pw, "FUSE", "on")
    x, w = torch.randn(6, 5, 64), torch.randn(64)
    # torch.func.grad: the forward sees this level's plain tensors (it may fuse), the backward wrapped ones (eager);
    # vmap: wrapped tensors both ways, all eager (the eager values bit for bit)
    gx = torch.func.grad(lambda x: L.rms_norm(x, w, 1e-5).pow(2).sum())(x)
    assert calls["_rms_backward_kernel"] == 0
    per_row = torch.func.vmap(lambda r: L.swiglu(r, r).sum())(x)
    assert calls["_swiglu_forward"] == 0
    monkeypatch.setattr(Pw, "FUSE", "off")
    eager = torch.func.grad(lambda x: L.rms_norm(x, w, 1e-5).pow(2).sum())(x)
    assert (gx - eager).abs().max().item() <= 1e-6 * eager.abs().max().item()
    assert torch.equal(per_row, torch.func.vmap(lambda r: L.swiglu(r, r).sum())(x))
    # create_graph: the forward may fuse, the backward that is differentiated again may not; second derivatives hold
    monkeypatch.setattr(Pw, "FUSE", "on")
    xr = x.clone().requires_grad_()
    (g1,) = torch.autograd.grad(L.swiglu(xr, xr).pow(2).sum(), xr, create_graph=True)
    assert calls["_swiglu_backward"] == 0 and calls["_swiglu_forward"] == 1
    (g2,) = torch.autograd.grad(g1.sum(), xr)  # (through the forward's node again, first order: that one may fuse)
    xc = x.clone().requires_grad_()
    (c1,) = torch.autograd.grad((F.silu(xc) * xc).pow(2).sum(), xc, create_graph=True)
    (c2,) = torch.autograd.grad(c1.sum(), xc)
    assert (g2 - c2).abs().max().item() <= 1e-5 * c2.abs().max().item()


@pytest.mark.subprocess
def test_a_bad_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(Pw, "FUSE", "yes")
    with pytest.raises(ValueError, match=r"FUNCPAR_FUSE in the environment\) is 'yes'; one of \('auto', 'on', 'off'\)"):
        L.swiglu(torch.randn(3), torch.randn(3))
    code = "import funcpar.nn.pointwise as P; print(P.FUSE)"
    for value, rc in (("off", 0), ("yes", 1)):
        out = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True,
                             env={**os.environ, "FUNCPAR_FUSE": value})
        refused = "ValueError: funcpar.nn.pointwise.FUSE (FUNCPAR_FUSE in the environment) is 'yes'; one of ('auto', "
        assert out.returncode == rc and (out.stdout.strip() == value if rc == 0 else
                                         refused + "'on', 'off')" in out.stderr), out.stderr


def test_a_compile_failure_warns_once_and_runs_the_same_formula_eagerly(monkeypatch):
    monkeypatch.setattr(Pw, "_failed", [])
    monkeypatch.setattr(Pw, "FUSE", "on")

    from torch._inductor.exc import InvalidCxxCompiler
    attempts = []

    def no_compiler(fn, **kw):
        def broken(*a):
            attempts.append(fn)
            raise InvalidCxxCompiler("g++")
        return broken

    a, b = torch.randn(8), torch.randn(8)
    # an error of the computation itself (here 8 elements viewed as 3 x 5) is not a compile failure: raised as it
    # is, by the real torch.compile, and fusion stays on
    with pytest.raises(RuntimeError, match=r"shape .\[3, 5\]. is invalid for input of size"):
        Pw._kernel(lambda a, b: a.view(3, 5) + b)(a, b)
    assert not Pw._failed
    monkeypatch.setattr(torch, "compile", no_compiler)
    kernel = Pw._kernel(lambda a, b: a * b + 1)
    with pytest.warns(UserWarning, match=r"torch.compile of the fused <lambda> failed \(InvalidCxxCompiler: "
                                         r"Compiler: g\+\+ is not found.\); running torch's eager kernels"):
        assert torch.equal(kernel(a, b), a * b + 1)
    with torch.no_grad():
        assert not Pw.fusable(a)  # fusion is off for the process from here on
    n = len(attempts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert torch.equal(kernel(a, b), a * b + 1)  # and no second attempt, even called directly
        assert torch.equal(Pw._swiglu_forward(a, b), F.silu(a) * b)
        assert torch.equal(L.swiglu(a.clone().requires_grad_(), b), F.silu(a) * b)
    assert len(attempts) == n


def test_a_whole_model_fused_matches_transformers(tmp_path, calls, monkeypatch):
    monkeypatch.setattr(Pw, "FUSE", "on")
    model = make_checkpoint("llama", str(tmp_path / "ckpt"))
    b = batch()
    out = model(**b)
    out.loss.backward()
    params, cfg = fp.hf.load(tmp_path / "ckpt")
    params = fp.tree.map_with_path(lambda _, v: v.requires_grad_(), params)
    loss = fp.get_model(cfg.model_type).loss(params, b, cfg=cfg, mesh=fp.Mesh())
    leaves = [v for _, v in fp.tree.leaves_with_path(params)]
    grads = iter(torch.autograd.grad(loss, leaves))
    assert all(calls[k] > 0 for k in KERNELS), calls
    assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
    fp.hf.save(tmp_path / "grads", fp.tree.map_with_path(lambda _, v: next(grads), params), fp.get_model("llama"), cfg)
    got = checkpoint_tensors(tmp_path / "grads")
    for n, p in model.named_parameters():
        assert (got[n] - p.grad).abs().max().item() <= 1e-5 * p.grad.abs().max().item(), n


def _train(path, sizes, fuse, batches):
    before, Pw.FUSE, real = Pw.FUSE, fuse, {k: getattr(Pw, k) for k in KERNELS}
    calls = _count(setattr)
    try:
        mesh = harness.mesh(**sizes) if sizes else fp.Mesh()
        params, cfg = fp.hf.load(path, mesh=mesh)
        model = fp.get_model(cfg.model_type)
        specs = model.specs(cfg, mesh)
        step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, zero=1, clip_norm=1.0,
                               optimizer=fp.optim.sgd(0.5))  # (SGD: AdamW would amplify round-off)
        state, losses = step.init(params), []
        for b in batches:
            state, m = step(state, harness.dp_share(b, mesh) if sizes else b)
            losses.append(m["loss"])
        got = fp.gather(state.params, specs, mesh, dst=0) if sizes else state.params
        return losses, got, calls, list(Pw._failed)
    finally:
        Pw.FUSE = before
        for k, v in real.items():
            setattr(Pw, k, v)


def test_a_sharded_step_fused_equals_the_single_process_step(tmp_path):
    make_checkpoint("llama", str(tmp_path / "ckpt"))
    batches = [batch(seed=s, B=4) for s in range(3)]
    ref_losses, ref, calls, _ = _train(str(tmp_path / "ckpt"), {}, "off", batches)
    assert not any(calls.values())
    ranks = harness.run(4, _train, str(tmp_path / "ckpt"), {"tp": 2, "dp": 2}, "on", batches)
    for _, _, calls, failed in ranks:
        assert all(calls[k] >= 3 for k in KERNELS) and not failed, (calls, failed)  # every rank fused, each step
    losses, got = ranks[0][:2]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-5 * ref_losses[0]
    for (name, g), (_, r) in zip(fp.tree.leaves_with_path(got), fp.tree.leaves_with_path(ref), strict=True):
        assert (g - r).abs().max().item() <= 1e-5 * r.abs().max().item() + 1e-7, name
