"""Keeping a job's processes together: a worker ends when its launcher dies, a rank that stops making progress is
reported by a peer within seconds (not after the collective timeout), and a worker's last error reaches its launcher.

- **Launcher death.** A worker asks the kernel for ``SIGTERM`` when its parent dies (``PR_SET_PDEATHSIG`` on Linux),
  and a watchdog thread compares ``os.getppid()`` with the parent it started under (every platform, and the case
  where the parent died before the request). torchrun's agent is the parent of its workers, so ``kill -9`` of
  ``funcpar train`` or ``torchrun`` ends the job instead of leaving it training.
- **Heartbeat.** The ranks form a ring in the job's store (the TCPStore torchrun's agent, or rank 0, hosts): every
  ``interval / 5`` s rank ``r`` increments its counter and reads the counter of the next rank that has not finished.
  A counter unchanged for ``interval`` s means that rank is stopped (SIGSTOP, a debugger, swapped out) or hung in a
  way that holds the interpreter: the watcher reports it, naming its host and pid, and ends its own process, which
  ends the job (torchrun tears down the rest; the peers' collectives fail at once). A store that stops answering
  for ``interval`` s means its host is gone: reported the same way. One watcher per rank keeps the store's load
  linear in the world size. ``interval`` is ``init_distributed(heartbeat=)`` or ``Mesh(heartbeat=)``, else
  ``$FUNCPAR_HEARTBEAT``, else 60 s; 0 turns it off (e.g. to pause a rank in a debugger).
- **Reporting.** :func:`report` is how a worker says why it ends: into torchrun's error file
  (``$TORCHELASTIC_ERROR_FILE``, which torchrun's summary and ``funcpar``'s launcher read), and on stderr unless
  ``funcpar``'s own launcher will print it (once, however many ranks said it).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

__all__ = ["start", "stop", "report", "default_heartbeat", "LAUNCHER_ENV"]

LAUNCHER_ENV = "FUNCPAR_LAUNCHER"  # set by funcpar's launcher: it prints the workers' reports itself
_state: dict[str, Any] = {}  # the process's lifeline: one per process, whatever the number of meshes


def default_heartbeat() -> float:
    """``$FUNCPAR_HEARTBEAT`` seconds, else 60."""
    return float(os.environ.get("FUNCPAR_HEARTBEAT", "60"))


def report(message: str, echo: bool = True, printed: bool = False, retry: bool = True) -> None:
    """Record why this worker ends: torchrun's error file, and stderr (if ``echo``) unless funcpar's launcher
    prints it. ``printed``: said on stderr already (the launcher's summary leaves it out, so it is said once).
    ``retry``: False for a failure a restart would only repeat (a refusal, a wrong setting): funcpar's launcher
    then spends no ``--max-restarts`` on it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        # written beside it, then renamed: a worker killed mid-write (torchrun tears the others down when one dies)
        # leaves no empty file, which torchrun's agent cannot parse and would end the whole job on, restarts unspent
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as fh:
                json.dump({"message": message, "timestamp": int(time.time()), "printed": printed, "retry": retry},
                          fh)
            os.replace(tmp, path)
        except OSError:
            path = None
    if not printed and (not path or echo and os.environ.get(LAUNCHER_ENV) != "1"):
        print(message, file=sys.stderr, flush=True)


def _end(message: str, now: bool = False) -> None:
    if now and os.environ.get(LAUNCHER_ENV) == "1":  # the launcher's summary comes only after torchrun's teardown:
        print(message, file=sys.stderr, flush=True)  # said now, and marked so that the summary does not repeat it
        report(message, printed=True)
    else:
        report(message)
    os._exit(1)  # from a watcher thread: the main thread may be blocked in a collective that never returns


def _die_with_parent() -> None:
    try:
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (AttributeError, OSError):  # not Linux: the watchdog below does it
        pass


def _store(timeout: float):
    """A client of the job's store (its own connection: the main thread's may be blocked), or None if unknown."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


class _Watcher(threading.Thread):
    def __init__(self, rank: int, world: int, interval: float):
        super().__init__(name="funcpar-lifeline", daemon=True)
        self.rank, self.world, self.interval = rank, world, interval
        self.parent = os.getppid()
        self.halt = threading.Event()
        self.store = None
        if world > 1 and interval > 0:
            try:
                self.store = _store(max(interval, 1.0))
                self.store.set(self._key("who", rank), f"{socket.gethostname()} pid {os.getpid()}")
            except Exception:  # noqa: BLE001 - no store to reach: no heartbeat, the collective timeout remains
                self.store = None

    def _key(self, kind: str, rank: int) -> str:
        run = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
        return f"funcpar/{'/'.join(run)}/{kind}/{rank}"

    def run(self) -> None:
        tick = max(0.05, min(1.0, self.interval / 5)) if self.store is not None else 1.0
        peer, seen, since = None, None, time.monotonic()
        while not self.halt.wait(tick):
            if os.getppid() != self.parent:
                _end(f"funcpar: rank {self.rank}: its launcher (pid {self.parent}) has exited; ending this worker")
            if self.store is None:
                continue
            try:
                self.store.add(self._key("beat", self.rank), 1)
                nxt = self._next_peer(peer)
                if nxt is None:
                    continue
                count = self.store.add(self._key("beat", nxt), 0)
            except Exception as e:  # noqa: BLE001 - the store's host is gone or stopped
                if self.halt.is_set():
                    return
                _end(f"funcpar: rank {self.rank}: the job's store at {os.environ.get('MASTER_ADDR')}:"
                     f"{os.environ.get('MASTER_PORT')} stopped answering ({e}); its host (the launcher or rank 0) "
                     "has exited or stopped: ending this worker")
            now = time.monotonic()
            if (nxt, count) != (peer, seen):
                peer, seen, since = nxt, count, now
            elif now - since > self.interval:
                self._stuck(peer, now - since)

    def _next_peer(self, current: int | None) -> int | None:
        """The next rank after this one (in ring order) that has not finished."""
        for k in range(1, self.world):
            r = (self.rank + k) % self.world
            if not self.store.check([self._key("done", r)]):
                return r
        return None

    def _stuck(self, peer: int, idle: float) -> None:
        who = self.store.get(self._key("who", peer)).decode() if self.store.check([self._key("who", peer)]) else "?"
        _end(f"funcpar: rank {peer} ({who}) has made no progress for {idle:.0f} s (stopped by a signal or a "
             f"debugger, or hung); rank {self.rank} ends the job rather than wait out the collective timeout "
             f"(heartbeat interval {self.interval:g} s: Mesh(heartbeat=...), $FUNCPAR_HEARTBEAT or --heartbeat; "
             "0 turns it off)", now=True)


def start(rank: int, world: int, interval: float | None = None) -> None:
    """Start this process's lifeline (once; a later call with another ``interval`` restarts the heartbeat, one
    without keeps the running one). ``interval``: default ``$FUNCPAR_HEARTBEAT`` or 60 s."""
    current = _state.get("watcher")
    if current is not None and current.is_alive() and interval in (None, current.interval):
        return
    interval = default_heartbeat() if interval is None else float(interval)
    if current is not None:
        current.halt.set()
    else:
        _die_with_parent()
    _state["watcher"] = w = _Watcher(rank, world, interval)
    w.start()


def stop() -> None:
    """Tell the peers this rank has finished (they stop watching it) and stop the lifeline; at exit."""
    w = _state.pop("watcher", None)
    if w is None:
        return
    w.halt.set()
    if w.store is not None:
        try:
            w.store.set(w._key("done", w.rank), "1")
        except Exception:  # noqa: BLE001 - exiting; the store may be gone already
            pass
    w.join(timeout=5.0)  # gone before the interpreter finalizes (a store call in flight is bounded by its timeout)
