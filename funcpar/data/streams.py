"""Streams: a source's samples tokenized end to end (in memory or a token cache's files)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from funcpar.data.samples import encode
from funcpar.data.samples import need_field
from funcpar.data.samples import sample_kind


@dataclass
class Stream:
    """A data source tokenized: every sample's ids end to end (``ids``, a 1-D numpy array in memory, or a token
    cache's file read on demand: :class:`funcpar.data.cache.FileArray`), their loss mask (``mask``, uint8; None when
    every token is trained on), and where each sample starts (``starts``: samples + 1 offsets). Rows are cut from it
    on demand, so a stream on disk is never read whole."""

    ids: Any
    mask: Any
    starts: Any
    max_id: int

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def samples(self) -> int:
        return int(self.starts.shape[0]) - 1


class StreamWriter:
    """Builds a :class:`Stream` a sample at a time, in chunks of about :attr:`CHUNK` tokens: ``sink(name, array)``
    receives each chunk of ``ids`` and ``mask`` and at the end the ``starts`` (a token cache's files); without a
    sink the chunks stay in memory. Memory is a chunk whatever the corpus."""

    CHUNK = 1 << 22

    def __init__(self, dtype, sink=None):
        import numpy as np

        self.np, self.dtype, self.sink = np, dtype, sink
        self.parts: dict[str, list] = {"ids": [], "mask": []}
        self.done: dict[str, list] = {"ids": [], "mask": []}
        self.buffered = self.tokens = self.max_id = 0
        self.starts = [0]
        self.all_trained = True

    def add(self, ids, mask) -> None:
        """One sample: its ids and loss mask (lists or arrays)."""
        np = self.np
        ids, mask = np.asarray(ids), np.asarray(mask, dtype=np.uint8)
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
        self.all_trained = self.all_trained and bool(mask.all())
        self.parts["ids"].append(ids.astype(self.dtype, copy=False))
        self.parts["mask"].append(mask)
        self.tokens += len(ids)
        self.buffered += len(ids)
        self.starts.append(self.tokens)
        if self.buffered >= self.CHUNK:
            self._flush()

    def _flush(self) -> None:
        for name, parts in self.parts.items():
            if not parts:
                continue
            chunk = self.np.concatenate(parts)
            if self.sink:
                self.sink(name, chunk)
            elif name == "ids" or not self.all_trained:  # (in memory: no mask while every token is trained on)
                if name == "mask" and not self.done["mask"]:
                    held = sum(len(c) for c in self.done["ids"]) - (len(chunk) if self.parts["ids"] else 0)
                    self.done["mask"].append(self.np.ones(held, dtype=self.np.uint8))
                self.done[name].append(chunk)
        self.parts, self.buffered = {"ids": [], "mask": []}, 0

    def finish(self) -> Stream | dict:
        """The stream (in memory); with a sink, once the last chunks and the starts went to it, what its files hold
        (``tokens``, ``samples``, ``max_id``, ``all_trained``, ``dtype``)."""
        np = self.np
        self._flush()
        starts = np.asarray(self.starts, dtype=np.int64)
        if self.sink:
            self.sink("starts", starts)
            return {"tokens": self.tokens, "samples": len(starts) - 1, "max_id": self.max_id,
                    "all_trained": self.all_trained, "dtype": np.dtype(self.dtype).name}
        ids = np.concatenate(self.done["ids"]) if self.done["ids"] else np.zeros(0, self.dtype)
        mask = None if self.all_trained else np.concatenate(self.done["mask"])
        return Stream(ids, mask, starts, self.max_id)


def id_dtype(vocab_size: int):
    """The narrowest integer type that holds every id of a ``vocab_size`` vocabulary (uint16 for most)."""
    import numpy as np

    return np.uint16 if vocab_size <= 1 << 16 else np.int32


BULK = 1024  # plain-text samples encoded in one call of a tokenizer's encode_many


def tokenize(samples, tok, sink=None) -> Stream | dict:
    """``samples`` (``(sample, where)`` pairs; an iterator streams) as a :class:`Stream` (``sink``: see
    :class:`StreamWriter`). Plain-text samples go to a tokenizer's ``encode_many`` :data:`BULK` at a time where it
    has one (the byte tokenizer without a list of ints, an HF fast tokenizer in its own threads); the rest one by
    one, in order."""
    import numpy as np

    w = StreamWriter(id_dtype(tok.vocab_size), sink)
    many = getattr(tok, "encode_many", None)
    texts: list[str] = []

    def flush():
        for ids in many(texts):
            ids = np.append(np.asarray(ids, dtype=np.int64), tok.eos_id)
            w.add(ids, np.ones(len(ids), dtype=np.uint8))
        texts.clear()

    for sample, where in samples:
        if many is not None and isinstance(sample, dict) and sample_kind(sample) == "pretrain":
            texts.append(need_field(sample, "text", where))
            if len(texts) >= BULK:
                flush()
            continue
        if texts:
            flush()
        w.add(*encode(sample, tok, where))
    if texts:
        flush()
    return w.finish()
