"""Activation checkpointing under torch.func.grad: identical gradients, far fewer saved activations."""

import functools

import torch

import funcpar as fp
import harness
from funcpar.models import llama
from test_step import batches, config


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
    for (name, x), (_, y) in zip(fp.tree.leaves_with_path(g1), fp.tree.leaves_with_path(g0)):
        assert torch.equal(x, y), name  # the same operations on the same inputs
    (l1, g1), (l0, g0) = harness.run(2, _sharded, b)[0]
    assert l1.item() == l0.item()
    for (name, x), (_, y) in zip(fp.tree.leaves_with_path(g1), fp.tree.leaves_with_path(g0)):
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
