"""Reading a funcpar checkpoint: its metadata and its pieces in global coordinates, fetched on demand.

Private to :mod:`funcpar.checkpoint`, which re-exports ``CheckpointError`` and ``resolve``.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import torch

from ._safetensors import read_block, read_header, within
from .atomic import recover

FORMAT = "funcpar-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked (the message names the file, leaf or piece)."""


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy()) if t.numel() else 0


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint folder: ``path`` itself, or the one its ``latest`` file names."""
    path = recover(path)
    if (path / "meta.json").exists():
        return path
    latest = path / "latest"
    if latest.exists():
        target = recover(within(path, latest.read_text().strip(), str(latest), CheckpointError))
        if (target / "meta.json").exists():
            return target
        raise CheckpointError(f"{latest} names {target.name}, which is not a complete checkpoint")
    raise CheckpointError(f"{path} is not a checkpoint (no meta.json) and has no 'latest' file")


class _Source:
    """A checkpoint's metadata and its pieces, read on demand (headers cached, CRC checked)."""

    def __init__(self, path):
        self.folder = resolve(path)
        try:
            self.meta = json.loads((self.folder / "meta.json").read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.folder / 'meta.json'} is not valid JSON: {e}") from None
        if self.meta.get("format") != FORMAT or not self.meta.get("complete"):
            raise CheckpointError(f"{self.folder} is not a complete {FORMAT} checkpoint")
        self.pieces: dict[str, list[dict]] = {}
        for pc in self.meta["pieces"]:
            self.pieces.setdefault(pc["tensor"], []).append(pc)
        self._headers: dict[str, dict] = {}
        self.bytes_read = 0

    def _read(self, pc: dict) -> torch.Tensor:
        f = pc["file"]
        if f not in self._headers:
            file = within(self.folder, f, f"{self.folder / 'meta.json'} (a piece of '{pc.get('tensor')}')",
                          CheckpointError)
            if not file.exists():
                raise CheckpointError(f"checkpoint {self.folder} is missing {f} (a rank's file)")
            self._headers[f] = read_header(file, CheckpointError)
        h = self._headers[f]
        if pc["key"] not in h:
            raise CheckpointError(f"{self.folder / f} has no tensor '{pc['key']}'")
        t = read_block(h[pc["key"]], (), CheckpointError)
        self.bytes_read += t.numel() * t.element_size()
        if _crc(t) != pc["crc"]:
            raise CheckpointError(f"corrupt checkpoint file {self.folder / f}: tensor '{pc['key']}' fails its CRC check")
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
            inter = [[max(x[0], y[0]), min(x[1], y[1])] for x, y in zip(box, want)]
            if any(s >= e for s, e in inter):
                continue  # this piece holds nothing this rank needs: not read
            data = self._read(pc).to(dtype)
            rows = torch.empty((q1 - q0) * pinner, dtype=dtype)
            valid = torch.zeros((q1 - q0) * pinner, dtype=torch.bool)
            rows[pa - q0 * pinner : pb - q0 * pinner] = data
            valid[pa - q0 * pinner : pb - q0 * pinner] = True
            bshape = [q1 - q0] + [e - s for s, e in blk[1:]]
            src = tuple(slice(s - x[0], e - x[0]) for (s, e), x in zip(inter, box))
            dst = tuple(slice(s - y[0], e - y[0]) for (s, e), y in zip(inter, want))
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
