"""The token cache: a data source tokenized once into files (ids, loss mask, sample starts) that every later run,
and every rank of a run, memory-maps instead of tokenizing again, so a corpus larger than memory trains with the
memory of a batch.

A cache entry is a folder named by a key: a hash of the source files (path, size, modification time), the
tokenizer's fingerprint and the format's version, so an edited file or another tokenizer is another entry. It is
built aside (``<key>.tmp-<pid>``) and renamed into place whole, ``meta.json`` written last; concurrent builders
(the ranks of a job under torchrun) wait on a lock and the first one's entry serves the rest. ``--token-cache
auto`` caches sources of at least :data:`AUTO_BYTES` (smaller ones tokenize in memory in seconds), a folder always
caches there, ``off`` never.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .data import DataError, Stream, data_files, iter_samples, tokenize

__all__ = ["stream", "cache_root", "AUTO_BYTES", "CACHE_ENV", "VERSION"]

AUTO_BYTES = 256 << 20  # a source this large is cached under --token-cache auto (tokenizing it takes a minute)
CACHE_ENV = "FUNCPAR_TOKEN_CACHE"  # the cache folder of --token-cache auto (default ~/.cache/funcpar/tokens)
VERSION = 1  # of the files' layout and of what a sample tokenizes to: a change makes every key new


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
        tmp = folder.parent / f"{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        print(f"funcpar: tokenizing {source} ({size / 2**20:.0f} MiB) once into the token cache {folder}",
              file=sys.stderr, flush=True)
        t0, handles = time.perf_counter(), {}

        def sink(name, array):
            if name not in handles:
                handles[name] = open(tmp / f"{name}.bin", "wb")
            array.tofile(handles[name])

        try:
            counts = tokenize(iter_samples(source), tok, sink)
            for fh in handles.values():
                fh.close()
            meta = {"version": VERSION, "source": str(source), "files": [str(f.resolve()) for f in files],
                    "tokenizer": tok.fingerprint, "seconds": round(time.perf_counter() - t0, 1), **counts}
            if meta["all_trained"]:
                (tmp / "mask.bin").unlink(missing_ok=True)  # (every token trained on: no mask to store)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            os.replace(tmp, folder)
        except BaseException:
            for fh in handles.values():
                fh.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"funcpar: tokenized {meta['tokens']:,} tokens of {meta['samples']:,} samples in {meta['seconds']} s",
              file=sys.stderr, flush=True)


def _open(folder: Path) -> Stream:
    """The stream of a cache entry, memory-mapped (read-only: nothing is read until a row is taken)."""
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

        def mapped(name, dt, count):  # (np.memmap refuses an empty file)
            return np.memmap(folder / name, dtype=dt, mode="r", shape=(count,)) if count else np.zeros(0, dt)

        return Stream(mapped("ids.bin", dtype, n), None if meta["all_trained"] else mapped("mask.bin", np.uint8, n),
                      mapped("starts.bin", np.int64, samples + 1), int(meta["max_id"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"the token cache {folder} is damaged ({e}): delete that folder and it is built again") \
            from None
