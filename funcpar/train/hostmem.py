"""Host memory for training on the CPU: glibc's ``malloc`` told to keep what a step frees.

By default glibc serves a block of 32 MiB or more (less, until the first large block is freed) from a fresh
``mmap`` and gives it back to the kernel when it is freed; the heap's free top is given back too once it passes
128 KiB. A train step allocates and frees the same activation-sized tensors every step, so each step pays the
kernel's page faults again: every 4 KiB page of every such tensor is faulted in and zeroed before the first
write (docs/MEASUREMENTS.md has what that cost on the benchmark model). :func:`keep_freed_memory`
makes the process keep its freed memory for the next step instead (``M_MMAP_MAX = 0``: every block from the
heap; ``M_TRIM_THRESHOLD`` at its largest: the heap is never trimmed), so that after the first steps no page
is faulted in again. The price is that the process holds its high-water mark of memory until it ends, which is
what a training process holds anyway.

``compile_step`` calls it for a mesh whose tensors live on the CPU (``host_malloc="keep"``, the default;
``"system"`` leaves ``malloc`` as it is). It changes the whole process, so it is done once and only where
nobody has chosen otherwise: not when ``FUNCPAR_HOST_MALLOC=system`` is set, when the environment already sets
glibc's malloc options (``MALLOC_MMAP_MAX_``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``glibc.malloc`` tunables), when another allocator is preloaded
(jemalloc, tcmalloc, mimalloc, Hoard, snmalloc), or when the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_MALLOC_VARS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_OWN_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard", "snmalloc")
_done: str | None = None  # what keep_freed_memory did, once


def _reason_not_to() -> str | None:
    """Why the process's malloc is left alone (None: nothing against configuring it)."""
    if os.environ.get("FUNCPAR_HOST_MALLOC", "").strip().lower() == "system":
        return "FUNCPAR_HOST_MALLOC=system"
    mine = [k for k in _MALLOC_VARS if k in os.environ]
    if mine:
        return f"the environment sets {', '.join(mine)}"
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc options"
    preload = os.environ.get("LD_PRELOAD", "").lower()
    for name in _OWN_ALLOCATORS:
        if name in preload:
            return f"{name} is preloaded (LD_PRELOAD)"
    return None


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> str:
    """Configure glibc's ``malloc`` (once per process) to keep freed memory; returns what was done, in words:
    ``"kept"``, or why not (the reason is also the value of later calls)."""
    global _done
    if _done is None:
        reason = _reason_not_to()
        libc = None if reason else _glibc()
        if reason is None and libc is None:
            reason = "the C library is not glibc"
        if reason is None:
            ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
            reason = None if ok else "glibc refused mallopt"
        _done = reason or "kept"
    return _done
