"""adamw, lion and sgd as chains of the building blocks in :mod:`funcpar.optim.transforms`.

Each equals its ``torch.optim`` counterpart to float32 round-off. Weight decay goes through the one
:func:`~funcpar.optim.transforms.add_decayed_weights`, and is left out of the chain when ``weight_decay == 0``.
"""

from __future__ import annotations

from typing import Any

from .base import GradientTransformation, chain
from .schedules import Schedule
from .transforms import add_decayed_weights, scale_by_adam, scale_by_learning_rate, scale_by_lion, trace


def _decay(weight_decay: float, mask: Any) -> list[GradientTransformation]:
    return [add_decayed_weights(weight_decay, mask)] if weight_decay else []


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW as ``torch.optim.AdamW`` computes it (bias-corrected moments, decoupled decay ``lr*wd*p``):
    ``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)``.

    ``mask``: bool tree (True = decay); ``None`` decays every leaf, like torch's single param group.
    State: ``(ScaleByAdamState(count, mu, nu), [AddDecayedWeightsState(),] ScaleByLearningRateState(count))``.
    """
    return chain(scale_by_adam(b1, b2, eps), *_decay(weight_decay, mask), scale_by_learning_rate(lr))


def lion(
    lr: float | Schedule, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0, mask: Any = None
) -> GradientTransformation:
    """Lion (Chen et al. 2023): ``p -= lr * (sign(b1*m + (1-b1)*g) + wd*p)``, then ``m = b2*m + (1-b2)*g``:
    ``chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)``.

    State: ``(ScaleByLionState(mu), [AddDecayedWeightsState(),] ScaleByLearningRateState(count))``.
    """
    return chain(scale_by_lion(b1, b2), *_decay(weight_decay, mask), scale_by_learning_rate(lr))


def sgd(
    lr: float | Schedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0, mask: Any = None
) -> GradientTransformation:
    """SGD as ``torch.optim.SGD`` computes it (L2 ``weight_decay`` added to the gradient before the momentum,
    dampening 0): ``chain(add_decayed_weights, trace, scale_by_learning_rate)``.

    State: ``([AddDecayedWeightsState(),] [TraceState(trace),] ScaleByLearningRateState(count))``, the bracketed
    ones only with ``weight_decay`` / ``momentum``.
    """
    if nesterov and not momentum:
        raise ValueError("sgd: nesterov=True needs momentum > 0")
    moment = [trace(momentum, nesterov)] if momentum else []
    return chain(*_decay(weight_decay, mask), *moment, scale_by_learning_rate(lr))
