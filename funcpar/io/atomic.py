"""Folders that appear complete or not at all, written by the ranks of a mesh together, and only where funcpar may.

One protocol serves HF exports and checkpoints: rank 0 makes a temporary folder ``.NAME.tmp`` beside ``NAME``;
every rank runs ``write(tmp)`` (collectives allowed); the ranks agree whether every write succeeded; only then rank 0
runs ``finalize(tmp)`` (e.g. merging metadata), puts the folder in place (an existing ``NAME`` is replaced only now)
and runs ``publish(path)`` (e.g. pointing ``latest`` at it); the ranks agree once more. On any failure, anywhere,
the temporary folder is removed, ``NAME`` is as it was, and every rank raises the first failing rank's message.

Ownership: every folder written here carries a marker file ``.funcpar``. An existing ``NAME`` is replaced only if it
is empty or carries the marker (or with ``overwrite=True``): funcpar never deletes what it did not write.

Crash safety: an existing ``NAME`` is replaced by one atomic exchange of the two folders (``renameat2`` with
``RENAME_EXCHANGE`` on Linux), after which the old contents sit in ``.NAME.tmp`` and are deleted. Where the exchange
is unavailable, ``NAME`` is first renamed to ``.NAME.old``; a crash between the two renames leaves it there, and
:func:`recover` (run before every write, and by checkpoint loading) puts it back.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from funcpar.parallel import collectives as C

if TYPE_CHECKING:  # pragma: no cover
    from funcpar.parallel.mesh import Mesh

__all__ = ["write_folder", "swap_into_place", "recover", "agree", "MARKER", "open_own", "refuse_links", "write_file"]

MARKER = ".funcpar"  # in every folder funcpar writes: what may be replaced without overwrite=True
_MESSAGE_BYTES = 2048


def open_own(path: str | os.PathLike, mode: str = "w"):
    """``open(path, mode)`` for a file funcpar writes in its run folder, never through a symbolic link (a link
    planted there, dangling or not, would have the write land in someone else's file): ``"w"``/``"wb"`` replace a
    link with a new file, ``"a"`` refuses one (``OSError`` naming it)."""
    path = Path(path)
    if mode.startswith("w") and path.is_symlink():
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | (os.O_APPEND if mode[0] == "a" else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if path.is_symlink():
            raise OSError(f"{path} is a symbolic link (to {os.readlink(path)}): funcpar does not write through "
                          f"links in its run folder; remove it") from None
        raise e
    return os.fdopen(fd, mode)


def write_file(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace the file ``path`` whole or not at all, as checkpoints are written: ``data`` goes to ``.NAME.tmp``
    beside it, is flushed to disk, and is renamed over ``path``; a full disk or a kill
    at any point leaves ``path`` as it was (and a stale ``.NAME.tmp`` the next write replaces). The rename makes a
    new file: a hard link to the old one (a snapshot of the folder) keeps the old contents, and a symbolic link at
    ``path`` is replaced, never written through."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        view = memoryview(data.encode() if isinstance(data, str) else data)
        while view:
            view = view[os.write(fd, view):]
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # (the rename itself on disk: the folder's entry)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def refuse_links(folder: Path, names) -> None:
    """Raise ``SystemExit`` (one line) if any of ``names`` in ``folder`` is a symbolic link: the files and folders
    a run writes there are its own, never another's reached through a link."""
    for name in names:
        p = folder / name
        if p.is_symlink():
            raise SystemExit(f"funcpar: {p} is a symbolic link (to {os.readlink(p)}): funcpar writes only its own "
                             f"files in the run folder, not through links; remove the link or choose another --out")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the folders ``a`` and ``b``; False where the system cannot (not Linux, old kernel, fs)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _old(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.old"


def recover(dest: str | os.PathLike) -> Path:
    """``dest``, put back from ``.NAME.old`` if a crash mid-replacement left it there (see the module docstring)."""
    dest = Path(dest)
    if not dest.exists() and _old(dest).is_dir():
        try:
            os.rename(_old(dest), dest)
        except FileNotFoundError:  # another rank recovered it first
            pass
    return dest


def swap_into_place(tmp: Path, dest: Path) -> None:
    """Put the completed folder ``tmp`` at ``dest``; an existing ``dest`` is replaced only now (atomically where the
    system allows), then deleted."""
    recover(dest)
    if not dest.exists():
        os.rename(tmp, dest)
        return
    if _exchange(tmp, dest):
        shutil.rmtree(tmp)  # now the old contents
        return
    old = _old(dest)
    if old.exists():  # left by a crash after both renames: dest is complete
        shutil.rmtree(old)
    os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old)


def _readable_as_umask_allows(folder: Path) -> None:
    """Files as the user's umask makes them (the safetensors writer creates them 0600: no one else could read an
    export)."""
    mask = os.umask(0)
    os.umask(mask)
    for f in folder.rglob("*"):
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


def written_as(path: Path) -> dict:
    """What the funcpar folder ``path`` says it is (its :data:`MARKER`): ``{"kind": ..., "owner": ...}``, or ``{}``
    for a marker from before folders said (replaceable by any write, as then)."""
    try:
        said = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return said if isinstance(said, dict) else {}


def check_owned(path: Path, overwrite: bool, error: type[Exception] = FileExistsError, kind: str | None = None,
                owner: str | None = None) -> None:
    """Refuse to replace ``path`` unless it is absent, an empty folder, or a folder funcpar wrote as the same
    ``kind`` of folder for the same ``owner`` (a checkpoint of the same run, an export); or ``overwrite``."""
    if overwrite or not path.exists() and not path.is_symlink():
        return
    if not path.is_dir() or path.is_symlink():
        raise error(f"{path} exists and is not a folder: refusing to replace it; choose another path "
                              "(or pass overwrite=True / --overwrite)")
    if not any(path.iterdir()):
        return
    if not (path / MARKER).is_file():
        raise error(
            f"{path} exists and was not written by funcpar (it has no {MARKER} marker): refusing to replace what is "
            "in it; choose another folder, empty it, or pass overwrite=True (--overwrite on the command line)")
    was = written_as(path)
    if kind is not None and was.get("kind") not in (None, kind):
        raise error(f"{path} is a {KINDS.get(was['kind'], was['kind'])}; refusing to replace it with a "
                    f"{KINDS.get(kind, kind)}: choose another folder (or pass overwrite=True / --overwrite)")
    if owner is not None and was.get("owner") not in (None, owner):
        raise error(f"{path} is a {KINDS.get(was.get('kind'), 'folder')} of another run ({was['owner']}); refusing "
                    f"to replace it with this run's: choose another folder (or pass overwrite=True / --overwrite)")


KINDS = {"checkpoint": "funcpar checkpoint", "hf": "transformers folder funcpar exported",
         "adapter": "PEFT adapter folder funcpar exported"}


def agree(error: BaseException | None, mesh: "Mesh") -> str | None:
    """Collective: ``None`` if no rank has an error, else the first failing rank's message, on every rank."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=mesh.device)
    if not C.all_reduce(flag, mesh, mesh.axis_names, "max").item():
        return None
    rows = torch.zeros(mesh.size, _MESSAGE_BYTES, dtype=torch.int32, device=mesh.device)
    if error is not None:
        text = f"{error}".encode()[: _MESSAGE_BYTES - 1] or type(error).__name__.encode()
        rows[mesh.rank, : len(text)] = torch.tensor(list(text), dtype=torch.int32)
    rows = C.all_reduce(rows, mesh, mesh.axis_names, "sum").cpu()
    first = next(r for r in range(mesh.size) if rows[r, 0])
    return bytes(rows[first][rows[first] > 0].tolist()).decode(errors="replace")


def no_space(error: BaseException | None, message: str | None = None) -> bool:
    """Whether a write failed for a full disk or quota (on this rank: ``error``; on any: the agreed ``message``)."""
    text = message or str(error or "")
    return (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        s in text for s in ("No space left on device", "Disk quota exceeded"))


_AFTER_NO_SPACE = {"checkpoint": "the checkpoints before it are intact: free space, then --resume continues from "
                                 "the latest",
                   "hf": "the run's checkpoints are intact: free space, then funcpar convert RUN-FOLDER HF-FOLDER "
                         "exports the latest"}


def _no_space_message(path: Path, kind: str | None) -> str:
    """One line for a folder a full disk stopped: where, how much is free, and that nothing was lost."""
    where = next((p for p in [path, *path.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(where).free / 2**30
    after = _AFTER_NO_SPACE.get(kind or "", "free space and run it again")
    return (f"no space left on the device (or the disk quota is used up) writing {path} ({free:.1f} GiB free "
            f"there): nothing was written and what was there is unchanged; {after}")


def _attempt(fn: Callable[[], None], error: BaseException | None) -> BaseException | None:
    if error is not None:
        return error
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - every rank must learn of it
        return e
    return None


LOCK_WAIT = float(os.environ.get("FUNCPAR_SAVE_LOCK_WAIT", "600"))  # seconds a save waits for another's


def lock_folder(folder: Path, error: type[Exception] = RuntimeError, wait: float | None = None) -> int:
    """An exclusive lock (``flock`` on the folder itself) that every funcpar write into ``folder`` holds from its
    temporary folder to its rename and ``latest``: two processes saving into one folder (two jobs through the API)
    take turns instead of writing one temporary folder together. Waits up to ``wait`` seconds (default
    :data:`LOCK_WAIT`, ``FUNCPAR_SAVE_LOCK_WAIT``) for a write in progress, then raises ``error`` naming the folder.
    Returns the descriptor to close."""
    import fcntl
    import time

    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    end = time.monotonic() + (LOCK_WAIT if wait is None else wait)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= end:
                os.close(fd)
                raise error(f"{folder}: another process has been writing into it for "
                            f"{LOCK_WAIT if wait is None else wait:g} s (a save or an export of another job); "
                            f"nothing was written: save elsewhere, or once that process is done") from None
            time.sleep(0.05)


def write_folder(
    path: str | os.PathLike,
    mesh: "Mesh",
    write: Callable[[Path], None],
    *,
    finalize: Callable[[Path], None] | None = None,
    publish: Callable[[Path], None] | None = None,
    error: type[Exception] = RuntimeError,
    overwrite: bool = False,
    kind: str | None = None,
    owner: str | None = None,
) -> None:
    """Write the folder ``path`` atomically with every rank of ``mesh`` (see the module docstring); collective.

    ``write`` runs on every rank and must issue the same collectives on every rank even when it fails part-way
    (catch, keep going, raise at the end); ``finalize`` and ``publish`` run on rank 0 only. ``overwrite``: replace
    an existing folder funcpar did not write (its contents are deleted), or one it wrote as another ``kind`` of
    folder (:data:`KINDS`) or for another ``owner`` (a run's id): the folder's marker records both.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    rank0, made, held = mesh.rank == 0, [], []

    def make_tmp():
        path.parent.mkdir(parents=True, exist_ok=True)
        held.append(lock_folder(path.parent, error))
        check_owned(recover(path), overwrite, error, kind, owner)
        made.append(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # (a folder without this file is never replaced; one with it only by the same kind of write)
        (tmp / MARKER).write_text(json.dumps({"written_by": "funcpar", "kind": kind, "owner": owner}) + "\n")

    err = _attempt(make_tmp, None) if rank0 else None
    if agree(err, mesh) is None:
        err = _attempt(lambda: write(tmp), err)
        if agree(err, mesh) is None and rank0:
            err = _attempt(lambda: (finalize or (lambda t: None))(tmp), err)
            err = _attempt(lambda: _readable_as_umask_allows(tmp), err)
            err = _attempt(lambda: swap_into_place(tmp, path), err)
            err = _attempt(lambda: (publish or (lambda p: None))(path), err)
    message = agree(err, mesh)
    for fd in held:
        os.close(fd)  # (the folder's lock: released with its descriptor)
    if message is None:
        return
    if made:
        shutil.rmtree(tmp, ignore_errors=True)
    if no_space(err, message):  # (safetensors says it in its own exception type, not an OSError)
        raise error(_no_space_message(path, kind)) from None
    if err is not None:
        raise err
    raise error(f"writing {path} failed on another rank ({message}); nothing was written and what was there is "
                "unchanged")
