"""Packed rows of several documents: where each begins, from the batch's ``position_ids``.

A packed row holds samples end to end. With ``position_ids`` in the batch (the position of each token in its own
sample: 0, 1, 2, 0, 1, ...) each sample is its own sequence, as if run alone: rotary and learned positions are the
given ones, and causal attention stays inside the sample. A document begins where a position is not the previous
one plus one (and at the row's start), so a fragment that continues a sample from the row before keeps its
positions and is a document of its own.

:func:`documents_of` (:meth:`funcpar.Mesh.with_documents`) hands a model's layers a mesh view carrying them;
:func:`funcpar.nn.decoder.causal` attends by document: the block-causal CPU kernel with its score blocks masked by
document, one kernel call per document and query piece (no (T, T) mask), or one call with the block-diagonal mask
(rows of many short documents; compiled code, where the spans cannot be read on the host).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

__all__ = ["Documents", "documents_of"]


def documents_of(mesh, batch: dict):
    """``mesh`` carrying the packed documents of ``batch`` (its ``"position_ids"``): what a model's blocks are run
    on (:meth:`funcpar.Mesh.with_documents`); ``mesh`` itself for a batch without them."""
    pos = batch.get("position_ids") if isinstance(batch, dict) else None
    return mesh if pos is None else mesh.with_documents(Documents(pos))


@dataclasses.dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a batch's rows: ``positions`` (B, T), each token's position in its document."""

    positions: torch.Tensor
    _masks: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        p = self.positions
        if not isinstance(p, torch.Tensor) or p.dim() != 2 or p.dtype.is_floating_point or p.dtype == torch.bool:
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"batch['position_ids'] must be an integer tensor (B, T), like input_ids; got {shape}")

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        """(B, T) bool: where a document begins (the row's first position, and each that does not follow on)."""
        p = self.positions
        cont = torch.zeros_like(p, dtype=torch.bool)
        cont[:, 1:] = p[:, 1:] == p[:, :-1] + 1
        return ~cont

    @functools.cached_property
    def ids(self) -> torch.Tensor:
        """(B, T): each token's document, numbered from 0 in its row."""
        return self.starts.long().cumsum(1) - 1

    @functools.cached_property
    def spans(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per row, its documents' ``(start, end)`` positions, read on the host once."""
        T = self.positions.shape[1]
        rows = []
        for row in self.starts.cpu().tolist():
            begin = [t for t, s in enumerate(row) if s]
            rows.append(tuple(zip(begin, begin[1:] + [T], strict=True)))
        return tuple(rows)

    @property
    def count(self) -> int:
        """How many documents the rows hold, all rows together."""
        return sum(len(row) for row in self.spans)

    def mask(self, window: int | None = None) -> torch.Tensor:
        """(B, 1, T, T) bool: key ``j`` visible to query ``i`` (the same document, ``j <= i``, and within the last
        ``window`` positions), made once per window and shared by every layer of the batch."""
        if window not in self._masks:
            self._masks[window] = self._mask(window)
        return self._masks[window]

    def _mask(self, window: int | None) -> torch.Tensor:
        d = self.ids
        T = d.shape[1]
        i = torch.arange(T, device=d.device)
        causal = i[None, :] <= i[:, None]
        if window is not None:
            causal = causal & (i[:, None] - i[None, :] < window)
        return ((d[:, :, None] == d[:, None, :]) & causal)[:, None]
