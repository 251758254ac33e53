"""Optimizers as optax-style pure pairs ``GradientTransformation(init, update)`` over pytrees.

``update(grads, state, params=None) -> (updates, new_state)``; ``apply_updates(params, updates)`` adds them. An
optimizer is a :func:`chain` of small transformations, each with its own NamedTuple state, e.g. ``adamw =
chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)``, ``lion = chain(scale_by_lion,
add_decayed_weights, scale_by_learning_rate)``, ``sgd = chain(add_decayed_weights, trace, scale_by_learning_rate)``;
the chain's state is the tuple of its stages' states, and its schedule the learning-rate stage's. Build other
optimizers the same way (e.g. ``chain(clip_by_global_norm(1.0), scale_by_lion(), scale_by_learning_rate(1e-4))``).

Ours are :class:`InPlaceTransformation` s, the pair's subclass for the train step (which recognises it by type):
their ``update`` also takes the caller's keyword values (``global_norm=``, ``finite=``) and, where declared,
``inplace=``; they may carry a schedule and a fused kernel (:func:`schedule_of`, :func:`fused_of`), and
:func:`update_with` runs any transformation as it declares itself. A plain pair of one's own works wherever ours do,
out of place, and is called as optax calls one, with ``(grads, state, params)`` only.

Leaves may be any shape (funcpar's ZeRO hands them 1-D slices, some empty), so everything is element-wise and
batched with ``torch._foreach_*``; :data:`ABSENT` (``None``) leaves (frozen under :func:`masked`, held by another
pipeline stage) are skipped, and :data:`WRITTEN` is updates already written into the params. Within a chain, a
stage may overwrite the update tensors an earlier stage created instead of allocating new ones (see
:mod:`funcpar.optim.base`); the caller's grads, params and state are written only where it says so (``inplace``).
Nothing here knows about meshes: a sharded caller passes ``global_norm=`` to :func:`clip_by_global_norm`. Masks are
trees of bools matching the params (see :func:`decay_mask`), because they must mean the same thing whether a leaf is
whole or a ZeRO slice of it; :func:`add_decayed_weights` is the one place weight decay is masked.
"""

from funcpar.optim.base import Fused as Fused
from funcpar.optim.base import EVERYTHING as EVERYTHING
from funcpar.optim.base import NOTHING as NOTHING
from funcpar.optim.base import ABSENT as ABSENT
from funcpar.optim.base import WRITTEN as WRITTEN
from funcpar.optim.base import GradientTransformation as GradientTransformation
from funcpar.optim.base import InPlaceTransformation as InPlaceTransformation
from funcpar.optim.base import InPlace as InPlace
from funcpar.optim.base import schedule_of as schedule_of
from funcpar.optim.base import fused_of as fused_of
from funcpar.optim.base import apply_updates as apply_updates
from funcpar.optim.base import chain as chain
from funcpar.optim.base import decay_mask as decay_mask
from funcpar.optim.base import masked as masked
from funcpar.optim.base import update_with as update_with
from funcpar.optim.optimizers import adamw as adamw
from funcpar.optim.optimizers import lion as lion
from funcpar.optim.optimizers import sgd as sgd
from funcpar.optim.schedules import constant as constant
from funcpar.optim.schedules import warmup_cosine as warmup_cosine
from funcpar.optim.schedules import warmup_linear_decay as warmup_linear_decay
from funcpar.optim.transforms import AddDecayedWeightsState as AddDecayedWeightsState
from funcpar.optim.transforms import ClipState as ClipState
from funcpar.optim.transforms import ScaleByAdamState as ScaleByAdamState
from funcpar.optim.transforms import ScaleByLearningRateState as ScaleByLearningRateState
from funcpar.optim.transforms import ScaleByLionState as ScaleByLionState
from funcpar.optim.transforms import ScaleState as ScaleState
from funcpar.optim.transforms import TraceState as TraceState
from funcpar.optim.transforms import add_decayed_weights as add_decayed_weights
from funcpar.optim.transforms import clip_by_global_norm as clip_by_global_norm
from funcpar.optim.transforms import global_norm as global_norm
from funcpar.optim.transforms import scale as scale
from funcpar.optim.transforms import scale_by_adam as scale_by_adam
from funcpar.optim.transforms import scale_by_learning_rate as scale_by_learning_rate
from funcpar.optim.transforms import scale_by_lion as scale_by_lion
from funcpar.optim.transforms import trace as trace
from funcpar.optim.loss_scale import LossScaleState as LossScaleState
from funcpar.optim.loss_scale import apply_if_finite as apply_if_finite
from funcpar.optim.loss_scale import loss_scale as loss_scale
