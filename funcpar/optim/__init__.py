"""Optimizers as optax-style pure pairs ``GradientTransformation(init, update)`` over pytrees.

``update(grads, state, params=None, **extra) -> (updates, new_state)``; ``apply_updates(params, updates)`` adds
them. Leaves may be any shape (funcpar's ZeRO hands them 1-D slices), so everything is element-wise and batched
with ``torch._foreach_*``. Nothing here knows about meshes: a sharded caller passes ``global_norm=`` to
:func:`clip_by_global_norm`. Masks are trees of bools matching the params (see :func:`decay_mask`), because they
must mean the same thing whether a leaf is whole or a ZeRO slice of it.
"""

from .base import GradientTransformation as GradientTransformation
from .base import apply_updates as apply_updates
from .base import chain as chain
from .base import decay_mask as decay_mask
from .base import masked as masked
from .schedules import constant as constant
from .schedules import warmup_cosine as warmup_cosine
from .schedules import warmup_linear_decay as warmup_linear_decay
from .transforms import AdamWState as AdamWState
from .transforms import LionState as LionState
from .transforms import SGDState as SGDState
from .transforms import adamw as adamw
from .transforms import clip_by_global_norm as clip_by_global_norm
from .transforms import global_norm as global_norm
from .transforms import lion as lion
from .transforms import sgd as sgd
