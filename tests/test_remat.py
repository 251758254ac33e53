"""Activation checkpointing under torch.func.grad: identical gradients, far fewer saved activations."""

import functools

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import funcpar as fp
import harness
from fixtures import batches, config
from funcpar.models import llama


def grads(mesh, remat, b):
    cfg = config(layers=3)
    specs = llama.specs(cfg, mesh)
    params = fp.shard(llama.init(cfg, seed=0), specs, mesh)
    loss, g = torch.func.grad_and_value(functools.partial(llama.loss, cfg=cfg, mesh=mesh, remat=remat))(params, b)[::-1]
    return loss, fp.gather(g, specs, mesh, dst=0) if mesh.size > 1 else g


def _sharded(b):
    mesh = harness.mesh(tp=2)
    return grads(mesh, True, b), grads(mesh, False, b)


def test_remat_gives_the_same_gradients_single_and_tensor_parallel():
    b = batches()[0]
    (l1, g1), (l0, g0) = grads(fp.Mesh(), True, b), grads(fp.Mesh(), False, b)
    assert l1.item() == l0.item()
    for (name, x), (_, y) in zip(fp.tree.leaves_with_path(g1), fp.tree.leaves_with_path(g0), strict=True):
        assert torch.equal(x, y), name  # the same operations on the same inputs
    (l1, g1), (l0, g0) = harness.run(2, _sharded, b)[0]
    assert l1.item() == l0.item()
    for (name, x), (_, y) in zip(fp.tree.leaves_with_path(g1), fp.tree.leaves_with_path(g0), strict=True):
        assert torch.equal(x, y), name


def saved_bytes(remat):
    """Bytes autograd keeps for the backward pass of one loss (plain autograd, where saved-tensor hooks work)."""
    cfg = config(layers=3)
    params = fp.tree.map_with_path(lambda p, x: x.requires_grad_(True), llama.init(cfg, seed=0))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = llama.loss(params, batches()[0], cfg, fp.Mesh(), remat=remat)
    loss.backward()
    return sum(saved)


def test_remat_keeps_only_layer_inputs():
    plain, kept = saved_bytes(False), saved_bytes(True)
    assert kept < 0.5 * plain, (kept, plain)


def test_the_steps_gradient_matches_torch_func_and_returns_aux_detached():
    from funcpar.nn.remat import grad_and_value

    cfg = config()
    params = llama.init(cfg, seed=0)
    b = batches()[0]

    def f(p, batch):
        loss = llama.loss(p, batch, cfg, fp.Mesh())
        return loss, {"twice": loss * 2}

    ref_g, (ref_v, ref_aux) = torch.func.grad_and_value(f, has_aux=True)(params, b)
    g, (v, aux) = grad_and_value(f)(params, b)
    assert torch.equal(v, ref_v) and not aux["twice"].requires_grad and torch.equal(aux["twice"], ref_aux["twice"])
    for (path, x), (_, y) in zip(fp.tree.leaves_with_path(g), fp.tree.leaves_with_path(ref_g), strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-8), path
    # a loss that does not depend on the parameters: zero gradients, as torch.func gives
    g0, (v0, _) = grad_and_value(lambda p, batch: (torch.zeros(()), None))(params, b)
    assert v0.item() == 0 and all(torch.equal(x, torch.zeros_like(x)) for _, x in fp.tree.leaves_with_path(g0))


def test_fused_cross_entropy_under_vmap_of_grad():
    from funcpar.nn.layers import vocab_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 5, 11, generator=g), torch.randint(0, 11, (3, 5), generator=g)
    labels[0, 0] = -100
    per_example = torch.vmap(torch.func.grad(lambda lg, y: vocab_cross_entropy(lg, y, fp.Mesh(), "tp").sum()))
    ref = torch.func.grad(lambda lg: torch.nn.functional.cross_entropy(
        lg.reshape(-1, 11), labels.clamp(min=0).reshape(-1), reduction="sum"))(logits)
    counted = (labels >= 0)[..., None]
    assert torch.allclose(per_example(logits, labels) * counted, ref * counted, atol=1e-6)


def test_fused_cross_entropy_backward_scales_its_saved_exponentials_in_place():
    """The train step's backward (plain autograd, first order): the logits' gradient is the forward's saved
    ``exp(logits - max)`` scaled in place (no new logits-sized tensor), equal to torch's; a second backward over the
    same graph is refused by autograd's version check, not answered from the overwritten tensor."""
    from funcpar.nn.layers import vocab_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(4, 7, 13, generator=g, requires_grad=True), torch.randint(0, 13, (4, 7), generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = vocab_cross_entropy(logits, labels, fp.Mesh(), "tp").mean()
    ops = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ops.extend(func.__name__ for t in optree.tree_leaves(out) if getattr(t, "shape", None) == logits.shape)
            return out

    with Log():  # every logits-sized result of the backward: only the in-place scaling and the one-hot's scatter
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    assert sorted(ops) == ["mul_.Tensor", "scatter_add_.default"], ops
    ref = torch.func.grad(lambda lg: torch.nn.functional.cross_entropy(lg.reshape(-1, 13), labels.reshape(-1)))(
        logits.detach())
    assert torch.allclose(grad, ref, rtol=1e-6, atol=1e-8)
    big = [t for t in saved if t.shape == logits.shape]
    assert len(big) == 1 and big[0] is not logits and big[0].data_ptr() == grad.data_ptr()  # exp, not the logits
    loss = vocab_cross_entropy(logits, labels, fp.Mesh(), "tp").mean()  # (no hooks: autograd checks versions)
    assert torch.equal(torch.autograd.grad(loss, logits, retain_graph=True)[0], grad)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, logits)
