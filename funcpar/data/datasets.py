"""Datasets: rows of a sequence length cut from a stream, held-out splits, mixtures by weight."""

from __future__ import annotations

import functools
import math

import torch

from funcpar.data.tokenizers import DataError
from funcpar.data.streams import Stream
from funcpar.data.order import keyed_hash
from funcpar.data.order import permute
from funcpar.data.streams import tokenize


HELD_OUT_MAX = 2000  # held-out rows per data source at most: an evaluation of a large corpus stays seconds


class Dataset:
    """Rows of ``seq_len`` tokens cut from a :class:`Stream`: packed (the stream cut into consecutive rows; a
    sample longer than a row continues into the next) or one sample per row (truncated, or padded with positions not
    trained on). ``part`` ``(lo, hi, key)`` keeps positions ``lo..hi`` of the rows' ordering under ``key`` (a
    train or held-out split) without holding an index. :meth:`take` reads the rows asked for and nothing else."""

    def __init__(self, stream: Stream, seq_len: int, pack: bool = True, pad_id: int = 0, part=None,
                 documents: bool = False):
        self.stream, self.seq_len, self.pack, self.pad_id, self.part = stream, seq_len, pack, pad_id, part
        self.documents = documents and pack  # (one sample per row is one document already)
        self.rows = stream.tokens // seq_len if pack else stream.samples
        if not self.rows:
            raise DataError(f"the data holds {stream.tokens} tokens, not enough for one row of seq_len={seq_len}")
        self.samples, self.tokens, self.max_id = stream.samples, stream.tokens, stream.max_id

    @classmethod
    def from_samples(cls, samples, tok, seq_len: int, pack: bool = True, documents: bool = False) -> "Dataset":
        """The rows of ``samples`` (``(sample, where)`` pairs) tokenized in memory (``documents``: see
        :meth:`positions`)."""
        return cls(tokenize(samples, tok), seq_len, pack, tok.pad_id, documents=documents)

    @classmethod
    def from_rows(cls, ids: torch.Tensor, mask: torch.Tensor | None = None) -> "Dataset":
        """A dataset whose rows are ``ids`` (N, T) (and ``mask``, all trained on if None) as given."""
        import numpy as np

        n, t = ids.shape
        m = None if mask is None else mask.reshape(-1).numpy().astype(np.uint8)
        stream = Stream(ids.reshape(-1).numpy().copy(), m, np.arange(0, n * t + 1, t), int(ids.max()) if n else 0)
        return cls(stream, t, pack=True)

    def __len__(self) -> int:
        return self.part[1] - self.part[0] if self.part else self.rows

    @functools.cached_property
    def truncated(self) -> int:
        """Samples longer than a row (cut short when rows are one sample each; continued when packed)."""
        import numpy as np

        if self.pack:
            return 0
        s, n = self.stream.starts, 0
        for a in range(0, len(s) - 1, 1 << 20):  # (in chunks: the starts may be a long file)
            block = np.asarray(s[a : a + (1 << 20) + 1])
            n += int((np.diff(block) > self.seq_len).sum())
        return n

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, mask)`` (k, seq_len) of rows ``index`` (positions in this dataset, 0..len-1)."""
        import numpy as np

        rows, t, st = self._stream_rows(index), self.seq_len, self.stream
        if self.pack:  # (a row a read: from a token cache's file, only those bytes)
            ids = np.stack([st.ids[r * t : (r + 1) * t] for r in rows]) if len(rows) else np.zeros((0, t), np.int64)
            mask = (np.ones(ids.shape, np.bool_) if st.mask is None or not len(rows) else
                    np.stack([st.mask[r * t : (r + 1) * t] for r in rows]))
        else:
            ids = np.full((len(rows), t), self.pad_id, dtype=np.int64)
            mask = np.zeros((len(rows), t), dtype=np.bool_)
            for k, r in enumerate(rows):
                a = int(st.starts[r])
                b = min(int(st.starts[r + 1]), a + t)
                ids[k, : b - a] = st.ids[a:b]
                mask[k, : b - a] = True if st.mask is None else st.mask[a:b]
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.bool_))

    def _stream_rows(self, index: torch.Tensor):
        """The stream's rows (numpy) of positions ``index`` in this dataset (a split's are keyed positions)."""
        index = index.to(torch.int64)
        if self.part:
            index = permute(index + self.part[0], self.rows, self.part[2])
        return index.numpy()

    def positions(self, index: torch.Tensor) -> torch.Tensor | None:
        """With ``documents`` (packed rows only), each token's position in its own sample, (k, seq_len): 0 where a
        sample starts and at the row's start (a sample continued from the row before starts again there), so
        that each sample attends only to itself (:mod:`funcpar.nn.documents`); None otherwise. Only the rows'
        sample starts are read (a binary search of ``starts``)."""
        import bisect

        import numpy as np

        if not self.documents:
            return None
        rows, t, starts = self._stream_rows(index), self.seq_len, self.stream.starts
        out = np.empty((len(rows), t), dtype=np.int64)
        col = np.arange(t)
        for k, r in enumerate(rows):
            lo = int(r) * t
            begin = np.zeros(t, dtype=np.int64)
            i = bisect.bisect_right(starts, lo)  # the first sample starting after the row's first token
            while i < len(starts) and int(starts[i]) < lo + t:
                begin[int(starts[i]) - lo] = int(starts[i]) - lo
                i += 1
            out[k] = col - np.maximum.accumulate(begin)
        return torch.from_numpy(out)

    @property
    def ids(self) -> torch.Tensor:
        """Every row's ids (N, seq_len), read whole: for small data (tests, examples)."""
        return self.take(torch.arange(len(self)))[0]

    @property
    def mask(self) -> torch.Tensor:
        """Every row's loss mask (N, seq_len), read whole."""
        return self.take(torch.arange(len(self)))[1]

    def split(self, eval_fraction: float, seed: int = 0) -> tuple["Dataset", "Dataset"]:
        """A deterministic ``(train, held-out)`` split of the rows: ``eval_fraction`` of them (at least one, at most
        :data:`HELD_OUT_MAX`) held out, chosen by ``seed``."""
        if self.part:
            raise DataError("a split of a split: split the whole dataset once")
        n_eval = min(max(1, int(self.rows * eval_fraction)), HELD_OUT_MAX, self.rows - 1) if eval_fraction > 0 else 0
        key = keyed_hash(seed, 0x5EED)
        part = functools.partial(Dataset, self.stream, self.seq_len, self.pack, self.pad_id, documents=self.documents)
        return part((n_eval, self.rows, key)), part((0, n_eval, key))


def as_batch(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Rows and their loss mask as a batch: ``labels`` are the ids, ``-100`` where not trained on. With
    ``positions`` (packed documents) also ``position_ids``, and a sample's first token is no target (nothing before
    it in its sample predicts it, as when the sample runs alone)."""
    if positions is None:
        return {"input_ids": ids, "labels": ids.masked_fill(~mask, -100)}
    return {"input_ids": ids, "labels": ids.masked_fill(~mask | (positions == 0), -100), "position_ids": positions}


class Mixture:
    """Data sources trained on together: each global batch draws from source ``s`` its share ``weights[s]`` of the
    rows (exactly, over the batches so far), each source in its own per-epoch order. One source is the plain case;
    none, an empty held-out set."""

    def __init__(self, parts: list[Dataset], weights: list[float] | None = None, names: list[str] | None = None):
        from fractions import Fraction

        weights = [1.0] * len(parts) if weights is None else weights
        if len(weights) != len(parts) or any(not (isinstance(w, (int, float)) and 0 < w < math.inf) for w in weights):
            raise DataError(f"data weights {weights}: one positive, finite weight per source")
        raw = [Fraction(str(w)) for w in weights]
        self.parts, self.names = parts, names or [f"source {k}" for k in range(len(parts))]
        empty = [n for n, p in zip(self.names, parts, strict=True) if not len(p)]
        if empty:
            raise DataError(f"data source {empty[0]} leaves no rows to train on (too little data for one row of "
                            f"--seq-len beside its held-out rows): give it more data, or a shorter --seq-len")
        if len({p.documents for p in parts}) > 1:
            raise DataError("data sources mixed with and without packed documents (position_ids): build every "
                            "source's Dataset with the same documents=")
        self.shares = [w / sum(raw) for w in raw]
        self.weights = [float(w) for w in self.shares]
        self.main = max(range(len(parts)), key=lambda s: self.shares[s], default=0)  # takes what rounding leaves

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def samples(self) -> int:
        return sum(p.samples for p in self.parts)

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.parts)

    @property
    def truncated(self) -> int:
        return sum(p.truncated for p in self.parts)

    @property
    def max_id(self) -> int:
        return max((p.max_id for p in self.parts), default=0)

    def take_range(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Rows ``lo..hi`` of the sources one after another, as a batch (an evaluation's pass, in order)."""
        got, start = [], 0
        for p in self.parts:
            a, b = max(lo - start, 0), min(hi - start, len(p))
            if a < b:
                got.append((*p.take(torch.arange(a, b)), p.positions(torch.arange(a, b))))
            start += len(p)
        pos = [g[2] for g in got]
        return as_batch(torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got]),
                        torch.cat(pos) if pos and pos[0] is not None else None)

    def taken(self, s: int, rows: int) -> int:
        """How many of the first ``rows`` rows drawn come from source ``s`` (floor of its share; the main source
        takes the rest)."""
        if s != self.main:
            share = self.shares[s]
            return rows * share.numerator // share.denominator
        return rows - sum(self.taken(o, rows) for o in range(len(self.parts)) if o != self.main)

    def check_batch(self, global_batch: int) -> None:
        """Every source's rows per batch never negative: the main source's share of a batch covers the others'
        rounding up."""
        def fits(g: int) -> bool:
            return sum(-(-g * w.numerator // w.denominator) for s, w in enumerate(self.shares) if s != self.main) <= g

        if not fits(global_batch):
            least = next(g for g in range(global_batch, 1 << 20) if fits(g))
            raise DataError(f"--global-batch {global_batch} is too small to mix {len(self.parts)} sources with "
                            f"weights {', '.join(f'{w:g}' for w in self.weights)}: use {least} or more")
