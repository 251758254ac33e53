"""adamw, lion, sgd and clip_by_global_norm, computed with ``torch._foreach_*`` over all leaves at once."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from .base import GradientTransformation, leaves, mask_list, unflatten_like
from .schedules import Schedule, constant


def _sched(lr: float | Schedule) -> Schedule:
    return lr if callable(lr) else constant(lr)


def _count(state_count: torch.Tensor) -> int:
    return int(state_count.item())


def global_norm(tree: Any) -> torch.Tensor:
    """The 2-norm of all leaves together (float32)."""
    xs = leaves(tree)
    if not xs:
        return torch.zeros(())
    norms = torch._foreach_norm([x.float() for x in xs])
    return torch.linalg.vector_norm(torch.stack(norms))


_tree_norm = global_norm


class ClipState(NamedTuple):
    pass


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all gradients by ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does.

    The norm is ``extra["global_norm"]`` when the caller passes it (a sharded step does, over every shard), else
    the norm of the leaves given.
    """

    def init(params):
        return ClipState()

    def update(grads, state, params=None, global_norm=None, **extra):
        norm = global_norm if global_norm is not None else _tree_norm(grads)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        xs = leaves(grads)
        return unflatten_like(grads, torch._foreach_mul(xs, coef.to(xs[0].device)) if xs else []), state

    return GradientTransformation(init, update)


class AdamWState(NamedTuple):
    count: torch.Tensor  # int64 scalar: updates done
    mu: Any
    nu: Any


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW as ``torch.optim.AdamW`` computes it (decoupled decay ``lr*wd*p``, bias-corrected moments).

    ``mask``: bool tree (True = decay); ``None`` decays every leaf, like torch's single param group.
    """
    schedule = _sched(lr)

    def init(params):
        xs = leaves(params)
        return AdamWState(
            torch.zeros((), dtype=torch.int64),
            unflatten_like(params, [torch.zeros_like(x) for x in xs]),
            unflatten_like(params, [torch.zeros_like(x) for x in xs]),
        )

    def update(grads, state, params=None, **extra):
        g = leaves(grads)
        step = _count(state.count) + 1
        rate = schedule(step - 1)
        m = torch._foreach_lerp(leaves(state.mu), g, 1 - b1)
        v = torch._foreach_mul(leaves(state.nu), b2)
        torch._foreach_addcmul_(v, g, g, 1 - b2)
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        upd = torch._foreach_div(m, denom)
        torch._foreach_mul_(upd, -rate / bc1)
        if weight_decay:
            p = leaves(params)
            decay = mask_list(mask, params)
            idx = [i for i, d in enumerate(decay) if d]
            if idx:
                torch._foreach_add_([upd[i] for i in idx], [p[i] for i in idx], alpha=-rate * weight_decay)
        new = AdamWState(state.count + 1, unflatten_like(grads, m), unflatten_like(grads, v))
        return unflatten_like(grads, upd), new

    return GradientTransformation(init, update, schedule)


class LionState(NamedTuple):
    count: torch.Tensor
    mu: Any


def lion(lr: float | Schedule, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0, mask: Any = None):
    """Lion (Chen et al. 2023): ``p -= lr * (sign(b1*m + (1-b1)*g) + wd*p)``, then ``m = b2*m + (1-b2)*g``."""
    schedule = _sched(lr)

    def init(params):
        return LionState(torch.zeros((), dtype=torch.int64), unflatten_like(params, [torch.zeros_like(x) for x in leaves(params)]))

    def update(grads, state, params=None, **extra):
        g = leaves(grads)
        rate = schedule(_count(state.count))
        mu = leaves(state.mu)
        upd = [t.sign_() for t in torch._foreach_lerp(mu, g, 1 - b1)]
        torch._foreach_mul_(upd, -rate)
        if weight_decay:
            p = leaves(params)
            idx = [i for i, d in enumerate(mask_list(mask, params)) if d]
            if idx:
                torch._foreach_add_([upd[i] for i in idx], [p[i] for i in idx], alpha=-rate * weight_decay)
        new_mu = torch._foreach_lerp(mu, g, 1 - b2)
        return unflatten_like(grads, upd), LionState(state.count + 1, unflatten_like(grads, new_mu))

    return GradientTransformation(init, update, schedule)


class SGDState(NamedTuple):
    count: torch.Tensor
    momentum: Any  # None without momentum


def sgd(lr: float | Schedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0, mask: Any = None):
    """SGD as ``torch.optim.SGD`` computes it (L2 ``weight_decay`` added to the gradient, dampening 0)."""
    schedule = _sched(lr)
    if nesterov and not momentum:
        raise ValueError("sgd: nesterov=True needs momentum > 0")

    def init(params):
        buf = unflatten_like(params, [torch.zeros_like(x) for x in leaves(params)]) if momentum else None
        return SGDState(torch.zeros((), dtype=torch.int64), buf)

    def update(grads, state, params=None, **extra):
        g = leaves(grads)
        rate = schedule(_count(state.count))
        if weight_decay:
            p = leaves(params)
            g = list(g)
            for i, d in enumerate(mask_list(mask, params)):
                if d:
                    g[i] = g[i] + weight_decay * p[i]
        buf = None
        if momentum:
            buf = torch._foreach_mul(leaves(state.momentum), momentum)
            torch._foreach_add_(buf, g)
            d = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        else:
            d = g
        upd = torch._foreach_mul(d, -rate)
        return unflatten_like(grads, upd), SGDState(state.count + 1, None if buf is None else unflatten_like(grads, buf))

    return GradientTransformation(init, update, schedule)
