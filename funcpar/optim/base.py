"""The GradientTransformation pair, chain, masked, apply_updates, and tree plumbing shared by the optimizers."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree


class GradientTransformation(NamedTuple):
    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    schedule: Callable[[int], float] | None = None  # the learning rate at a step, for reporting


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
    return [bool(m) for v, m in zip(vals, ms) if v is not None]


def decay_mask(params: Any) -> Any:
    """The usual weight-decay mask: True for matrices (ndim >= 2), False for norms, biases and other vectors.

    Build it from the params as given to ``Step.init`` (or the global ones): it is a tree of bools, which stays
    valid when ZeRO hands the optimizer 1-D slices.
    """
    return optree.tree_map(lambda x: x.ndim >= 2, params)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; each sees the previous one's updates."""

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(grads, state, params=None, **extra):
        new = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params, **extra)
            new.append(s)
        return grads, tuple(new)

    schedule = next((t.schedule for t in transforms if t.schedule is not None), None)
    return GradientTransformation(init, update, schedule)


def _select(tree: Any, keep: list[bool]) -> Any:
    treedef = optree.tree_structure(tree, none_is_leaf=True)
    vals = optree.tree_leaves(tree, none_is_leaf=True)
    return optree.tree_unflatten(treedef, [v if k else None for v, k in zip(vals, keep)])


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """``inner`` on the leaves where ``mask`` is True; the others are frozen: no update (``None``) and no state."""

    def keep_of(tree):
        treedef = optree.tree_structure(tree, none_is_leaf=True)
        return [bool(m) for m in treedef.flatten_up_to(mask)]

    def init(params):
        return inner.init(_select(params, keep_of(params)))

    def update(grads, state, params=None, **extra):
        keep = keep_of(grads)
        sel_params = None if params is None else _select(params, keep)
        return inner.update(_select(grads, keep), state, sel_params, **extra)

    return GradientTransformation(init, update, inner.schedule)


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf; a ``None`` update leaves the parameter as it is."""
    treedef = optree.tree_structure(params, none_is_leaf=True)
    ps = optree.tree_leaves(params, none_is_leaf=True)
    us = treedef.flatten_up_to(updates) if updates is not None else [None] * len(ps)
    out = [p if u is None else p + u for p, u in zip(ps, us)]
    return optree.tree_unflatten(treedef, out)

