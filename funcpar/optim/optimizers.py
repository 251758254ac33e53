"""adamw, lion and sgd as chains of the building blocks in :mod:`funcpar.optim.transforms`.

Each equals its ``torch.optim`` counterpart to float32 round-off. Weight decay goes through the one
:func:`~funcpar.optim.transforms.add_decayed_weights`, and is left out of the chain when ``weight_decay == 0``.
"""

from __future__ import annotations

from typing import Any

import torch

from funcpar.optim.base import Fused, InPlaceTransformation, chain, leaves, mask_list
from funcpar.optim.schedules import Schedule
from funcpar.optim.transforms import (ScaleByAdamState, ScaleByLearningRateState, as_schedule, add_decayed_weights,
                                      count_value, lr_at, scale_by_adam, scale_by_learning_rate, scale_by_lion, trace)


def _decay(weight_decay: float, mask: Any) -> list[InPlaceTransformation]:
    return [add_decayed_weights(weight_decay, mask)] if weight_decay else []


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> InPlaceTransformation:
    """AdamW as ``torch.optim.AdamW`` computes it (bias-corrected moments, decoupled decay ``lr*wd*p``):
    ``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)``.

    ``mask``: bool tree (True = decay); ``None`` decays every leaf, like torch's single param group.
    State: ``(ScaleByAdamState(count, mu, nu), [AddDecayedWeightsState(),] ScaleByLearningRateState(count))``.
    """
    opt = chain(scale_by_adam(b1, b2, eps), *_decay(weight_decay, mask), scale_by_learning_rate(lr))
    return opt._replace(fused=_fused_adamw(b1, b2, eps, weight_decay, mask, as_schedule(lr)))


def _fused_adamw(b1: float, b2: float, eps: float, weight_decay: float, mask: Any, schedule: Schedule) -> Fused:
    """AdamW's update written into the parameters by torch's fused kernel (``torch._fused_adamw_``, CPU and CUDA):
    one pass over each leaf's parameter, gradient and moments, where the chain makes about eleven ``_foreach``
    passes over all of them (docs/MEASUREMENTS.md). Torch's arithmetic (``p *= 1 - lr*wd``,
    then ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``), so it equals ``torch.optim.AdamW`` to round-off as the
    chain does; the same state, counts included. ``coef`` (from :func:`chain`: the clipping or scaling stages ahead
    of it): the kernel's ``grad_scale`` is ``1/coef``, each gradient divided as it is read, no pass of its own."""

    def can(grads, params):
        gs, ps = leaves(grads), leaves(params)
        return (hasattr(torch, "_fused_adamw_") and len(gs) == len(ps) > 0 and
                all(x.dtype == torch.float32 and x.device == ps[0].device for x in gs + ps))

    def apply(grads, state, params=None, *, coef=None, **extra):
        adam, lrs = _stage(state, ScaleByAdamState), _stage(state, ScaleByLearningRateState)
        lr = lr_at(schedule, lrs.count)
        gs, ps, mus, nus = leaves(grads), leaves(params), leaves(adam.mu), leaves(adam.nu)
        # the kernel divides each gradient by grad_scale as it reads it: clipping's coefficient costs no pass of its own
        inv = None if coef is None else 1.0 / torch.as_tensor(coef, dtype=torch.float32, device=ps[0].device)
        decayed = mask_list(mask, params) if weight_decay else [False] * len(ps)
        t = torch.full((), float(count_value(adam.count) + 1), device=ps[0].device)
        for decay in (True, False):
            idx = [i for i, d in enumerate(decayed) if d == decay and ps[i].numel()]
            if idx:
                torch._fused_adamw_([ps[i] for i in idx], [gs[i] for i in idx], [mus[i] for i in idx],
                                    [nus[i] for i in idx], [], [t] * len(idx), lr=float(lr), beta1=b1, beta2=b2,
                                    weight_decay=weight_decay if decay else 0.0, eps=eps, amsgrad=False,
                                    maximize=False, grad_scale=inv)
        return tuple(s._replace(count=s.count + 1) if s is adam or s is lrs else s for s in state)

    return Fused(can, apply, scales=True)


def _stage(state: tuple, kind: type):
    """The one stage state of type ``kind`` in a chain's state (found by type, not by its position)."""
    found = [s for s in state if isinstance(s, kind)]
    if len(found) != 1:
        raise ValueError(f"adamw's fused update: expected one {kind.__name__} in the state, found {len(found)}")
    return found[0]


def lion(
    lr: float | Schedule, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0, mask: Any = None
) -> InPlaceTransformation:
    """Lion (Chen et al. 2023): ``p -= lr * (sign(b1*m + (1-b1)*g) + wd*p)``, then ``m = b2*m + (1-b2)*g``:
    ``chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)``.

    State: ``(ScaleByLionState(mu), [AddDecayedWeightsState(),] ScaleByLearningRateState(count))``.
    """
    return chain(scale_by_lion(b1, b2), *_decay(weight_decay, mask), scale_by_learning_rate(lr))


def sgd(
    lr: float | Schedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0, mask: Any = None
) -> InPlaceTransformation:
    """SGD as ``torch.optim.SGD`` computes it (L2 ``weight_decay`` added to the gradient before the momentum,
    dampening 0): ``chain(add_decayed_weights, trace, scale_by_learning_rate)``.

    State: ``([AddDecayedWeightsState(),] [TraceState(trace),] ScaleByLearningRateState(count))``, the bracketed
    ones only with ``weight_decay`` / ``momentum``.
    """
    if nesterov and not momentum:
        raise ValueError("sgd: nesterov=True needs momentum > 0")
    moment = [trace(momentum, nesterov)] if momentum else []
    return chain(*_decay(weight_decay, mask), *moment, scale_by_learning_rate(lr))
