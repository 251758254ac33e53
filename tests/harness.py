"""Real gloo worlds for tests: pools of worker processes reused across tests.

``run(world, fn, *args)`` runs the module-level function ``fn`` on every rank of a ``world``-process gloo group and
returns the per-rank results (rank order). Starting processes costs seconds (importing torch), so each world size
keeps one pool alive for the whole session. A rank that raises fails the call with its traceback; a pool whose ranks
stop answering (stuck in a collective after a peer failed) is killed and replaced, so one broken test never hangs
the suite. Functions and results cross the process boundary with plain pickle, tensors included.

Inside a worker, ``mesh(tp=2, dp=2)`` returns a cached ``funcpar.Mesh`` (creating process groups is collective and
not free), so tests share meshes the way they share processes.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import socket
import time
import traceback

_CTX = mp.get_context("spawn")
_POOLS: dict[int, "Pool"] = {}
_MESHES: dict = {}


class Died:
    """Stands in for the result of a rank whose process exited."""

    def __init__(self, exitcode):
        self.exitcode = exitcode

    def __repr__(self):
        return f"Died(exitcode={self.exitcode})"


class WorldError(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn, timeout_s: float) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        FUNCPAR_TIMEOUT=str(timeout_s),
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    conn.send_bytes(b"ready")
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            break
        if msg == b"stop":
            break
        try:
            fn, args, kwargs = pickle.loads(msg)
            payload = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent
            payload = pickle.dumps(("err", traceback.format_exc()))
        conn.send_bytes(payload)
    os._exit(0)  # skip interpreter teardown of gloo threads


class Pool:
    def __init__(self, world: int, timeout_s: float = 60.0):
        self.world = world
        port = _free_port()
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = _CTX.Pipe()
            p = _CTX.Process(target=_worker, args=(r, world, port, child, timeout_s), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for r, c in enumerate(self.conns):
            if not c.poll(120) or c.recv_bytes() != b"ready":
                self.close()
                raise WorldError(f"rank {r} of a {world}-process gloo world did not start")
        self.broken = False

    def run(self, fn, *args, timeout: float = 300.0, allow_death: bool = False, **kwargs) -> list:
        msg = pickle.dumps((fn, args, kwargs))
        for c in self.conns:
            c.send_bytes(msg)
        results: list = [None] * self.world
        errors: dict[int, str] = {}
        pending = set(range(self.world))
        deadline = time.monotonic() + timeout
        first_failure = None
        while pending:
            # once a rank failed, give the rest a short grace period: they may be stuck in a collective
            limit = deadline if first_failure is None else min(deadline, first_failure + 30.0)
            waitables = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            ready = mpc.wait(list(waitables), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for w in ready:
                r = waitables[w]
                if r not in pending:
                    continue
                conn = self.conns[r]
                if conn.poll():
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        status, value = "died", None
                else:
                    status, value = ("died", None) if not self.procs[r].is_alive() else ("wait", None)
                if status == "wait":
                    continue
                pending.discard(r)
                if status == "ok":
                    results[r] = value
                elif status == "died":
                    self.procs[r].join(1)
                    results[r] = Died(self.procs[r].exitcode)
                    self.broken = True
                    if not allow_death:
                        errors[r] = f"rank {r} exited with code {self.procs[r].exitcode}"
                else:
                    errors[r] = value
                if r in errors and first_failure is None:
                    first_failure = time.monotonic()
        if pending:
            self.broken = True
            self.close()
            stuck = sorted(pending)
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise WorldError(f"ranks {stuck} of {self.world} did not finish {fn.__name__}{detail}")
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise WorldError(f"{fn.__name__} failed on ranks {sorted(errors)}:{detail}")
        return results

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send_bytes(b"stop")
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        self.broken = True


def pool(world: int) -> Pool:
    p = _POOLS.get(world)
    if p is None or p.broken:
        if p is not None:
            p.close()
        p = _POOLS[world] = Pool(world)
    return p


def run(world: int, fn, *args, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a reused ``world``-process gloo group; per-rank results."""
    p = pool(world)
    try:
        return p.run(fn, *args, **kwargs)
    finally:
        if p.broken:
            _POOLS.pop(world, None)


@atexit.register
def _close_all() -> None:
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


# ------------------------------------------------------------------------------------------- inside a worker


def mesh(**sizes):
    """A cached ``funcpar.Mesh`` for this worker process (every rank must ask for the same meshes in order)."""
    import funcpar as fp

    key = tuple(sorted(sizes.items()))
    if key not in _MESHES:
        _MESHES[key] = fp.Mesh(**sizes)
    return _MESHES[key]


def token_batches(n: int, vocab: int, rows: int, seq: int, seed: int, masked: int) -> list[dict]:
    """``n`` global batches of random token ids (labels = ids), batch ``s`` with the first ``masked`` labels of row
    ``s`` ignored: uneven targets over micro-batches and ranks."""
    import torch

    out = []
    for s in range(n):
        ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed + s))
        labels = ids.clone()
        labels[s, :masked] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def dp_share(batch: dict, mesh) -> dict:
    """This rank's share of a global batch: its block of rows along ``dp``."""
    dp, k = mesh.axis_size("dp"), mesh.coord("dp")
    return {n: x.chunk(dp)[k] for n, x in batch.items()}


def train_saving(step, state, batches: list, mesh, folder: str, save_after: int = 1):
    """Run ``step`` over ``batches`` (this rank's dp share of each), saving a checkpoint to ``folder`` after batch
    ``save_after``; returns the final state and the losses."""
    losses = []
    for i, b in enumerate(batches):
        state, m = step(state, dp_share(b, mesh))
        losses.append(m["loss"])
        if i == save_after:
            step.save(folder, state)
    return state, losses


def assert_same_training(got: tuple, want: tuple, rel: float = 1e-5) -> None:
    """``got`` and ``want`` are ``(losses, params)`` of two trainings of the same model: each loss within ``rel`` of
    the reference's, and the parameters' difference (as one vector) within ``rel`` of the reference's norm."""
    import math

    import funcpar as fp

    (losses, params), (ref_losses, ref) = got, want
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= rel * abs(b), (losses, ref_losses)
    pairs = list(zip(fp.tree.leaves_with_path(params), fp.tree.leaves_with_path(ref), strict=True))
    diff = math.sqrt(sum((x - y).pow(2).sum().item() for (_, x), (_, y) in pairs))
    assert diff <= rel * math.sqrt(sum(y.pow(2).sum().item() for _, (_, y) in pairs)), diff
