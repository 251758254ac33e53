"""Folders that appear complete or not at all, written by the ranks of a mesh together.

One protocol serves HF exports and checkpoints: rank 0 makes a temporary folder ``.NAME.tmp`` beside ``NAME``;
every rank runs ``write(tmp)`` (collectives allowed); the ranks agree whether every write succeeded; only then rank 0
runs ``finalize(tmp)`` (e.g. merging metadata), renames the folder into place (an existing ``NAME`` is replaced only
now) and runs ``publish(path)`` (e.g. pointing ``latest`` at it); the ranks agree once more. On any failure, anywhere,
the temporary folder is removed, ``NAME`` is as it was, and every rank raises.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from . import collectives as C

if TYPE_CHECKING:  # pragma: no cover
    from .mesh import Mesh

__all__ = ["write_folder", "swap_into_place"]


def swap_into_place(tmp: Path, dest: Path) -> None:
    """Put the completed folder ``tmp`` at ``dest``; an existing ``dest`` is replaced only now, and then deleted."""
    if not dest.exists():
        os.rename(tmp, dest)
        return
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old)


def _any_failed(error: BaseException | None, mesh: "Mesh") -> bool:
    flag = torch.tensor([0.0 if error is None else 1.0], device=mesh.device)
    return bool(C.all_reduce(flag, mesh, mesh.axis_names, "max").item())


def _attempt(fn: Callable[[], None], error: BaseException | None) -> BaseException | None:
    if error is not None:
        return error
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - every rank must learn of it
        return e
    return None


def write_folder(
    path: str | os.PathLike,
    mesh: "Mesh",
    write: Callable[[Path], None],
    *,
    finalize: Callable[[Path], None] | None = None,
    publish: Callable[[Path], None] | None = None,
    error: type[Exception] = RuntimeError,
) -> None:
    """Write the folder ``path`` atomically with every rank of ``mesh`` (see the module docstring); collective.

    ``write`` runs on every rank and must issue the same collectives on every rank even when it fails part-way
    (catch, keep going, raise at the end); ``finalize`` and ``publish`` run on rank 0 only.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    rank0 = mesh.rank == 0

    def make_tmp():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    err = _attempt(make_tmp, None) if rank0 else None
    if not _any_failed(err, mesh):
        err = _attempt(lambda: write(tmp), err)
        if not _any_failed(err, mesh) and rank0:
            err = _attempt(lambda: (finalize or (lambda t: None))(tmp), err)
            err = _attempt(lambda: swap_into_place(tmp, path), err)
            err = _attempt(lambda: (publish or (lambda p: None))(path), err)
    failed = _any_failed(err, mesh)
    if not failed:
        return
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    if err is not None:
        raise err
    raise error(f"writing {path} failed on another rank; nothing was written and what was there is unchanged")
