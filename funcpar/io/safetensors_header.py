"""Reading safetensors files without the safetensors runtime: a validated header parse and block reads.

The format is an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}`` and
raw little-endian tensor bytes. Reading a block of a tensor with ``pread``, run by run, touches only that block's
bytes, and counting them makes "each rank reads only its slices" measurable. Only JSON and raw bytes are read;
nothing is unpickled or executed. Also the one way funcpar puts a finished folder in place.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20


# ------------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(file: Path, error: type[Exception] = ValueError) -> dict[str, TensorEntry]:
    """Every tensor's dtype, shape and absolute byte range, validated against the file's size."""

    def corrupt(why: str) -> Exception:
        return error(f"corrupt safetensors file {file}: {why}")

    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise corrupt(f"the file has {size} bytes, fewer than the 8-byte header length")
            n = int.from_bytes(raw, "little")
            if n > min(size - 8, _MAX_HEADER):
                raise corrupt(f"header length {n} exceeds the file's {size} bytes")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise error(f"safetensors file {file} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(s) for s in meta["shape"])
            a, b = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"tensor '{name}' has a malformed entry {meta!r}") from None
        want = math.prod(shape) * dtype.itemsize
        if b - a != want or a < 0:
            raise corrupt(f"tensor '{name}' of {meta['dtype']}{list(shape)} spans bytes {a}..{b}, not {want} bytes")
        if base + b > size:
            raise corrupt(f"tensor '{name}' ends at byte {base + b} but the file has {size} bytes (truncated?)")
        out[name] = TensorEntry(file, dtype, shape, base + a, want)
    _check_layout(out, base, size, corrupt)
    return out


def _check_layout(tensors: dict[str, TensorEntry], base: int, size: int, corrupt) -> None:
    """The data as the format lays it out, as the ``safetensors`` library checks it: the tensors, in the order of
    their offsets, one right after the other from the first data byte to the file's last byte. Two tensors that
    share bytes would read as each other's data; bytes that belong to no tensor hide what no reader sees."""
    end, prev = 0, ""
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].nbytes, kv[0])):
        a, b = t.start - base, t.start - base + t.nbytes
        if a < end:
            raise corrupt(f"tensors {prev} and '{name}' (data bytes {a}..{b}) overlap")
        if a > end:
            where = f"between tensors {prev} and '{name}' (data bytes {a}..{b})" if prev else f"before tensor '{name}'"
            raise corrupt(f"data bytes {end}..{a} {where} belong to no tensor")
        end, prev = b, f"'{name}' (data bytes {a}..{b})"
    if base + end != size:
        raise corrupt(f"its last {size - base - end} bytes, after {f'tensor {prev}' if prev else 'the header'}, "
                      f"belong to no tensor")


def read_block(t: TensorEntry, region: tuple[slice, ...], error: type[Exception] = ValueError) -> torch.Tensor:
    """The block ``region`` (one slice per leading dimension) of tensor ``t``, read from disk run by run."""
    shape = t.shape
    region = tuple(region) + tuple(slice(0, s) for s in shape[len(region):])
    bounds = [(sl.start or 0, shape[i] if sl.stop is None else sl.stop) for i, sl in enumerate(region)]
    out_shape = tuple(b - a for a, b in bounds)
    item = t.dtype.itemsize
    out = torch.empty(math.prod(out_shape) * item, dtype=torch.uint8)
    if out.numel():
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        # k: the outermost dimension below which the block covers whole dimensions -> contiguous runs
        k = len(shape)
        while k > 0 and bounds[k - 1] == (0, shape[k - 1]):
            k -= 1
        k = max(k - 1, 0)
        run = (bounds[k][1] - bounds[k][0]) * strides[k] * item if shape else item
        buf = memoryview(out.numpy())
        pos = 0
        with open(t.file, "rb") as fh:
            fd = fh.fileno()
            for idx in _product([range(a, b) for a, b in bounds[:k]]):
                elem = sum(i * s for i, s in zip(idx, strides[:k], strict=True))
                elem += bounds[k][0] * strides[k] if shape else 0
                got = os.preadv(fd, [buf[pos : pos + run]], t.start + elem * item)
                if got != run:
                    raise error(f"corrupt safetensors file {t.file}: short read")
                pos += run
    return out.view(t.dtype).reshape(out_shape)


def _product(ranges):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


def within(folder: Path, name: Any, what: str, error: type[Exception]) -> Path:
    """``folder / name`` for a file name read from a file (an index, metadata, ``latest``): a plain name in
    ``folder``, never a path that leads out of it (``../x``, ``/etc/x``, ``a/../../x``) or a non-string."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise error(f"{what} names {name!r}, which is not a file name inside {folder}: refusing to open it")
    return folder / name

