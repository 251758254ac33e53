"""compile_step(compile="auto"), the default: which meshes it compiles on (measured: a CUDA mesh of data axes only;
eager on host tensors, tp, pipelines, ZeRO-3, offload, remat), the eager gradient taking over after a
compiler failure, and the compiled llama gradient (one graph, no break) on a dp mesh equal to the single-process
eager run."""

import types
import warnings

import pytest
import torch

import funcpar as fp
import funcpar.train.step as S
from funcpar.models import llama
from funcpar.train.options import Gradient, resolve_compile


def _mesh(device="cuda", **axes):
    """A stand-in with what resolve_compile reads (a CUDA Mesh needs GPUs)."""
    names = tuple(axes) or ("dp",)
    return types.SimpleNamespace(device=torch.device(device), axis_names=names,
                                 axis_size=lambda a: axes.get(a, 1))


def _remat():
    return fp.Loss(fn=lambda p, b: 0.0, remat=True)  # remat is a field the loss carries


def test_auto_compiles_on_cuda_data_axes_only_and_says_why_not_elsewhere():
    plain = fp.Loss(fn=lambda p, b: 0.0)
    assert resolve_compile("auto", _mesh(), 1, None, plain) == ("auto", "auto: compiled (a CUDA mesh)")
    assert resolve_compile("auto", _mesh(dp=8), 2, None, plain)[0] == "auto"
    assert resolve_compile("auto", _mesh(dp=2, ep=2), 1, None, plain, ("dp", "ep"))[0] == "auto"
    for mesh, zero, offload, loss, why in [
            (_mesh("cpu", dp=2), 1, None, plain, "cpu tensors: measured not to pay on the host"),
            (_mesh(tp=2, dp=2), 1, None, plain, "a model axis (tp)"),
            (_mesh(pp=2), 1, None, plain, "pipeline stages"),
            (_mesh(dp=2), 3, None, plain, "zero=3"),
            (_mesh(), 1, "cpu", plain, "offload"),
            (_mesh(), 1, None, _remat(), "remat")]:
        assert resolve_compile("auto", mesh, zero, offload, loss) == (False, f"auto: eager ({why})")
    assert resolve_compile(True, _mesh("cpu"), 1, None, plain) == (True, "compile=True")
    assert resolve_compile(False, _mesh(), 1, None, plain) == (False, "compile=False")
    with pytest.raises(fp.StepError, match="compile must be True, False or 'auto', got 'yes'"):
        resolve_compile("yes", _mesh(), 1, None, plain)


def test_a_host_step_defaults_to_eager_and_reports_it():
    model, mesh = fp.get_model("llama"), fp.Mesh()
    step = fp.compile_step(model.loss_fn(_cfg(), mesh), model.specs(_cfg(), mesh), mesh=mesh)
    assert step.compiled is False and "measured not to pay on the host" in step.compile_reason


def test_a_compiler_failure_warns_once_and_the_eager_gradient_takes_over():
    calls = {"eager": 0}

    def breaks(x):  # a graph break: a compiler failure under fullgraph=True, found before anything runs
        torch._dynamo.graph_break()
        return x * 2

    def eager(x):
        calls["eager"] += 1
        return x * 2

    grad = Gradient("auto", breaks, eager, "auto: compiled (a CUDA mesh)")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert torch.equal(grad(torch.ones(3)), torch.full((3,), 2.0))
        assert torch.equal(grad(torch.ones(3)), torch.full((3,), 2.0))
    assert calls["eager"] == 2 and grad.compiled is False
    assert grad.reason.startswith("auto: eager after a compiler failure (")
    assert len([x for x in w if "torch.compile of the gradient failed" in str(x.message)]) == 1


def test_an_error_of_the_computation_itself_is_raised_not_hidden():
    def bad(x):
        return x @ torch.ones(5, 5)  # a shape error: the eager gradient would raise it too

    grad = Gradient("auto", bad, bad)
    with pytest.raises(RuntimeError, match="shape|size"):
        grad(torch.ones(3))
    assert grad.compiled == "auto"


def _cfg():
    return llama.Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16)


def _train(mesh, compile, batches):
    import harness

    model = fp.get_model("llama")
    specs = model.specs(_cfg(), mesh)
    step = fp.compile_step(model.loss_fn(_cfg(), mesh), specs, mesh=mesh, optimizer=fp.optim.adamw(1e-3),
                           clip_norm=1.0, compile=compile)
    state = step.init(fp.shard(model.init(_cfg(), seed=0), specs, mesh))
    losses = []
    for b in batches:
        state, m = step(state, harness.dp_share(b, mesh) if mesh.axis_size("dp") > 1 else b)
        losses.append(m["loss"])
    return losses, step.compiled, step.compile_reason


def _forced_auto_dp2(batches):
    import harness

    real = S.resolve_compile
    S.resolve_compile = lambda *a: ("auto", "forced on the CPU")
    try:
        return _train(harness.mesh(dp=2), "auto", batches)
    finally:
        S.resolve_compile = real


def test_the_auto_compiled_gradient_on_a_dp_mesh_equals_the_single_process_run():
    """What "auto" compiles on a multi-GPU data-parallel mesh, forced on gloo: the gradient compiles as one graph
    on each rank (ZeRO's collectives stay outside it) and the losses equal the single-process eager run's."""
    import harness

    batches = [{"input_ids": torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(i))}
               for i in range(3)]
    ref, compiled, _ = _train(fp.Mesh(), False, batches)
    assert compiled is False
    for losses, compiled, why in harness.run(2, _forced_auto_dp2, batches):
        assert compiled == "auto", why
        assert losses == pytest.approx(ref, rel=1e-5)
