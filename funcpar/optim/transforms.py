"""The building blocks the optimizers are chained from, computed with ``torch._foreach_*`` over all leaves at once.

Each is an :class:`~funcpar.optim.base.InPlaceTransformation`. Every ``update`` skips
:data:`~funcpar.optim.base.ABSENT` leaves (frozen under :func:`~funcpar.optim.masked`), accepts leaves of any shape
(ZeRO's 1-D slices, some of them empty), never writes the caller's grads, params or state unless told (the train step
passes ``inplace=InPlace(updates=True, state=True)``: the gradients are its own and it donated the state), and
passes ``**extra`` by. Inside a :func:`~funcpar.optim.chain` a stage overwrites update tensors an earlier stage
created (``inplace.updates``, see :mod:`funcpar.optim.base`) instead of making one more temporary.

:func:`clip_by_global_norm` clips by the norm the caller passes (the train step's, over every shard, from
:mod:`funcpar.train.norms`); without one, by :func:`global_norm` of the leaves given, computed here plainly.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from funcpar.optim.base import (NOTHING, InPlace, InPlaceTransformation, leaves, mask_list, mul_leaves as _mul,
                                unflatten_like)
from funcpar.optim.schedules import Schedule, check_hyper, constant


def as_schedule(lr: float | Schedule) -> Schedule:
    """``lr`` as a schedule; a number is checked here (finite, not negative), a schedule's values as used."""
    if not callable(lr):
        check_hyper("scale_by_learning_rate", "lr", lr)
    return lr if callable(lr) else constant(lr)


def count_value(state_count: torch.Tensor) -> int:
    return int(state_count.item())


def _zero_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def _zeros_like(params: Any) -> Any:
    return unflatten_like(params, [torch.zeros_like(x) for x in leaves(params)])


def _always(fresh: bool) -> bool:
    return True


def _on_leaves(update):
    """``update(g, grads, state, params, **kw)`` called with the present leaves ``g`` of ``grads``; with none present
    the step is a no-op (``grads`` and ``state`` returned as they are)."""

    def wrapped(grads, state, params=None, **kw):
        g = leaves(grads)
        return update(g, grads, state, params, **kw) if g else (grads, state)

    return wrapped


def sum_of_squares(x: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """``(x ** 2).sum()`` in float64 on ``x``'s device: float64 copies of ``chunk`` elements at a time, squared and
    summed, exact to float64 rounding and never waiting for the device (a bare optimizer's clipping stays
    asynchronous). The train step's norm takes a faster path over all its buckets at once
    (:func:`funcpar.train.norms.sums_of_squares`)."""
    x = x.detach().reshape(-1)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    return torch.stack([torch.linalg.vector_norm(x[i : i + chunk], dtype=torch.float64) ** 2
                        for i in range(0, x.numel(), chunk)]).sum()


def global_norm(tree: Any) -> torch.Tensor:
    """The 2-norm of all leaves together (float32, accumulated in float64)."""
    xs = leaves(tree)
    if not xs:
        return torch.zeros(())
    return torch.stack([sum_of_squares(x) for x in xs]).sum().sqrt().float()


_tree_norm = global_norm



class ClipState(NamedTuple):
    pass


def clip_by_global_norm(max_norm: float) -> InPlaceTransformation:
    """Scale all gradients by ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does.

    The norm is ``extra["global_norm"]`` when the caller passes it (a sharded step does, over every shard), else
    the norm of the leaves given.
    """
    check_hyper("clip_by_global_norm", "max_norm", max_norm, lo_open=True)

    def init(params):
        return ClipState()

    def factor(grads, state, params=None, *, global_norm=None, **extra):
        xs = leaves(grads)
        if not xs:
            return 1.0, state
        norm = global_norm if global_norm is not None else _tree_norm(grads)
        return torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(xs[0].device), state

    def update(grads, state, params=None, *, global_norm=None, inplace: InPlace = NOTHING, **extra):
        xs = leaves(grads)
        if not xs:
            return grads, state
        c = factor(grads, state, params, global_norm=global_norm)[0]
        return unflatten_like(grads, _mul(xs, c, inplace.updates)), state

    return InPlaceTransformation(init, update, fresh=_always, factor=factor)


class ScaleState(NamedTuple):
    pass


def scale(factor: float) -> InPlaceTransformation:
    """``u * factor``."""

    def init(params):
        return ScaleState()

    def update(grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        xs = leaves(grads)
        return (unflatten_like(grads, _mul(xs, factor, inplace.updates)) if xs else grads), state

    def scalar(grads, state, *args, **extra):
        return factor, state

    return InPlaceTransformation(init, update, fresh=_always, factor=scalar)


def lr_at(schedule: Schedule, count: torch.Tensor) -> float:
    """The learning rate for the update after ``count`` updates, checked (finite, not negative)."""
    k = count_value(count)
    lr = schedule(k)
    check_hyper("scale_by_learning_rate", f"the schedule's lr at step {k}", lr)
    return lr


class ScaleByLearningRateState(NamedTuple):
    count: torch.Tensor  # int64 scalar: updates done before this one (0 at the first update)


def scale_by_learning_rate(lr: float | Schedule) -> InPlaceTransformation:
    """``u * -lr(count)``; ``lr`` is a float or a schedule (step 0 is the first update), reported as ``.schedule``."""
    schedule = as_schedule(lr)

    def init(params):
        return ScaleByLearningRateState(_zero_count())

    def update(grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        xs = leaves(grads)
        new = ScaleByLearningRateState(state.count + 1)
        if not xs:
            return grads, new
        return unflatten_like(grads, _mul(xs, -lr_at(schedule, state.count), inplace.updates)), new

    return InPlaceTransformation(init, update, schedule=schedule, fresh=_always)


class AddDecayedWeightsState(NamedTuple):
    pass


def add_decayed_weights(weight_decay: float, mask: Any = None) -> InPlaceTransformation:
    """``u + weight_decay * p`` on the leaves where ``mask`` is True (a bool tree like the params, ``None`` leaves
    included, or a single bool; ``None`` = every leaf). The one implementation of masked weight decay; needs
    ``params``."""
    check_hyper("add_decayed_weights", "weight_decay", weight_decay)
    all_leaves = mask is None or mask is True

    def init(params):
        return AddDecayedWeightsState()

    def update(grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        if params is None:
            raise ValueError("add_decayed_weights: update needs params")
        us, ps = leaves(grads), leaves(params)
        idx = [i for i, d in enumerate(mask_list(mask, params)) if d]
        if not idx or not weight_decay:
            return grads, state
        sub_u, sub_p = [us[i] for i in idx], [ps[i] for i in idx]
        if inplace.updates:
            torch._foreach_add_(sub_u, sub_p, alpha=weight_decay)
            return grads, state
        out = list(us)
        for i, u in zip(idx, torch._foreach_add(sub_u, sub_p, alpha=weight_decay), strict=True):
            out[i] = u
        return unflatten_like(grads, out), state

    # fresh out unless the input was not and some leaves pass through undecayed (the caller's tensors)
    return InPlaceTransformation(init, update, fresh=lambda fresh: fresh or (all_leaves and bool(weight_decay)))


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # int64 scalar: updates done
    mu: Any  # first moment, like the params
    nu: Any  # second moment, like the params


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> InPlaceTransformation:
    """Adam's direction ``m_hat / (sqrt(v) / sqrt(bc2) + eps)`` with ``m_hat = m / bc1``, ``bc = 1 - b**t``: eps
    where ``torch.optim.Adam(W)`` puts it; no learning rate, no decay.

    Computed as ``m / (sqrt(v) * (bc1 / sqrt(bc2)) + eps * bc1)``, the same quantity with one pass fewer.
    """
    for name, b in (("b1", b1), ("b2", b2)):
        check_hyper("scale_by_adam", name, b, hi=1.0, hi_open=True)
    check_hyper("scale_by_adam", "eps", eps, lo_open=True)

    def init(params):
        return ScaleByAdamState(_zero_count(), _zeros_like(params), _zeros_like(params))

    def update(grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        g = leaves(grads)
        if not g:
            return grads, state._replace(count=state.count + 1)
        t = count_value(state.count) + 1
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        mu, nu = leaves(state.mu), leaves(state.nu)
        if inplace.state:  # the caller donated the state: update the moments where they are
            torch._foreach_lerp_(mu, g, 1 - b1)
            torch._foreach_mul_(nu, b2)
        else:
            mu, nu = torch._foreach_lerp(mu, g, 1 - b1), torch._foreach_mul(nu, b2)
        torch._foreach_addcmul_(nu, g, g, 1 - b2)
        if inplace.updates:  # the gradient tensors are ours and done with: they hold the denominator, then the update
            torch._foreach_copy_(g, nu)
            denom = g
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(nu)
        torch._foreach_mul_(denom, bc1 / math.sqrt(bc2))
        torch._foreach_add_(denom, eps * bc1)
        if inplace.updates:
            for m, d in zip(mu, denom, strict=True):
                torch.div(m, d, out=d)  # element-wise, so writing over the divisor is safe: no temporary
            upd = g
        else:
            upd = torch._foreach_div(mu, denom)
        new = ScaleByAdamState(state.count + 1, unflatten_like(grads, mu), unflatten_like(grads, nu))
        return unflatten_like(grads, upd), new

    return InPlaceTransformation(init, update, fresh=_always)


class ScaleByLionState(NamedTuple):
    mu: Any  # momentum, like the params


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> InPlaceTransformation:
    """Lion's direction (Chen et al. 2023): ``sign(lerp(mu, g, 1-b1))``; then ``mu = lerp(mu, g, 1-b2)``."""
    for name, b in (("b1", b1), ("b2", b2)):
        check_hyper("scale_by_lion", name, b, hi=1.0)

    def init(params):
        return ScaleByLionState(_zeros_like(params))

    @_on_leaves
    def update(g, grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        mu = leaves(state.mu)
        upd = torch._foreach_lerp(mu, g, 1 - b1)
        torch._foreach_sign_(upd)
        if inplace.state:  # the caller donated the state
            torch._foreach_lerp_(mu, g, 1 - b2)
            return unflatten_like(grads, upd), ScaleByLionState(unflatten_like(grads, mu))
        new_mu = torch._foreach_lerp(mu, g, 1 - b2)
        return unflatten_like(grads, upd), ScaleByLionState(unflatten_like(grads, new_mu))

    return InPlaceTransformation(init, update, fresh=_always)


class TraceState(NamedTuple):
    trace: Any  # the momentum buffer, like the params


def trace(decay: float, nesterov: bool = False) -> InPlaceTransformation:
    """Momentum as ``torch.optim.SGD`` computes it with dampening 0: ``buf = decay * buf + u``; the update is
    ``buf``, or ``u + decay * buf`` with ``nesterov`` (the zero initial buffer makes the first ``buf`` equal ``u``)."""
    check_hyper("trace", "decay (momentum)", decay, hi=1.0)

    def init(params):
        return TraceState(_zeros_like(params))

    @_on_leaves
    def update(g, grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        buf = leaves(state.trace)
        if inplace.state:  # the caller donated the state
            torch._foreach_mul_(buf, decay)
        else:
            buf = torch._foreach_mul(buf, decay)
        torch._foreach_add_(buf, g)
        new = TraceState(unflatten_like(grads, buf))
        if not nesterov:
            return new.trace, new  # the update is the new state itself: not fresh
        if inplace.updates:
            torch._foreach_add_(g, buf, alpha=decay)
            return grads, new
        return unflatten_like(grads, torch._foreach_add(g, buf, alpha=decay)), new

    return InPlaceTransformation(init, update, fresh=lambda fresh: nesterov)
