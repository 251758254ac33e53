"""The GradientTransformation pair, chain, masked, apply_updates, and tree plumbing shared by the optimizers.

In-place work is one explicit, typed argument: ``update(grads, state, params=None, *, inplace=InPlace(...))``.
``inplace.updates`` says the incoming update tensors belong to the caller alone (the train step's own gradients,
or tensors an earlier stage of the same chain made), so the stage may overwrite them; ``inplace.state`` says the
caller donated the state, so its tensors may be updated where they lie. A transformation that takes ``inplace``
declares it with its ``fresh`` field, ``fresh(updates_in) -> updates_out``: whether its outputs are again such
private tensors (not the caller's grads, not params, not aliased to any state). :func:`chain` passes ``inplace``
only to stages that declare ``fresh`` and treats any other stage's output as not private; an update called without
``inplace`` writes nothing it was given. A stage whose update multiplies every leaf by one scalar declares
``factor``, so a fused last stage folds it into its own pass.
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


NOTHING = InPlace()
EVERYTHING = InPlace(updates=True, state=True)  # the train step's call: its own gradients, its donated state


class GradientTransformation(NamedTuple):
    """An optimizer or one stage of it, as optax has them: ``init(params) -> state`` and ``update(grads, state,
    params=None, *, [inplace=InPlace(...),] **extra) -> (updates, new_state)``. ``extra`` are keyword-only values
    the caller supplies and a stage may read (``global_norm=``, ``finite=``); a stage passes on what it does not."""

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    schedule: Callable[[int], float] | None = None  # the learning rate at a step, for reporting
    fused: Fused | None = None  # the same update fused with its application (``None``: not available)
    # ``update`` takes ``inplace=``; ``fresh(updates_in) -> updates_out``: its outputs are private tensors again
    fresh: Callable[[bool], bool] | None = None
    # ``factor(grads, state, params=None, **extra) -> (scalar, new_state)``: ``update`` multiplies every leaf by it
    factor: Callable[..., tuple[Any, Any]] | None = None


def leaves(tree: Any) -> list:
    """Leaves in canonical order; ``None`` marks an absent leaf and is skipped."""
    return optree.tree_leaves(tree)


def unflatten_like(tree: Any, values: list) -> Any:
    return optree.tree_unflatten(optree.tree_structure(tree), values)


def mask_list(mask: Any, tree: Any) -> list[bool]:
    """One bool per present (non-``None``) leaf of ``tree``, from a bool tree matching ``tree`` (``None`` leaves
    included), a single bool, or ``None`` (all True)."""
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
    return bool(t.fresh is not None and t.fresh(fresh_in))


def _call(t: GradientTransformation, grads, state, params, inplace: InPlace, extra: dict):
    """``t.update``, given ``inplace`` only if ``t`` declares ``fresh``; returns (updates, state), fresh_out."""
    if t.fresh is None:
        return t.update(grads, state, params, **extra), False
    return t.update(grads, state, params, inplace=inplace, **extra), _fresh_after(t, inplace.updates)


def update_with(t: GradientTransformation, grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
    """``t.update(grads, state, params, **extra)``, given ``inplace`` where ``t`` declares that it takes it (a
    transformation written without the protocol is called without it, and so writes nothing it is given)."""
    return _call(t, grads, state, params, inplace, extra)[0]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; each sees the previous one's updates (and ``params`` and ``**extra``).

    The state is the tuple of the transformations' states; ``schedule`` is the first one any of them reports.
    """

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        new, fresh = [], inplace.updates
        for t, s in zip(transforms, state, strict=True):
            (grads, s), fresh = _call(t, grads, s, params, inplace._replace(updates=fresh), extra)
            new.append(s)
        return grads, tuple(new)

    def fresh_out(fresh):
        for t in transforms:
            fresh = _fresh_after(t, fresh)
        return fresh

    schedule = next((t.schedule for t in transforms if t.schedule is not None), None)
    return GradientTransformation(init, update, schedule, _chain_fused(transforms), fresh=fresh_out)


def _chain_fused(transforms: tuple) -> Fused | None:
    """A chain is fused when its last stage is and every earlier one turns private updates into private ones
    (clipping, scaling, in place): those run as they are, on the step's own gradients, then the last stage's fused
    update. A stage that declares ``factor`` adds no pass: its scalar joins the product the fused stage applies."""
    if not transforms or transforms[-1].fused is None or not all(_fresh_after(t, True) for t in transforms[:-1]):
        return None
    last = transforms[-1].fused

    def apply(grads, state, params=None, *, coef=None, **extra):
        new, fresh = [], True
        for t, s in zip(transforms[:-1], state[:-1], strict=True):
            if t.factor is not None:  # a scalar: folded into the product, the gradients untouched
                c, s = t.factor(grads, s, params, **extra)
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
    return optree.tree_unflatten(treedef, [v if k else None for v, k in zip(vals, keep, strict=True)])


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """``inner`` on the leaves where ``mask`` is True; the others are frozen: no update (``None``) and no state."""

    def keep_of(tree):
        treedef = optree.tree_structure(tree, none_is_leaf=True)
        return [bool(m) for m in treedef.flatten_up_to(mask)]

    def init(params):
        return inner.init(_select(params, keep_of(params)))

    def update(grads, state, params=None, *, inplace: InPlace = NOTHING, **extra):
        keep = keep_of(grads)
        sel_params = None if params is None else _select(params, keep)
        return update_with(inner, _select(grads, keep), state, sel_params, inplace=inplace, **extra)

    return GradientTransformation(init, update, inner.schedule, fresh=lambda fresh: _fresh_after(inner, fresh))


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf; a ``None`` update leaves the parameter as it is."""
    treedef = optree.tree_structure(params, none_is_leaf=True)
    ps = optree.tree_leaves(params, none_is_leaf=True)
    us = treedef.flatten_up_to(updates) if updates is not None else [None] * len(ps)
    out = [p if u is None else p + u for p, u in zip(ps, us, strict=True)]
    return optree.tree_unflatten(treedef, out)

