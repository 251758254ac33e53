"""The GradientTransformation pair, chain, masked, apply_updates, and tree plumbing shared by the optimizers.

In-place work inside a chain: an ``update`` that knows the protocol takes a private keyword ``_fresh`` and carries
an attribute ``_fresh_out`` (set by :func:`fresh_protocol`), a function ``fresh_in -> fresh_out``. ``_fresh=True``
means the incoming update tensors were created by an earlier stage of the same chain and nothing else holds them,
so the stage may overwrite them; ``_fresh_out(fresh_in)`` says whether the stage's outputs are again such private
tensors (not the caller's grads, not params, not aliased to any state). :func:`chain` passes ``_fresh`` only to
stages that carry ``_fresh_out``, and treats the output of any other stage as not fresh; the caller of the outermost
update never passes it, so the caller's grads and params are never written.
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


class GradientTransformation(NamedTuple):
    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    schedule: Callable[[int], float] | None = None  # the learning rate at a step, for reporting
    fused: Fused | None = None  # the same update fused with its application (``None``: not available)


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


def fresh_protocol(update: Callable, fresh_out: Callable[[bool], bool]) -> Callable:
    """Mark ``update`` as taking ``_fresh=`` and producing fresh outputs when ``fresh_out(fresh_in)`` (see above)."""
    update._fresh_out = fresh_out
    return update


def factor_protocol(update: Callable, factor: Callable) -> Callable:
    """Mark ``update`` as multiplying every leaf by one scalar: ``factor(grads, state, params, **extra)`` returns
    ``(scalar, new_state)`` without touching ``grads``, so a fused last stage can fold the product of such stages into
    its own pass (clipping: one pass over the gradients fewer a step)."""
    update._factor = factor
    return update


def _fresh_after(t: GradientTransformation, fresh_in: bool) -> bool:
    fresh_out = getattr(t.update, "_fresh_out", None)
    return bool(fresh_out is not None and fresh_out(fresh_in))


def _call(t: GradientTransformation, grads, state, params, fresh: bool, extra: dict):
    """``t.update``, with ``_fresh`` passed only if ``t`` knows the protocol; returns (updates, state), fresh_out."""
    if getattr(t.update, "_fresh_out", None) is None:
        return t.update(grads, state, params, **extra), False
    return t.update(grads, state, params, _fresh=fresh, **extra), _fresh_after(t, fresh)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; each sees the previous one's updates (and ``params`` and ``**extra``).

    The state is the tuple of the transformations' states; ``schedule`` is the first one any of them reports.
    """

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(grads, state, params=None, _fresh=False, **extra):
        new = []
        for t, s in zip(transforms, state, strict=True):
            (grads, s), _fresh = _call(t, grads, s, params, _fresh, extra)
            new.append(s)
        return grads, tuple(new)

    def fresh_out(fresh):
        for t in transforms:
            fresh = _fresh_after(t, fresh)
        return fresh

    schedule = next((t.schedule for t in transforms if t.schedule is not None), None)
    return GradientTransformation(init, fresh_protocol(update, fresh_out), schedule, _chain_fused(transforms))


def _chain_fused(transforms: tuple) -> Fused | None:
    """A chain is fused when its last stage is and every earlier one turns fresh updates into fresh ones (clipping,
    scaling, in place): those run as they are, on the step's own gradients, then the last stage's fused update."""
    if not transforms or transforms[-1].fused is None or not all(_fresh_after(t, True) for t in transforms[:-1]):
        return None
    last = transforms[-1].fused

    def apply(grads, state, params=None, coef=None, **extra):
        new, fresh = [], True
        for t, s in zip(transforms[:-1], state[:-1], strict=True):
            factor = getattr(t.update, "_factor", None)
            if factor is not None:  # a scalar: folded into the product, the gradients untouched
                c, s = factor(grads, s, params, **extra)
                coef = c if coef is None else coef * c
            else:
                grads, fresh, coef = _scaled(grads, coef, fresh), fresh or coef is not None, None
                (grads, s), fresh = _call(t, grads, s, params, fresh, extra)
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

    def update(grads, state, params=None, _fresh=False, **extra):
        keep = keep_of(grads)
        sel_params = None if params is None else _select(params, keep)
        return _call(inner, _select(grads, keep), state, sel_params, _fresh, extra)[0]

    fresh_protocol(update, lambda fresh: _fresh_after(inner, fresh))
    return GradientTransformation(init, update, inner.schedule)


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf; a ``None`` update leaves the parameter as it is."""
    treedef = optree.tree_structure(params, none_is_leaf=True)
    ps = optree.tree_leaves(params, none_is_leaf=True)
    us = treedef.flatten_up_to(updates) if updates is not None else [None] * len(ps)
    out = [p if u is None else p + u for p, u in zip(ps, us, strict=True)]
    return optree.tree_unflatten(treedef, out)

