"""The token cache: a data source tokenized once into files (ids, loss mask, sample starts) that every later run,
and every rank of a run, reads instead of tokenizing again, so a corpus larger than memory trains with the memory
of a batch.

A cache entry is a folder named by a key: a hash of the source files (path, size, modification time), the
tokenizer's fingerprint and the format's version, so an edited file or another tokenizer is another entry. It is
built aside (``<key>.tmp-<pid>``) and renamed into place whole, ``meta.json`` written last; concurrent builders
(the ranks of a job under torchrun) wait on a lock and the first one's entry serves the rest. ``--token-cache
auto`` caches sources of at least :data:`AUTO_BYTES` (smaller ones tokenize in memory in seconds), a folder always
caches there, ``off`` never. A run reads an entry's files row by row with ``pread`` (:class:`FileArray`), so its
memory holds the batches it takes and nothing of the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from pathlib import Path

from funcpar.data.samples import data_files, iter_samples
from funcpar.data.streams import Stream, tokenize
from funcpar.data.tokenizers import DataError

__all__ = ["stream", "cache_root", "FileArray", "AUTO_BYTES", "CACHE_ENV", "VERSION"]

AUTO_BYTES = 256 << 20  # a source this large is cached under --token-cache auto (tokenizing it takes a minute)
CACHE_ENV = "FUNCPAR_TOKEN_CACHE"  # the cache folder of --token-cache auto (default ~/.cache/funcpar/tokens)
VERSION = 2  # of the files' layout and of what a sample tokenizes to: a change makes every key new (2: CRCs)


def cache_root(choice: str) -> Path | None:
    """The cache folder ``--token-cache choice`` names (None for ``off``)."""
    if choice == "off":
        return None
    if choice == "auto":
        return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "funcpar" / "tokens")
    return Path(choice)


def _key(files: list[Path], tok) -> str:
    h = hashlib.sha256(f"funcpar-tokens-v{VERSION} {tok.fingerprint}".encode())
    for f in files:
        st = f.stat()
        h.update(f"\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def stream(source: str | os.PathLike, tok, choice: str = "auto") -> Stream:
    """``source`` (a data file or folder) tokenized: from its cache entry (built first if missing) when
    ``choice`` caches it, else in memory."""
    files = data_files(source)
    size = sum(f.stat().st_size for f in files)
    root = cache_root(choice)
    if root is None or (choice == "auto" and size < AUTO_BYTES) or not hasattr(tok, "fingerprint"):
        return tokenize(iter_samples(source), tok)
    folder = root / _key(files, tok)
    if not (folder / "meta.json").is_file():
        _build(source, files, size, tok, folder)
    return _open(folder)


def _build(source, files: list[Path], size: int, tok, folder: Path) -> None:
    """Tokenize ``source`` into ``folder`` unless another process does it first (it holds the lock meanwhile)."""
    import fcntl

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = open(folder.parent / f"{folder.name}.lock", "a")
    except OSError as e:
        raise DataError(f"--token-cache {folder.parent}: cannot write there ({e.strerror}); give a writable folder "
                        f"or --token-cache off") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (another rank building the same entry: wait for it)
        if (folder / "meta.json").is_file():
            return
        for stale in folder.parent.glob(f"{folder.name}.tmp-*"):  # (a builder killed mid-way: the lock is ours now)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = folder.parent / f"{folder.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        print(f"funcpar: tokenizing {source} ({size / 2**20:.0f} MiB) once into the token cache {folder}",
              file=sys.stderr, flush=True)
        t0, handles = time.perf_counter(), {}

        crcs = {}

        def sink(name, array):
            if name not in handles:
                handles[name] = open(tmp / f"{name}.bin", "wb")
            data = array.tobytes()
            crcs[f"{name}.bin"] = zlib.crc32(data, crcs.get(f"{name}.bin", 0))
            handles[name].write(data)

        try:
            counts = tokenize(iter_samples(source), tok, sink)
            for fh in handles.values():
                fh.close()
            meta = {"version": VERSION, "source": str(source), "files": [str(f.resolve()) for f in files],
                    "tokenizer": tok.fingerprint, "seconds": round(time.perf_counter() - t0, 1), **counts}
            if meta["all_trained"]:
                (tmp / "mask.bin").unlink(missing_ok=True)  # (every token trained on: no mask to store)
                crcs.pop("mask.bin", None)
            meta["crc32"] = {n: crcs.get(n, 0) for n in ("ids.bin", "starts.bin", "mask.bin")
                             if (tmp / n).exists()}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            if folder.exists():  # (an entry left without its meta.json: never trusted, replaced now)
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        except BaseException:
            for fh in handles.values():
                fh.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"funcpar: tokenized {meta['tokens']:,} tokens of {meta['samples']:,} samples in {meta['seconds']} s",
              file=sys.stderr, flush=True)


class FileArray:
    """A 1-D array in a file, read on demand with ``pread``: a slice or an element, or all of it (``np.asarray``).
    Not a memory map: the page cache's folios a mapped read faults in (megabytes around each row) would count in
    the rank's resident set, and over an epoch that is the whole file."""

    _MAX_READ = 1 << 30  # bytes per pread (Linux returns at most about 2 GiB)

    def __init__(self, path: Path, dtype, n: int):
        import numpy as np

        self.path, self.dtype, self.shape = Path(path), np.dtype(dtype), (int(n),)
        self.fd = os.open(self.path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.shape[0]

    def _read(self, start: int, stop: int):
        import numpy as np

        size, at = self.dtype.itemsize, max(stop - start, 0) * self.dtype.itemsize
        out = bytearray(at)
        view, done = memoryview(out), 0
        while done < at:
            got = os.preadv(self.fd, [view[done : done + self._MAX_READ]], start * size + done)
            if got <= 0:
                raise DataError(f"{self.path}: ends before element {stop} of {len(self)}")
            done += got
        return np.frombuffer(out, dtype=self.dtype)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise TypeError(f"{self.path}: only contiguous slices are read")
            return self._read(start, stop)
        k = int(key)
        k = k + len(self) if k < 0 else k
        if not 0 <= k < len(self):
            raise IndexError(f"index {key} out of range for {len(self)} elements")
        return self._read(k, k + 1)[0]

    def __array__(self, dtype=None, copy=None):
        whole = self._read(0, len(self))
        return whole if dtype is None else whole.astype(dtype)

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


def _check_crc(path: Path, want: int) -> None:
    """Hold a cache file to the CRC-32 its meta.json recorded when it was built (a file overwritten with other
    bytes of the same size would otherwise train as tokens). Read whole once; the verdict is kept beside it
    (``.verified-<name>``, with the size and mtime it held for), so later runs and ranks read it only if it changed."""
    st = path.stat()
    stamp = path.with_name(f".verified-{path.name}")
    seen = f"{st.st_size} {st.st_mtime_ns} {want}"
    try:
        if stamp.read_text() == seen:
            return
    except OSError:
        pass
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            crc = zlib.crc32(block, crc)
    if crc != want:
        raise DataError(f"{path}: its CRC-32 is {crc:08x}, not the {want:08x} its meta.json recorded (the file was "
                        f"changed after the entry was built)")
    try:
        stamp.write_text(seen)
    except OSError:
        pass  # (a read-only cache: checked again next time)


def _open(folder: Path) -> Stream:
    """The stream of a cache entry, its arrays read on demand (nothing is read until a row is taken)."""
    import numpy as np

    try:
        meta = json.loads((folder / "meta.json").read_text())
        dtype, n, samples = np.dtype(meta["dtype"]), int(meta["tokens"]), int(meta["samples"])
        sizes = {"ids.bin": n * dtype.itemsize, "starts.bin": (samples + 1) * 8}
        if not meta["all_trained"]:
            sizes["mask.bin"] = n
        for name, want in sizes.items():
            got = (folder / name).stat().st_size
            if got != want:
                raise DataError(f"{folder / name} holds {got} bytes, not the {want} its meta.json says")
        if meta.get("version") != VERSION:
            raise DataError(f"{folder}: a token cache of format {meta.get('version')}, not {VERSION}")
        for name in sizes:
            _check_crc(folder / name, meta["crc32"][name])

        return Stream(FileArray(folder / "ids.bin", dtype, n),
                      None if meta["all_trained"] else FileArray(folder / "mask.bin", np.uint8, n),
                      FileArray(folder / "starts.bin", np.int64, samples + 1), int(meta["max_id"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"the token cache {folder} is damaged ({e}): delete that folder and it is built again") \
            from None
