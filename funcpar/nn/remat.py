"""Activation memory. ``remat(fn)``: activation checkpointing that works under ``torch.func.grad`` (it keeps only
``fn``'s inputs and recomputes ``fn`` in the backward pass). ``grad_and_value``: the train step's gradient, which
frees each activation as soon as the backward has used it.

``torch.utils.checkpoint`` relies on saved-tensor hooks, which ``torch.func`` transforms do not support. Here the
recomputation is a custom ``autograd.Function`` whose backward re-runs ``fn`` under ``torch.func.vjp``: the same
operations on the same inputs, so the gradients are those of the plain function. Collectives inside ``fn`` run again
during the recomputation, on every rank in the same order, as SPMD code requires.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch

__all__ = ["remat", "grad_and_value"]


class _Remat(torch.autograd.Function):
    @staticmethod
    def forward(fn, rebuild, *tensors):
        with torch.no_grad():
            return fn(*rebuild(tensors))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.fn, ctx.rebuild = inputs[0], inputs[1]
        ctx.save_for_backward(*inputs[2:])

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        diff = [i for i, t in enumerate(tensors) if t.is_floating_point()]

        def f(*ds):
            ts = list(tensors)
            for i, d in zip(diff, ds, strict=True):
                ts[i] = d
            return ctx.fn(*ctx.rebuild(ts))

        _, vjp = torch.func.vjp(f, *[tensors[i] for i in diff])
        grads = vjp(grad)
        out: list[Any] = [None] * len(tensors)
        for i, g in zip(diff, grads, strict=True):
            out[i] = g
        return (None, None, *out)


def remat(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` (pytrees of tensors in, one tensor out) with its activations recomputed in the backward pass."""

    @functools.wraps(fn)
    def wrapped(*args):
        leaves, treedef = optree.tree_flatten(args)
        is_t = [isinstance(x, torch.Tensor) for x in leaves]
        others = [x for x, t in zip(leaves, is_t, strict=True) if not t]

        def rebuild(tensors):
            it_t, it_o = iter(tensors), iter(others)
            return optree.tree_unflatten(treedef, [next(it_t) if t else next(it_o) for t in is_t])

        return _Remat.apply(fn, rebuild, *[x for x, t in zip(leaves, is_t, strict=True) if t])

    return wrapped


def grad_and_value(fn: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., tuple[Any, tuple[torch.Tensor, Any]]]:
    """``torch.func.grad_and_value(fn, has_aux=True)`` for the outermost gradient, at the memory of eager backward.

    ``torch.func`` differentiates with ``create_graph=True`` (so that transforms nest), which keeps every saved
    activation alive until the whole backward is done, and a recomputed block's too: a step's peak is then all the
    activations plus all the gradients, well above an eager loop's. The train step needs no higher derivative, so
    here the parameters are fresh leaves and one reverse pass releases each saved tensor once it is used. Same
    operations, same gradients (unused parameters get zeros, as ``torch.func`` gives; so does every parameter of a
    loss that does not depend on them), and ``aux`` comes back detached, as ``torch.func`` gives it.
    """

    def run(params: Any, *args):
        leaves, treedef = optree.tree_flatten(params)
        leaves = [x.detach().requires_grad_(True) for x in leaves]
        with torch.enable_grad():
            value, aux = fn(optree.tree_unflatten(treedef, leaves), *args)
        if value.requires_grad:
            grads = torch.autograd.grad(value, leaves, allow_unused=True, materialize_grads=True)
        else:  # e.g. a constant loss for a micro-batch without targets
            grads = [torch.zeros_like(x) for x in leaves]
        aux = optree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)
        return optree.tree_unflatten(treedef, list(grads)), (value.detach(), aux)

    return run
