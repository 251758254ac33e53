"""Pytree helpers on top of optree: dotted key paths, map with path, filter/partition/combine.

A parameter tree is any nesting of dicts, lists, tuples and NamedTuples whose leaves are tensors. Every leaf has a
*path*, written with dots: ``layers.3.attn.wq``. Errors everywhere in funcpar name leaves by this path.
"""

from __future__ import annotations

from typing import Any, Callable

import optree

__all__ = [
    "path_str",
    "leaves_with_path",
    "map_with_path",
    "partition",
    "combine",
    "filter",
    "first_difference",
]


def _entry_name(e: Any) -> Any:
    if not isinstance(e, optree.PyTreeEntry):
        return e
    for attr in ("field", "name", "key", "index"):  # NamedTuple field, attribute, dict key, sequence index
        if hasattr(e, attr):
            return getattr(e, attr)
    return e


def path_str(path: Any) -> str:
    """``('layers', 3, 'attn', 'wq')`` (or an optree accessor) -> ``'layers.3.attn.wq'``; the root is ``'<root>'``."""
    return ".".join(str(_entry_name(k)) for k in path) if len(path) else "<root>"


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree)
    return [path_str(a) for a in accessors], leaves, treedef


def leaves_with_path(tree: Any) -> list[tuple[str, Any]]:
    """``[(dotted_path, leaf), ...]`` in optree's canonical leaf order (NamedTuple fields by name)."""
    paths, leaves, _ = _flatten(tree)
    return list(zip(paths, leaves, strict=True))


def map_with_path(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn(path, leaf, *rest_leaves)`` for every leaf; ``rest`` trees must have ``tree``'s structure."""
    paths, leaves, treedef = _flatten(tree)
    rests = [treedef.flatten_up_to(r) for r in rest]
    return optree.tree_unflatten(treedef, [fn(p, x, *r) for p, x, *r in zip(paths, leaves, *rests, strict=True)])


def partition(tree: Any, pred: Callable[[str, Any], bool]) -> tuple[Any, Any]:
    """Split ``tree`` into ``(selected, rest)``: same structure, leaves replaced by ``None`` where not kept.

    ``pred(path, leaf)`` decides. ``combine(selected, rest)`` gives the original tree back.
    """
    paths, leaves, treedef = _flatten(tree)
    keep = [bool(pred(p, x)) for p, x in zip(paths, leaves, strict=True)]
    a = [x if k else None for x, k in zip(leaves, keep, strict=True)]
    b = [None if k else x for x, k in zip(leaves, keep, strict=True)]
    return optree.tree_unflatten(treedef, a), optree.tree_unflatten(treedef, b)


def filter(tree: Any, pred: Callable[[str, Any], bool]) -> Any:  # noqa: A001 - mirrors equinox
    """The leaves where ``pred(path, leaf)`` holds; the others become ``None``."""
    return partition(tree, pred)[0]


def combine(*trees: Any) -> Any:
    """Leaf-wise first non-``None`` of trees of one structure (``None`` counted as a leaf)."""
    if not trees:
        raise ValueError("combine() needs at least one tree")
    flat = [optree.tree_flatten(t, none_is_leaf=True) for t in trees]
    treedef = flat[0][1]
    for i, (_, d) in enumerate(flat[1:], 1):
        if d != treedef:
            raise ValueError(f"combine(): tree {i} has structure {d}, tree 0 has {treedef}")
    out = []
    for items in zip(*(leaves for leaves, _ in flat), strict=True):
        out.append(next((x for x in items if x is not None), None))
    return optree.tree_unflatten(treedef, out)


def first_difference(a: list, b: list) -> int:
    """The first index where ``a`` and ``b`` differ; where one is a prefix of the other, the shorter one's length."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
