"""Partition specs: which mesh axes split which tensor dimension.

``P(None, "tp")`` says: dimension 0 is whole, dimension 1 is split into ``tp`` equal blocks, rank ``c`` (its tp
coordinate) holding block ``c``. An entry may name several axes, ``P(("dp", "tp"))``: the dimension is split into
``dp*tp`` blocks, the first axis named being the major one (block ``c_dp*tp + c_tp``). Dimensions beyond the spec's
length are whole, and any mesh axis a spec does not name replicates the leaf along that axis.

``P`` is an opaque, immutable, hashable leaf: optree never looks inside it, so a tree of specs has the same
structure as the tree of parameters it describes (or is a prefix of it: one ``P()`` over a subtree covers every
leaf below).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import optree

from funcpar.tree import leaves_with_path, path_str

if TYPE_CHECKING:  # pragma: no cover
    from funcpar.parallel.mesh import Mesh

__all__ = ["P", "SpecError", "validate", "local_shape", "global_shape", "local_slice", "broadcast_specs"]


class SpecError(ValueError):
    """A partition spec that does not fit its tensor, its mesh or its tree."""


class P:
    """A partition spec: one entry per leading tensor dimension, each ``None``, an axis name or a tuple of names."""

    __slots__ = ("_dims",)

    def __init__(self, *dims: None | str | Sequence[str]):
        norm: list[None | str | tuple[str, ...]] = []
        for d in dims:
            if d is None or isinstance(d, str):
                norm.append(d)
            elif isinstance(d, (tuple, list)) and all(isinstance(a, str) for a in d):
                t = tuple(d)
                norm.append(None if not t else (t[0] if len(t) == 1 else t))
            else:
                raise SpecError(
                    f"P{tuple(dims)!r}: each entry must be None, an axis name or a tuple of axis names, got {d!r}"
                )
        object.__setattr__(self, "_dims", tuple(norm))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("P is immutable")

    @property
    def dims(self) -> tuple[None | str | tuple[str, ...], ...]:
        return self._dims

    def __len__(self) -> int:
        return len(self._dims)

    def __getitem__(self, i: int) -> None | str | tuple[str, ...]:
        return self._dims[i]

    def axes_of(self, i: int) -> tuple[str, ...]:
        """The axes splitting dimension ``i`` (major first); ``()`` if whole or beyond the spec."""
        if i >= len(self._dims):
            return ()
        d = self._dims[i]
        return () if d is None else ((d,) if isinstance(d, str) else d)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis this spec names, in order of appearance."""
        return tuple(a for i in range(len(self._dims)) for a in self.axes_of(i))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, P) and other._dims == self._dims

    def __hash__(self) -> int:
        return hash(("P", self._dims))

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(d) for d in self._dims) + ")"

    def __reduce__(self):
        return (P, self._dims)


def _where(path: str) -> str:
    return f"leaf '{path}'" if path else "tensor"


def validate(spec: P, shape: Sequence[int], mesh: "Mesh", path: str = "") -> None:
    """Raise :class:`SpecError` naming the leaf, shape, axis and its size unless ``spec`` fits ``shape`` on ``mesh``."""
    shape = tuple(int(s) for s in shape)
    where = _where(path)
    if not isinstance(spec, P):
        raise SpecError(f"{where} with shape {shape}: expected a P(...) spec, got {spec!r}")
    if len(spec) > len(shape):
        raise SpecError(
            f"{where} with shape {shape} has rank {len(shape)}, but its spec {spec} has {len(spec)} entries: "
            f"give at most one entry per dimension"
        )
    seen: dict[str, int] = {}
    for i in range(len(spec)):
        for a in spec.axes_of(i):
            if a not in mesh.axis_names:
                raise SpecError(
                    f"{where} with shape {shape}: spec {spec} names axis '{a}', which is not a mesh axis "
                    f"(the mesh has {', '.join(mesh.axis_names)})"
                )
            if a in seen:
                raise SpecError(
                    f"{where} with shape {shape}: spec {spec} uses axis '{a}' twice (dimensions {seen[a]} and {i}); "
                    f"an axis can split at most one dimension"
                )
            seen[a] = i
        n = _parts(spec.axes_of(i), mesh)
        if shape[i] % n:
            axes = spec.axes_of(i)
            sizes = " x ".join(f"{a}={mesh.axis_size(a)}" for a in axes)
            raise SpecError(
                f"{where} with shape {shape}: dimension {i} (size {shape[i]}) is not divisible by "
                f"{'axis' if len(axes) == 1 else 'axes'} {sizes} of {mesh}; pad it to a multiple of {n} "
                f"or leave dimension {i} unsplit in the spec"
            )


def _parts(axes: Iterable[str], mesh: "Mesh") -> int:
    n = 1
    for a in axes:
        n *= mesh.axis_size(a)
    return n


def global_shape(spec: P, local: Sequence[int], mesh: "Mesh") -> tuple[int, ...]:
    """The shape of the global tensor whose blocks have shape ``local`` (the inverse of :func:`local_shape`)."""
    return tuple(int(n) * _parts(spec.axes_of(i), mesh) for i, n in enumerate(local))


def local_shape(spec: P, shape: Sequence[int], mesh: "Mesh", path: str = "") -> tuple[int, ...]:
    """The shape of one rank's block of a tensor of global ``shape``."""
    validate(spec, shape, mesh, path)
    return tuple(int(s) // _parts(spec.axes_of(i), mesh) for i, s in enumerate(shape))


def block_index(spec: P, dim: int, mesh: "Mesh", coords: dict[str, int] | None = None) -> int:
    """Which block of dimension ``dim`` the rank at ``coords`` (default: this rank) owns."""
    idx = 0
    for a in spec.axes_of(dim):
        c = mesh.coord(a) if coords is None else coords[a]
        idx = idx * mesh.axis_size(a) + c
    return idx


def local_slice(
    spec: P, shape: Sequence[int], mesh: "Mesh", coords: dict[str, int] | None = None, path: str = ""
) -> tuple[slice, ...]:
    """The index (one slice per dimension) of the block owned by the rank at ``coords`` (default: this rank)."""
    lshape = local_shape(spec, shape, mesh, path)
    return tuple(
        slice(block_index(spec, i, mesh, coords) * n, (block_index(spec, i, mesh, coords) + 1) * n)
        for i, n in enumerate(lshape)
    )


def _node_desc(node: Any) -> str:
    if isinstance(node, dict):
        return f"a dict with keys {sorted(map(str, node))}"
    if isinstance(node, (list, tuple)):
        return f"a {type(node).__name__} of length {len(node)}"
    return f"a {type(node).__name__}"


def broadcast_specs(specs: Any, tree: Any) -> list[tuple[str, P, Any]]:
    """Match a specs tree against a tree (of tensors, or anything with ``.shape``).

    ``specs`` must have the structure of ``tree`` or be a prefix of it: a ``P`` (or ``None``, meaning ``P()``)
    standing at an inner node covers every leaf below. Returns ``[(path, spec, leaf), ...]`` in ``tree``'s leaf
    order. A mismatch raises :class:`SpecError` naming the first path where the two trees part.
    """
    out: list[tuple[str, P, Any]] = []

    def walk(s: Any, t: Any, path: tuple) -> None:
        if s is None or isinstance(s, P):
            spec = P() if s is None else s
            for sub, leaf in leaves_with_path(t):
                full = path_str(path) if sub == "<root>" else (f"{path_str(path)}.{sub}" if path else sub)
                out.append((full, spec, leaf))
            return
        if optree.treespec_is_leaf(optree.tree_structure(s)):
            raise SpecError(
                f"specs do not match params at '{path_str(path)}': specs has {s!r}, which is not a P(...)"
            )
        if optree.treespec_is_leaf(optree.tree_structure(t)) or t is None:
            raise SpecError(
                f"specs do not match params at '{path_str(path)}': params has a leaf "
                f"{'None' if t is None else type(t).__name__ + str(tuple(getattr(t, 'shape', ())))} there, "
                f"specs has {_node_desc(s)}; put a P(...) at this path"
            )
        s_children, s_meta, s_keys, _ = optree.tree_flatten_one_level(s)
        t_children, t_meta, t_keys, _ = optree.tree_flatten_one_level(t)
        if type(s) is not type(t) and not (isinstance(s, dict) and isinstance(t, dict)):
            raise SpecError(
                f"specs do not match params at '{path_str(path)}': params has {_node_desc(t)}, "
                f"specs has {_node_desc(s)}"
            )
        if list(s_keys) != list(t_keys):
            if isinstance(t, dict):
                missing = sorted(map(str, set(t_keys) - set(s_keys)))
                extra = sorted(map(str, set(s_keys) - set(t_keys)))
                detail = "; ".join(
                    x
                    for x in (
                        f"missing in specs: {', '.join(missing)}" if missing else "",
                        f"not in params: {', '.join(extra)}" if extra else "",
                    )
                    if x
                )
            else:
                detail = f"params has {_node_desc(t)}, specs has {_node_desc(s)}"
            raise SpecError(f"specs do not match params at '{path_str(path)}': {detail}")
        names = getattr(t, "_fields", None) or t_keys  # NamedTuple children by field name
        for k, sc, tc in zip(names, s_children, t_children, strict=True):
            walk(sc, tc, path + (k,))

    try:
        walk(specs, tree, ())
    finally:  # `walk` refers to itself: break the cycle, or it keeps every leaf of `tree` alive until a gc pass
        walk = None  # noqa: F841 - (the closure's own cell is what is cleared)
    return out
