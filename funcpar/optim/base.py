"""The GradientTransformation pair and its subclass for the train step, chain, masked, apply_updates, the two
named values of an update tree, and tree plumbing shared by the optimizers.

A :class:`GradientTransformation` is exactly optax's pair, ``(init, update)``, and is called as optax calls one:
``update(grads, state, params)``. What funcpar's train step can use beyond the pair lives in the subclass
:class:`InPlaceTransformation`, which the step and :func:`chain` recognise by type: an update that takes the
caller's keyword values (``**extra``: ``global_norm=``, ``finite=``) and, where it declares ``fresh``, the in-place
protocol below; a ``fused`` kernel; a ``factor``; a ``schedule``. The step reads them through :func:`schedule_of`,
:func:`fused_of` and :func:`update_with`, never the fields.

In-place work is one explicit, typed argument: ``update(grads, state, params=None, *, inplace=InPlace(...))``.
``inplace.updates`` says the incoming update tensors belong to the caller alone (the train step's own gradients,
or tensors an earlier stage of the same chain made), so the stage may overwrite them; ``inplace.state`` says the
caller donated the state, so its tensors may be updated where they lie; ``inplace.params`` (read by
:func:`update_with` only) says the update may go straight into the parameters. A transformation that takes
``inplace`` declares it with its ``fresh`` field, ``fresh(updates_in) -> updates_out``: whether its outputs are
again such private tensors (not the caller's grads, not params, not aliased to any state). :func:`chain` passes
``inplace`` only to stages that declare ``fresh`` and treats any other stage's output as not private; an update
called without ``inplace`` writes nothing it was given. A stage whose update multiplies every leaf by one scalar
declares ``factor``, so a fused last stage folds it into its own pass.

Two named values keep ``None`` to one meaning. :data:`ABSENT` *is* ``None`` (optree's empty subtree, which every
tree walk here skips) and means one thing in a tree: no leaf here, so nothing to update (a leaf frozen under
:func:`masked`, a leaf another pipeline stage holds, every leaf of a step that
:func:`~funcpar.optim.loss_scale.apply_if_finite` skipped). :data:`WRITTEN` stands for a whole updates tree that
:func:`update_with` has already written into the parameters: nothing left to add.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch


class Fused(NamedTuple):
    """A transformation's update and its application to the parameters in one pass per leaf, in place: for the
    train step, which donates its state and owns its gradients. ``can(grads, params)``: whether it applies to these
    leaves (dtypes, devices; checked before anything is written); ``apply(grads, state, params, **extra)``: writes
    the new parameters into ``params`` and the moments into ``state``'s tensors, returns the new state."""

    can: Callable[[Any, Any], bool]
    apply: Callable[..., Any]
    scales: bool = False  # ``apply`` takes ``coef=``: a scalar every gradient is multiplied by first, in its pass


class InPlace(NamedTuple):
    """What an ``update`` may overwrite (see the module docstring); the default, nothing."""

    updates: bool = False  # the incoming update tensors are the caller's alone
    state: bool = False  # the state was donated: its tensors may be updated where they lie
    params: bool = False  # the update may be written into the parameters (:func:`update_with`'s fused path)


NOTHING = InPlace()
# the train step's call: its own gradients, its donated state, the parameters in its own buffers
EVERYTHING = InPlace(updates=True, state=True, params=True)

ABSENT = None
"""No leaf here: the one meaning of ``None`` in a tree of params, grads, updates or state (optree's empty subtree,
which :func:`leaves` and the ``_foreach`` batches skip). A leaf frozen under :func:`masked` is ``ABSENT`` from what
its inner transformation sees and from its update; so is a leaf another pipeline stage holds, and every leaf of the
update of a step :func:`~funcpar.optim.loss_scale.apply_if_finite` skipped. :func:`apply_updates` leaves such a leaf
as it is."""


class _Written:
    """The type of :data:`WRITTEN` (one instance)."""

    def __repr__(self) -> str:
        return "WRITTEN"

    def __reduce__(self) -> str:
        return "WRITTEN"


WRITTEN = _Written()
"""The updates :func:`update_with` returns when it has already written them into the parameters (a fused kernel,
``inplace.params``): a whole tree's worth, nothing left to add. :func:`apply_updates` returns the params as they are."""


class GradientTransformation(NamedTuple):
    """An optimizer or one stage of it, exactly optax's pair: ``init(params) -> state`` and ``update(grads, state,
    params=None) -> (updates, new_state)``. Called with those three only; a transformation that reads the caller's
    keyword values, works in place or has a fused kernel is an :class:`InPlaceTransformation`."""

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


class InPlaceTransformation(GradientTransformation):
    """A :class:`GradientTransformation` with what the train step can use beyond the pair (the step and
    :func:`chain` recognise it by type). ``update(grads, state, params=None, *, [inplace=InPlace(...),] **extra)``:
    ``extra`` are keyword-only values the caller supplies and a stage may read (``global_norm=``, ``finite=``); a
    stage passes on what it does not. Still the pair as a tuple (``init, update = t``); the keyword-only fields:

    - ``schedule(step) -> lr``: the learning rate at a step, for reporting (:func:`schedule_of`);
    - ``fused``: the same update fused with its application to the parameters, a :class:`Fused` (:func:`fused_of`);
    - ``fresh(updates_in) -> updates_out``: ``update`` takes ``inplace=``, and its outputs are private tensors again;
    - ``factor(grads, state, params=None, **extra) -> (scalar, new_state)``: ``update`` multiplies every leaf by it.

    ``None`` for each: not available. Immutable, as the pair: ``t._replace(fused=...)`` makes another."""

    EXTRAS = ("schedule", "fused", "fresh", "factor")

    schedule: Callable[[int], float] | None
    fused: Fused | None
    fresh: Callable[[bool], bool] | None
    factor: Callable[..., tuple[Any, Any]] | None

    def __new__(cls, init: Callable[[Any], Any], update: Callable[..., tuple[Any, Any]], *,
                schedule: Callable[[int], float] | None = None, fused: Fused | None = None,
                fresh: Callable[[bool], bool] | None = None, factor: Callable[..., tuple[Any, Any]] | None = None):
        self = super().__new__(cls, init, update)
        for name, value in zip(cls.EXTRAS, (schedule, fused, fresh, factor), strict=True):
            object.__setattr__(self, name, value)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: use _replace({name}=...)")

    @classmethod
    def _make(cls, iterable):
        return cls(*iterable)

    def _replace(self, **changes: Any) -> InPlaceTransformation:
        fields = {name: getattr(self, name) for name in (*self._fields, *self.EXTRAS)}
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise ValueError(f"{type(self).__name__}._replace: no field {', '.join(unknown)}")
        fields |= changes
        return type(self)(fields.pop("init"), fields.pop("update"), **fields)

    def __repr__(self) -> str:
        extras = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.EXTRAS if getattr(self, n) is not None)
        return f"{type(self).__name__}(init={self.init!r}, update={self.update!r}{', ' if extras else ''}{extras})"


def schedule_of(t: GradientTransformation) -> Callable[[int], float] | None:
    """The learning rate ``t`` reports at a step (``schedule(step) -> lr``), or ``None``: it reports none (a plain
    pair, or no learning-rate stage)."""
    return t.schedule if isinstance(t, InPlaceTransformation) else None


def fused_of(t: GradientTransformation) -> Fused | None:
    """``t``'s update fused with its application to the parameters, or ``None``: it has none."""
    return t.fused if isinstance(t, InPlaceTransformation) else None


def leaves(tree: Any) -> list:
    """Leaves in canonical order; an :data:`ABSENT` leaf is skipped."""
    return optree.tree_leaves(tree)


def unflatten_like(tree: Any, values: list) -> Any:
    return optree.tree_unflatten(optree.tree_structure(tree), values)


def mask_list(mask: Any, tree: Any) -> list[bool]:
    """One bool per present (not :data:`ABSENT`) leaf of ``tree``, from a bool tree matching ``tree`` (its absent
    leaves included), a single bool, or ``None`` (all True)."""
    treedef = optree.tree_structure(tree, none_is_leaf=True)
    vals = optree.tree_leaves(tree, none_is_leaf=True)
    if mask is None or isinstance(mask, bool):
        ms = [True if mask is None else mask] * len(vals)
    else:
        ms = treedef.flatten_up_to(mask)
    return [bool(m) for v, m in zip(vals, ms, strict=True) if v is not None]


def decay_mask(params: Any) -> Any:
    """The usual weight-decay mask: True for matrices (ndim >= 2), False for norms, biases and other vectors.

    Build it from the params as given to ``Step.init`` (or the global ones): it is a tree of bools, which stays
    valid when ZeRO hands the optimizer 1-D slices.
    """
    return optree.tree_map(lambda x: x.ndim >= 2, params)


def _fresh_after(t: GradientTransformation, fresh_in: bool) -> bool:
    return bool(isinstance(t, InPlaceTransformation) and t.fresh is not None and t.fresh(fresh_in))


def _call(t: GradientTransformation, grads, state, params, inplace: InPlace, extra: dict):
    """``t.update`` as ``t`` declares it: a plain pair with ``(grads, state, params)`` only (as optax calls one), an
    :class:`InPlaceTransformation` with ``extra`` too, and ``inplace`` where it declares ``fresh``. Returns
    ``(updates, state), fresh_out``."""
    if not isinstance(t, InPlaceTransformation):
        return t.update(grads, state, params), False
    if t.fresh is None:
        return t.update(grads, state, params, **extra), False
    return t.update(grads, state, params, inplace=inplace, **extra), _fresh_after(t, inplace.updates)


def update_with(t: GradientTransformation, grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
    """``(updates, new_state)`` of ``t`` as ``t`` declares its update: a plain pair is called with ``(grads, state,
    params)`` only (the keyword values dropped, as optax does); an :class:`InPlaceTransformation` with ``extra`` too,
    and with ``inplace`` where it declares ``fresh`` (one written without the protocol writes nothing it is given).

    With ``inplace`` donating everything (:data:`EVERYTHING`: the updates, the state and the parameters), a
    transformation whose fused kernel takes these leaves (``fused.can(grads, params)``) writes the update into
    ``params`` in one pass per leaf; the updates returned are then :data:`WRITTEN`. The train step's one entry."""
    fused = fused_of(t)
    if (fused is not None and params is not None and inplace.params and inplace.updates and inplace.state
            and fused.can(grads, params)):
        return WRITTEN, fused.apply(grads, state, params, **extra)
    return _call(t, grads, state, params, inplace, extra)[0]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; each sees the previous one's updates (and ``params`` and, where it is an
    :class:`InPlaceTransformation`, ``**extra``).

    The state is the tuple of the transformations' states. A chain of plain pairs is a plain pair; with any
    :class:`InPlaceTransformation` in it, one too: its ``schedule`` the first one any of them reports, its ``fused``
    kernel where the last stage has one (:func:`_chain_fused`), and ``inplace`` reaching the stages that declare it.
    """

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        new, fresh = [], inplace.updates
        for t, s in zip(transforms, state, strict=True):
            (grads, s), fresh = _call(t, grads, s, params, inplace._replace(updates=fresh), extra)
            new.append(s)
        return grads, tuple(new)

    if not any(isinstance(t, InPlaceTransformation) for t in transforms):
        return GradientTransformation(init, update)

    def fresh_out(fresh):
        for t in transforms:
            fresh = _fresh_after(t, fresh)
        return fresh

    schedule = next((s for s in map(schedule_of, transforms) if s is not None), None)
    return InPlaceTransformation(init, update, schedule=schedule, fused=_chain_fused(transforms), fresh=fresh_out)


def _factor_of(t: GradientTransformation):
    return t.factor if isinstance(t, InPlaceTransformation) else None


def _chain_fused(transforms: tuple) -> Fused | None:
    """A chain is fused when its last stage is and every earlier one turns private updates into private ones
    (clipping, scaling, in place): those run as they are, on the step's own gradients, then the last stage's fused
    update. A stage that declares ``factor`` adds no pass: its scalar joins the product the fused stage applies."""
    last = fused_of(transforms[-1]) if transforms else None
    if last is None or not all(_fresh_after(t, True) for t in transforms[:-1]):
        return None

    def apply(grads, state, params=None, *, coef=None, **extra):
        new, fresh = [], True
        for t, s in zip(transforms[:-1], state[:-1], strict=True):
            factor = _factor_of(t)
            if factor is not None:  # a scalar: folded into the product, the gradients untouched
                c, s = factor(grads, s, params, **extra)
                coef = c if coef is None else coef * c
            else:
                grads, fresh, coef = _scaled(grads, coef, fresh), fresh or coef is not None, None
                (grads, s), fresh = _call(t, grads, s, params, InPlace(updates=fresh), extra)
            new.append(s)
        if coef is not None and not last.scales:
            grads, coef = _scaled(grads, coef, fresh), None
        return (*new, last.apply(grads, state[-1], params, **({} if coef is None else {"coef": coef}), **extra))

    return Fused(last.can, apply, scales=True)


def mul_leaves(xs: list, factor, fresh: bool) -> list:
    """``xs * factor``, in place when ``xs`` are the chain's own (fresh) tensors."""
    if fresh:
        torch._foreach_mul_(xs, factor)
        return xs
    return torch._foreach_mul(xs, factor)


def _scaled(grads: Any, coef, fresh: bool) -> Any:
    """``grads * coef`` (``coef`` None: ``grads``), in place when they are the chain's own."""
    xs = leaves(grads)
    if coef is None or not xs:
        return grads
    return unflatten_like(grads, mul_leaves(xs, coef, fresh))


def _select(tree: Any, keep: list[bool]) -> Any:
    treedef = optree.tree_structure(tree, none_is_leaf=True)
    vals = optree.tree_leaves(tree, none_is_leaf=True)
    return optree.tree_unflatten(treedef, [v if k else ABSENT for v, k in zip(vals, keep, strict=True)])


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """``inner`` on the leaves where ``mask`` is True; the others are frozen: :data:`ABSENT` from what ``inner`` sees,
    so no state, and from the updates, so no update. An :class:`InPlaceTransformation` when ``inner`` is one (its
    schedule and in-place protocol, no fused kernel)."""

    def keep_of(tree):
        treedef = optree.tree_structure(tree, none_is_leaf=True)
        return [bool(m) for m in treedef.flatten_up_to(mask)]

    def init(params):
        return inner.init(_select(params, keep_of(params)))

    def update(grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        keep = keep_of(grads)
        sel_params = None if params is None else _select(params, keep)
        # (never into the params: the frozen leaves' ABSENT updates are this update's to return)
        return update_with(inner, _select(grads, keep), state, sel_params, inplace=inplace._replace(params=False),
                           **extra)

    if not isinstance(inner, InPlaceTransformation):
        return GradientTransformation(init, update)
    return InPlaceTransformation(init, update, schedule=inner.schedule,
                                 fresh=lambda fresh: _fresh_after(inner, fresh))


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf; an :data:`ABSENT` update leaves the parameter as it is, and so do updates
    :data:`WRITTEN` already (the params returned as they are)."""
    if updates is WRITTEN:
        return params
    treedef = optree.tree_structure(params, none_is_leaf=True)
    ps = optree.tree_leaves(params, none_is_leaf=True)
    us = treedef.flatten_up_to(updates) if updates is not ABSENT else [ABSENT] * len(ps)
    out = [p if u is ABSENT else p + u for p, u in zip(ps, us, strict=True)]
    return optree.tree_unflatten(treedef, out)
