"""Reading a funcpar checkpoint: its metadata (checked against its schema and its checksum before anything is
sized from it) and its pieces in global coordinates, fetched on demand.

Private to :mod:`funcpar.io.checkpoint`, which re-exports ``CheckpointError`` and ``resolve`` and writes the metadata
with :func:`write_meta`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import zlib
from pathlib import Path
from typing import Any

import torch

from funcpar.io.safetensors_header import DTYPES, read_block, read_header, within
from funcpar.io.atomic import recover

FORMAT = "funcpar-checkpoint/1"
META, SUM = "meta.json", "meta.json.sha256"
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in DTYPES.values()}  # what save() can write


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked (the message names the file, leaf or piece)."""


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy()) if t.numel() else 0


def write_meta(folder: Path, meta: dict) -> None:
    """``meta.json`` and, beside it, the SHA-256 of its bytes (a line ``sha256sum -c`` reads): loading refuses
    metadata edited since, which the CRCs of the pieces cannot see (a step, a shape, a dtype)."""
    data = json.dumps(meta).encode()
    (folder / META).write_bytes(data)
    (folder / SUM).write_text(f"{hashlib.sha256(data).hexdigest()}  {META}\n")


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint folder: ``path`` itself, or the one its ``latest`` file names."""
    path = recover(path)
    if (path / META).exists():
        return path
    latest = path / "latest"
    if latest.exists():
        target = recover(within(path, latest.read_text().strip(), str(latest), CheckpointError))
        if (target / META).exists():
            return target
        raise CheckpointError(f"{latest} names {target.name}, which is not a complete checkpoint")
    raise CheckpointError(f"{path} is not a checkpoint (no meta.json) and has no 'latest' file")


# ------------------------------------------------------------------------------------------- the metadata


def _nat(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _range(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and _nat(v[0]) and _nat(v[1]) and v[0] <= v[1]


_SHAPE = (lambda v: isinstance(v, list) and all(_nat(n) for n in v), "a list of ints >= 0")
_DTYPE = (lambda v: v in _DTYPE_NAMES, f"one of {', '.join(_DTYPE_NAMES)}")
_STR = (lambda v: isinstance(v, str), "a string")
_LIST = (lambda v: isinstance(v, list), "a list")


def _name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _shown(v: Any) -> str:
    return repr(v) if len(repr(v)) <= 80 else repr(v)[:77] + "..."


def _field(file: Path, obj: Any, key: str, where: str, check) -> Any:
    """``obj[key]``, refused by name unless ``check = (test, what is expected)`` passes (``where``: the
    object's own name and a dot, e.g. ``pieces[3].``)."""
    test, want = check
    if not isinstance(obj, dict):
        raise CheckpointError(f"{file}: {where[:-1]} is {_shown(obj)}, expected an object")
    if key not in obj:
        raise CheckpointError(f"{file}: {where}{key} is missing (expected {want})")
    if not test(obj[key]):
        raise CheckpointError(f"{file}: {where}{key} is {_shown(obj[key])}, expected {want}")
    return obj[key]


def _check_top(meta: Any, file: Path) -> None:
    if not isinstance(meta, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(meta), "a number")
        raise CheckpointError(f"{file} holds {kind}, not a checkpoint's metadata (a JSON object)")
    if meta.get("format") != FORMAT or meta.get("complete") is not True:
        raise CheckpointError(f"{file.parent} is not a complete {FORMAT} checkpoint (its {META} says format "
                              f"{meta.get('format')!r}, complete {meta.get('complete')!r})")
    _field(file, meta, "step", "", (_nat, "an int >= 0"))
    _field(file, meta, "world", "", (lambda v: _nat(v, 1), "an int >= 1"))
    _field(file, meta, "run", "", (lambda v: v is None or isinstance(v, str), "a string or null"))
    _field(file, meta, "optimizer", "", (lambda v: v is None or isinstance(v, list) and all(
        isinstance(x, str) for x in v), "a list of strings"))
    for key in ("params", "opt", "pieces"):
        _field(file, meta, key, "", _LIST)


def _check_leaves(meta: dict, file: Path) -> dict[str, tuple[list[int] | None, torch.dtype]]:
    """Every leaf the pieces may belong to, ``param/PATH`` and ``opt/PATH`` -> (global shape, dtype); an
    optimizer-state leaf that shadows a parameter has its shape. (A rank's RNG state, ``rng/torch/RANK``, is a
    1-D uint8 tensor.)"""
    out: dict[str, tuple[list[int] | None, torch.dtype]] = {}
    shapes: dict[str, list[int]] = {}
    for kind, leaves in (("param", meta["params"]), ("opt", meta["opt"])):
        for i, leaf in enumerate(leaves):
            at = f"{'params' if kind == 'param' else 'opt'}[{i}]."
            path = _field(file, leaf, "path", at, _STR)
            dtype = _DTYPE_NAMES[_field(file, leaf, "dtype", at, _DTYPE)]
            if kind == "param":
                _field(file, leaf, "spec", at, _LIST)
                shape = shapes[path] = _field(file, leaf, "shape", at, _SHAPE)
            else:
                parent = _field(file, leaf, "param", at, (lambda v: v is None or v in shapes,
                                                          "null or the path of a leaf in params"))
                shape = _field(file, leaf, "shape", at, _SHAPE) if parent is None else shapes[parent]
            if f"{kind}/{path}" in out:
                raise CheckpointError(f"{file}: {at}path '{path}' is there twice")
            out[f"{kind}/{path}"] = (shape, dtype)
    return out


def _leaf(tensor: Any, leaves: dict, world: int) -> tuple[list[int] | None, torch.dtype] | None:
    """The (shape, dtype) of the tensor a piece names: a leaf, or a saving rank's RNG state (``None``: neither)."""
    if tensor in leaves:
        return leaves[tensor]
    m = re.fullmatch(r"rng/torch/(0|[1-9][0-9]{0,8})", tensor) if isinstance(tensor, str) else None
    return (None, torch.uint8) if m and int(m.group(1)) < world else None


def _check_pieces(meta: dict, file: Path, leaves: dict) -> None:
    """Each piece names a leaf and a file inside the folder; its block lies inside the leaf's shape and its flat
    range inside the block; a leaf's pieces hold as many elements as its shape (no piece missing, no shape made
    up: what a load allocates is bounded by the data the files hold)."""
    held: dict[str, int] = {}
    for i, pc in enumerate(meta["pieces"]):
        at = f"pieces[{i}]."
        tensor = _field(file, pc, "tensor", at, (lambda v: _leaf(v, leaves, meta["world"]) is not None,
                                                 "the name of a leaf in params or opt ('param/PATH', 'opt/PATH') "
                                                 "or a rank's 'rng/torch/RANK'"))
        within(file.parent, _field(file, pc, "file", at, _STR), f"{file} (a piece of '{tensor}')", CheckpointError)
        _field(file, pc, "key", at, _STR)
        _field(file, pc, "crc", at, (lambda v: _nat(v) and v < 2**32, "a CRC-32 (an int in [0, 2**32))"))
        block = _field(file, pc, "block", at, (lambda v: isinstance(v, list) and all(_range(r) for r in v),
                                               "a list of [start, stop] pairs of ints, 0 <= start <= stop"))
        a, b = _field(file, pc, "flat", at, (_range, "[start, stop], ints, 0 <= start <= stop"))
        shape = _leaf(tensor, leaves, meta["world"])[0]
        if shape is None and len(block) != 1 or shape is not None and (
                len(block) != len(shape) or any(e > n for (_, e), n in zip(block, shape, strict=True))):
            raise CheckpointError(f"{file}: {at}block {block} does not lie inside the shape "
                                  f"{shape if shape is not None else '(1-D)'} of '{tensor}'")
        if b > math.prod(e - s for s, e in block):
            raise CheckpointError(f"{file}: {at}flat {[a, b]} does not fit inside its block {block} "
                                  f"({math.prod(e - s for s, e in block)} elements) of '{tensor}'")
        held[tensor] = held.get(tensor, 0) + b - a
    for tensor, (shape, _) in leaves.items():
        if shape is not None and held.get(tensor, 0) != math.prod(shape):
            raise CheckpointError(f"{file}: the pieces of '{tensor}' hold {held.get(tensor, 0)} elements, but its "
                                  f"shape {shape} has {math.prod(shape)}")


def _check_sum(raw: bytes, file: Path) -> None:
    side = file.with_name(SUM)
    try:
        line = side.read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        raise CheckpointError(f"{file.parent} has no {SUM} beside its {META}: its metadata cannot be verified "
                              f"(not a complete checkpoint of this funcpar version)") from None
    m = re.fullmatch(rf"([0-9a-f]{{64}})  {re.escape(META)}\n?", line)
    if m is None:
        raise CheckpointError(f"{side} is not the line '<SHA-256 in hex>  {META}' funcpar writes")
    if m.group(1) != hashlib.sha256(raw).hexdigest():
        raise CheckpointError(f"{file} has been modified since it was written (checksum mismatch with {SUM}): "
                              f"funcpar loads no metadata it cannot vouch for; restore the checkpoint from a copy "
                              f"or load another one")


class Source:
    """A checkpoint's metadata and its pieces, read on demand (headers cached, CRC checked).

    The metadata is checked against its schema first (a wrong field is named), then against its checksum (any
    other edit is caught); a piece's file header must agree with it before a byte of the piece is read."""

    def __init__(self, path):
        self.folder = resolve(path)
        file = self.folder / META
        raw = file.read_bytes()
        try:
            meta = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file} is not valid JSON: {e}") from None
        _check_top(meta, file)
        self.leaves = _check_leaves(meta, file)
        _check_pieces(meta, file, self.leaves)
        _check_sum(raw, file)
        self.meta = meta
        self.pieces: dict[str, list[dict]] = {}
        for pc in self.meta["pieces"]:
            self.pieces.setdefault(pc["tensor"], []).append(pc)
        self._headers: dict[str, dict] = {}
        self.bytes_read = 0

    def _read(self, pc: dict) -> torch.Tensor:
        """A piece's bytes, once its file's header agrees with the metadata (dtype, size) and before the CRC."""
        f, key, tensor = pc["file"], pc["key"], pc["tensor"]
        if f not in self._headers:
            file = self.folder / f
            if not file.exists():
                raise CheckpointError(f"checkpoint {self.folder} is missing {f} (a rank's file)")
            self._headers[f] = read_header(file, CheckpointError)
        h = self._headers[f]
        if key not in h:
            raise CheckpointError(f"{self.folder / f} has no tensor '{key}'")
        t, dtype, (a, b) = h[key], _leaf(tensor, self.leaves, self.meta["world"])[1], pc["flat"]
        if t.dtype != dtype:
            raise CheckpointError(f"{self.folder / f}: tensor '{key}' is stored as {_name(t.dtype)}, but "
                                  f"{META} records '{tensor}' as {_name(dtype)}")
        if t.nbytes != (b - a) * dtype.itemsize:
            raise CheckpointError(f"{self.folder / f}: tensor '{key}' holds {t.nbytes} bytes, but {META} says its "
                                  f"piece of '{tensor}' is elements {a}..{b} of {_name(dtype)} "
                                  f"({(b - a) * dtype.itemsize} bytes)")
        t = read_block(t, (), CheckpointError)
        self.bytes_read += t.numel() * t.element_size()
        if crc(t) != pc["crc"]:
            raise CheckpointError(f"corrupt checkpoint file {self.folder / f}: tensor '{key}' fails its CRC check")
        return t

    def assemble(self, tensor: str, region: list[list[int]], a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[a, b)`` of the row-major flattening of the global block ``region`` of ``tensor``."""
        if b <= a:
            return torch.empty(0, dtype=dtype)
        shape = [e - s for s, e in region] or [1]
        region = region or [[0, 1]]
        inner = math.prod(shape[1:])
        r0, r1 = a // inner, (b - 1) // inner + 1
        want = [[region[0][0] + r0, region[0][0] + r1]] + region[1:]
        wshape = [e - s for s, e in want]
        buf = torch.empty(wshape, dtype=dtype)
        filled = torch.zeros(wshape, dtype=torch.bool)
        for pc in self.pieces.get(tensor, []):
            blk = pc["block"] or [[0, 1]]
            pa, pb = pc["flat"]
            pinner = math.prod(e - s for s, e in blk[1:])
            q0, q1 = pa // pinner, (pb - 1) // pinner + 1
            box = [[blk[0][0] + q0, blk[0][0] + q1]] + blk[1:]
            inter = [[max(x[0], y[0]), min(x[1], y[1])] for x, y in zip(box, want, strict=True)]
            if any(s >= e for s, e in inter):
                continue  # this piece holds nothing this rank needs: not read
            data = self._read(pc).to(dtype)
            rows = torch.empty((q1 - q0) * pinner, dtype=dtype)
            valid = torch.zeros((q1 - q0) * pinner, dtype=torch.bool)
            rows[pa - q0 * pinner : pb - q0 * pinner] = data
            valid[pa - q0 * pinner : pb - q0 * pinner] = True
            bshape = [q1 - q0] + [e - s for s, e in blk[1:]]
            src = tuple(slice(s - x[0], e - x[0]) for (s, e), x in zip(inter, box, strict=True))
            dst = tuple(slice(s - y[0], e - y[0]) for (s, e), y in zip(inter, want, strict=True))
            v = valid.view(bshape)[src]
            buf[dst] = torch.where(v, rows.view(bshape)[src], buf[dst])
            filled[dst] |= v
        off = a - r0 * inner
        if not bool(filled.reshape(-1)[off : off + b - a].all()):
            raise CheckpointError(
                f"checkpoint {self.folder} has no data for part of '{tensor}' (global block {region}): "
                f"a rank's file or piece is missing"
            )
        return buf.reshape(-1)[off : off + b - a].clone()
