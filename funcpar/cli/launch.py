"""Starting a command's ranks and ending them with a reason: funcpar's launcher over ``torch.distributed.run`` and
the one-line report of a failed job (:mod:`funcpar.parallel.lifeline` carries each worker's reason to it).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, NoReturn

import funcpar as fp
from funcpar.parallel import lifeline

__all__ = ["launch_if_needed", "fail", "debug", "USER_ERRORS", "INTERRUPTED", "StopRequest", "run_and_exit",
           "restarted", "LOGS_ENV", "PEER_LOST"]

INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it
LOGS_ENV = "FUNCPAR_LOGS"  # set by funcpar's launcher: the folder of its ranks' logs (rank-N.log: their tracebacks)
# what a rank says when it fails because a peer failed first (funcpar.parallel.transport's CollectiveError says it too)
PEER_LOST = "a peer rank has died or stopped responding"


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


def launch_if_needed(argv: list[str], nproc: int, max_restarts: int = 0, logs: Path | None = None) -> bool:
    """Outside torchrun with a multi-rank mesh: run this same command under torch.distributed.run. True if done.

    The workers report why they ended through torchrun's error files (:func:`funcpar.parallel.lifeline.report`); a
    failed job prints each distinct reason once, naming the ranks when not all of them gave it, and leaves out what
    followed from another rank's failure (a peer's lost connection, torchrun's SIGTERM to the rest) when a cause is
    known (``--debug``: torchrun's own logs and the tracebacks too). ``logs``: the folder where a worker that ends
    on an unexpected error appends its traceback (``rank-N.log``; the console gets its one line). ``max_restarts``:
    torchrun restarts every worker when one fails, that many times at most (the restarted ones see
    ``TORCHELASTIC_RESTART_COUNT`` > 0: :func:`restarted`); each restart is preceded by the failure's lines. A
    failure a restart would repeat (a worker's ``fail(retry=False)``: a refusal, a NaN loss) ends the job at once."""
    if nproc <= 1 or "RANK" in os.environ:
        return False
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[lifeline.LAUNCHER_ENV] = "1"
    if logs is not None:
        os.environ[LOGS_ENV] = str(logs)
    if not debug():
        for name in list(logging.root.manager.loggerDict):  # torchrun's own lines would bury the one that matters
            if name.startswith("torch.distributed"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        with _restarts_said(nproc):
            run(get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}",
                                              f"--max-restarts={max_restarts}", "-m", "funcpar", *argv]))
    except ChildFailedError as e:
        if all(f.exitcode == INTERRUPTED for f in e.failures.values()):
            raise SystemExit(INTERRUPTED) from None  # rank 0 said where it saved and how to resume
        raise SystemExit(_failure_summary(e.failures, nproc) or 1) from None  # (1: every reason said already)
    except SignalException:  # Ctrl-C reached torchrun too: it passed SIGTERM on, and the workers saved
        raise SystemExit(INTERRUPTED) from None
    finally:
        os.environ.pop(LOGS_ENV, None)
    return True


@contextlib.contextmanager
def _restarts_said(world: int):
    """While torchrun runs the workers: when they have failed and torchrun is about to restart them, say why, one
    line per reason as at the end (torchrun's agent only logs it; its loggers are quiet). The agent's failure
    check is wrapped for the while (``LocalElasticAgent._monitor_workers``: torchrun's own API, not a public one;
    where it is missing the restarts go unexplained, as before)."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    except ImportError:
        yield
        return
    monitor = getattr(LocalElasticAgent, "_monitor_workers", None)
    if monitor is None:
        yield
        return

    def said(agent, group):
        result = monitor(agent, group)
        if result.is_failed() and getattr(agent, "_remaining_restarts", 0) > 0 and not _retried(result.failures):
            agent._remaining_restarts = 0  # (a restart would fail the same way: the job ends with its reason now)
        elif result.is_failed() and getattr(agent, "_remaining_restarts", 0) > 0:  # (torchrun restarts them next)
            lines = _failure_summary(result.failures, world)
            if lines:
                print(lines, file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = said
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = monitor


def _retried(failures: dict) -> bool:
    """Whether a restart may help: no failed rank said its failure would come again (``lifeline.report``'s
    ``retry=False``: a user error, such as a refused option or a NaN loss, fails the resumed run the same way)."""
    return not any(isinstance(f.error_file_data, dict) and f.error_file_data.get("retry") is False
                   for f in failures.values())


def restarted() -> int:
    """How many times torchrun has restarted this worker's group (0: the first attempt, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _failure_summary(failures: dict, world: int) -> str:
    """One line per distinct reason the failed ranks gave (deaths by signal first, then in time order), but for
    those a rank printed as it ended (``lifeline.report(printed=True)``) and, when another reason is there, those
    that follow from it: a rank that lost its peer (:data:`PEER_LOST`), one killed by SIGTERM (torchrun ends the
    other ranks so once one fails)."""
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
    causes = [r for r in reasons if not (PEER_LOST in r or r.endswith("was killed by SIGTERM"))]
    lines = []
    for reason, ranks in reasons.items():
        if reason in printed or causes and reason not in causes:
            continue
        who = "" if len(ranks) == world or f"rank {ranks[0]} " in reason else (
            f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))})")
        lines.append(reason + who)
    return "\n".join(lines)


def debug() -> bool:
    return os.environ.get("FUNCPAR_DEBUG") == "1"


USER_ERRORS = (ValueError, OSError, fp.MeshError, fp.CollectiveError)  # funcpar's own errors and the system's


def fail(message: str, code: int = 1, retry: bool = True) -> None:
    """End this process with ``message``: once per job (rank 0, or funcpar's launcher), never a traceback.
    ``retry``: False where a restart would fail the same way (:func:`funcpar.parallel.lifeline.report`)."""
    if "RANK" in os.environ:
        if os.environ.get("RANK") == "0" or os.environ.get(lifeline.LAUNCHER_ENV) == "1":
            lifeline.report(message, retry=retry)
        else:  # under a user's torchrun: only into torchrun's error file (rank 0 prints)
            lifeline.report(message, echo=False, retry=retry)
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
    that calls :func:`funcpar.cli.main.main` keeps its process. Another exception propagates as usual (a traceback), but
    in a rank of funcpar's launcher (``$FUNCPAR_LOGS``, not ``--debug``) its traceback is appended to the rank's
    log and the job's report gets one line (:func:`_logged`)."""
    code: object = 0
    try:
        command()
    except SystemExit as e:
        code = e.code
    except Exception as e:  # noqa: BLE001 - under funcpar's launcher: the traceback to the rank's log, one line out
        line = _logged(e)
        if line is None:
            raise
        try:
            fail(line)
        except SystemExit as stop:
            code = stop.code
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


def _logged(error: Exception) -> str | None:
    """In a rank of funcpar's launcher: append ``error``'s traceback to the rank's log (``$FUNCPAR_LOGS/rank-N.log``)
    and return the one line that reports it, naming the log; a lost connection to a peer (gloo's "Connection closed
    by peer" and the like) says :data:`PEER_LOST`, so that the report leaves it out beside the peer's own reason.
    None where there is no log to write (not under the launcher, ``--debug``, or a folder that cannot take it)."""
    folder, rank = os.environ.get(LOGS_ENV), os.environ.get("RANK")
    if not folder or rank is None or debug():
        return None
    from funcpar.io.atomic import open_own

    path = Path(folder) / f"rank-{rank}.log"
    try:
        if path.parent.is_symlink():
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        with open_own(path, "a") as fh:
            fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}, attempt {restarted()}, pid "
                     f"{os.getpid()}\n" + "".join(traceback.format_exception(error)))
    except OSError:
        return None
    first = next((x.strip() for x in str(error).splitlines() if x.strip()), "")
    what = f"{type(error).__name__}: {first}" if first else type(error).__name__
    if _peer_lost(error):
        return f"funcpar: rank {rank} ended: {PEER_LOST} ({what}); its traceback: {path}"
    return f"funcpar: rank {rank} failed: {what} (its traceback: {path})"


def _peer_lost(error: Exception) -> bool:
    """Whether ``error`` is this rank's side of a peer's failure: a lost connection in torch.distributed."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, getattr(dist, "DistNetworkError", ())) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", PEER_LOST))
