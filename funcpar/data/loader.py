"""The loader: each global batch's rows computed from its position alone; a rank reads its dp block."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from funcpar.parallel.mesh import Mesh
from funcpar.data.tokenizers import DataError
from funcpar.data.datasets import Mixture
from funcpar.data.datasets import as_batch
from funcpar.data.order import keyed_hash
from funcpar.data.order import permute


class Loader:
    """Endless global batches of a :class:`Dataset` or :class:`Mixture`; each rank yields its block over the data
    axes (``data_axes``, as ``compile_step`` takes them: dp by default; a model whose batch is split over ep too, as
    Mixtral's, gives ``("dp", "ep")``; cp ranks share each row).

    Row ``i`` drawn from a source of ``n`` rows is row ``permute(i % n, n, key(seed, source, i // n))``: a new
    order every epoch, batches running on across epochs, nothing held in memory but the batch. ``state_dict()`` /
    ``load_state_dict()`` carry the position (batches served), so a resumed run continues the exact order, which
    depends only on ``seed``, the global batch and the weights, not on the mesh.
    """

    def __init__(self, data, mesh: Mesh, global_batch: int, seed: int = 0, shuffle: bool = True,
                 data_axes: tuple[str, ...] = ("dp",)):
        if global_batch % mesh.data_block(data_axes)[0]:
            raise DataError(f"global_batch={global_batch} is not divisible by {mesh.data_text(data_axes)}")
        data = data if isinstance(data, Mixture) else Mixture([data])
        if len(data) < global_batch:
            raise DataError(f"the data has {len(data)} rows, fewer than one global batch of {global_batch}")
        data.check_batch(global_batch)
        self.data, self.mesh, self.global_batch, self.seed, self.shuffle = data, mesh, global_batch, seed, shuffle
        self.data_axes = tuple(data_axes)
        self.position = 0

    def _drawn(self, s: int, first: int, stop: int) -> torch.Tensor:
        """The rows (of source ``s``) of its draws ``first..stop``."""
        n, i = len(self.data.parts[s]), torch.arange(first, stop)
        if self.shuffle and stop > first:
            for epoch in range(first // n, (stop - 1) // n + 1):
                sel = i // n == epoch
                i[sel] = permute(i[sel] % n, n, keyed_hash(self.seed, s, epoch))
        return i % n

    def batch_index(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(source, row)`` of each row of global batch ``position``, in the batch's order: computed, nothing read."""
        gb, mix = self.global_batch, self.data
        picks = [(s, self._drawn(s, mix.taken(s, gb * position), mix.taken(s, gb * (position + 1))))
                 for s in range(len(mix.parts))]
        src = torch.cat([torch.full((len(r),), s, dtype=torch.int64) for s, r in picks])
        row = torch.cat([r for _, r in picks])
        if len(picks) > 1 and self.shuffle:  # the sources interleaved, so dp ranks each see the mixture
            order = permute(torch.arange(gb), gb, keyed_hash(self.seed, position, 0xB1E))
            src, row = src[order], row[order]
        return src, row

    def _read(self, src: torch.Tensor, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows ``(src, row)`` as a batch."""
        ids = torch.empty(len(row), self.data.parts[0].seq_len, dtype=torch.int64)
        mask = torch.empty(ids.shape, dtype=torch.bool)
        pos = torch.empty(ids.shape, dtype=torch.int64) if self.data.parts[0].documents else None
        for s in torch.unique(src).tolist():
            sel = src == s
            ids[sel], mask[sel] = self.data.parts[s].take(row[sel])
            if pos is not None:
                pos[sel] = self.data.parts[s].positions(row[sel])
        return as_batch(ids, mask, pos)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        """This rank's block of the next global batch: only its rows are read."""
        src, row = self.batch_index(self.position)
        self.position += 1
        blocks, c = self.mesh.data_block(self.data_axes)
        block = len(row) // blocks
        b = self._read(src[c * block : (c + 1) * block], row[c * block : (c + 1) * block])
        return {k: v.to(self.mesh.device) for k, v in b.items()}

    def state_dict(self) -> dict[str, Any]:
        out = {"position": self.position, "seed": self.seed, "global_batch": self.global_batch}
        return out if len(self.data.parts) == 1 else {**out, "weights": self.data.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = state.get("position") if isinstance(state, dict) else None
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise DataError(f"cannot resume data order: the saved loader state {state!r} has no position (a "
                            f"non-negative integer: the batches served)")
        same = state.get("global_batch", self.global_batch) == self.global_batch
        if not same or state.get("seed", self.seed) != self.seed:
            raise DataError(
                f"cannot resume data order: saved with global_batch={state.get('global_batch')} "
                f"seed={state.get('seed')}, "
                f"now global_batch={self.global_batch} seed={self.seed}"
            )
        saved = state.get("weights", [1.0])
        now = self.state_dict().get("weights", [1.0])
        if len(saved) != len(now) or any(abs(a - b) > 1e-9 for a, b in zip(saved, now, strict=True)):
            raise DataError(f"cannot resume data order: saved with data weights {saved}, now {now} (the rows each "
                            f"source has served follow from the weights)")
        self.position = position


def batches(dataset, mesh: Mesh, global_batch: int, seed: int = 0) -> Loader:
    """This rank's batches of ``dataset`` (see :class:`Loader`)."""
    return Loader(dataset, mesh, global_batch, seed)
