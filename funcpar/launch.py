"""Starting a command's ranks and ending them with a reason: funcpar's launcher over ``torch.distributed.run`` and
the one-line report of a failed job (:mod:`funcpar.lifeline` carries each worker's reason to it).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from typing import Callable, NoReturn

import funcpar as fp
from funcpar import lifeline

__all__ = ["launch_if_needed", "fail", "debug", "USER_ERRORS", "INTERRUPTED", "StopRequest", "run_and_exit",
           "restarted"]

INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it


class StopRequest:
    """While training: Ctrl-C (SIGINT) or SIGTERM (torchrun passes Ctrl-C on as SIGTERM) asks the run to stop after
    the step under way; :meth:`agreed` tells every rank at the same step (one all-reduce of a flag), so they save
    together. A second signal interrupts at once."""

    def __enter__(self) -> "StopRequest":
        self.asked = False
        self._old = {s: signal.signal(s, self._ask) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _ask(self, signum, frame) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def agreed(self, mesh) -> bool:
        import torch

        flag = torch.tensor([float(self.asked)], device=mesh.device)
        return bool(fp.collectives.all_reduce(flag, mesh, mesh.axis_names, "max").item())


def launch_if_needed(argv: list[str], nproc: int, max_restarts: int = 0) -> bool:
    """Outside torchrun with a multi-rank mesh: run this same command under torch.distributed.run. True if done.

    The workers report why they ended through torchrun's error files (:func:`funcpar.lifeline.report`); a failed
    job prints each distinct reason once, naming the ranks when not all of them gave it (``--debug``: torchrun's
    own logs and the tracebacks too). ``max_restarts``: torchrun restarts every worker when one fails, that many
    times at most (the restarted ones see ``TORCHELASTIC_RESTART_COUNT`` > 0: :func:`restarted`)."""
    if nproc <= 1 or "RANK" in os.environ:
        return False
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[lifeline.LAUNCHER_ENV] = "1"
    if not debug():
        for name in list(logging.root.manager.loggerDict):  # torchrun's own lines would bury the one that matters
            if name.startswith("torch.distributed"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}",
                                          f"--max-restarts={max_restarts}", "-m", "funcpar", *argv]))
    except ChildFailedError as e:
        if all(f.exitcode == INTERRUPTED for f in e.failures.values()):
            raise SystemExit(INTERRUPTED) from None  # rank 0 said where it saved and how to resume
        raise SystemExit(_failure_summary(e.failures, nproc) or 1) from None  # (1: every reason said already)
    except SignalException:  # Ctrl-C reached torchrun too: it passed SIGTERM on, and the workers saved
        raise SystemExit(INTERRUPTED) from None
    return True


def restarted() -> int:
    """How many times torchrun has restarted this worker's group (0: the first attempt, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _failure_summary(failures: dict, world: int) -> str:
    """One line per distinct reason the failed ranks gave (deaths by signal first, then in time order), but for
    those a rank printed as it ended (``lifeline.report(printed=True)``)."""
    reasons: dict[str, list[int]] = {}
    printed = set()
    for rank, f in sorted(failures.items(), key=lambda kv: (kv[1].exitcode >= 0, kv[1].timestamp, kv[0])):
        data = f.error_file_data if isinstance(f.error_file_data, dict) else {}
        said = data.get("message")
        if data.get("printed") is True and isinstance(said, str):
            printed.add(said)
        if isinstance(said, str) and said.startswith("funcpar"):  # written by lifeline.report
            reason = said
        elif f.exitcode < 0:
            reason = f"funcpar: rank {rank} was killed by {f.signal_name()}"
        else:
            reason = f"funcpar: rank {rank} exited with code {f.exitcode} (its output is above)"
        reasons.setdefault(reason, []).append(rank)
    lines = []
    for reason, ranks in reasons.items():
        if reason in printed:
            continue
        who = "" if len(ranks) == world or f"rank {ranks[0]} " in reason else (
            f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))})")
        lines.append(reason + who)
    return "\n".join(lines)


def debug() -> bool:
    return os.environ.get("FUNCPAR_DEBUG") == "1"


USER_ERRORS = (ValueError, OSError, fp.MeshError, fp.CollectiveError)  # funcpar's own errors and the system's


def fail(message: str, code: int = 1) -> None:
    """End this process with ``message``: once per job (rank 0, or funcpar's launcher), never a traceback."""
    if "RANK" in os.environ:
        if os.environ.get("RANK") == "0" or os.environ.get(lifeline.LAUNCHER_ENV) == "1":
            lifeline.report(message)
        else:  # under a user's torchrun: only into torchrun's error file (rank 0 prints)
            lifeline.report(message, echo=False)
    else:
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


def run_and_exit(command: Callable[[], None]) -> NoReturn:
    """Run the command line's ``command``, then end the process without the interpreter's teardown.

    The exit is what Python's own would be, in its order: the thread pools' exit hooks and the joins of non-daemon
    threads, then every ``atexit`` handler (funcpar's process-group teardown, logging's flush, inductor's pools),
    then stdout and stderr flushed; a ``SystemExit`` gives the status (a message: printed to stderr, status 1).
    What is skipped is the interpreter's finalization of its modules, which after a run that loaded torch (and
    matplotlib or inductor) takes a second or so of one core per process (docs/MEASUREMENTS.md). By then every file
    the run wrote is closed. Only for the command line (``python -m funcpar``, the ``funcpar`` script): a program
    that calls :func:`funcpar.cli.main` keeps its process. Another exception propagates as usual (a traceback)."""
    code: object = 0
    try:
        command()
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    shutdown = getattr(threading, "_shutdown", None)  # (what the interpreter runs first; absent: nothing to join)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code or 0)
