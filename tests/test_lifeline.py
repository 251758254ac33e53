"""Issue 12, class 5: processes do not outlive their job, a stopped rank is reported within the heartbeat interval,
errors before a barrier reach every rank, and the command line prints one line per reason, once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import ROOT, TRAIN, Job

pytestmark = pytest.mark.subprocess


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_killing_the_launcher_ends_every_worker_within_10_s(tmp_path):
    job = Job(tmp_path, "--mesh", "dp=2", "--steps", "100000", "--log-every", "1")
    try:
        job.wait_for("step     1/", timeout=120)
        workers = job.workers()
        assert sorted(workers) == [0, 1]
        os.kill(job.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while any(_alive(p) for p in workers.values()) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers.values()), "workers outlived their launcher by 10 s"
    finally:
        job.kill_all()


def test_a_stopped_rank_is_reported_within_the_heartbeat_interval(tmp_path):
    job = Job(tmp_path, "--mesh", "dp=2", "--steps", "100000", "--log-every", "1", "--heartbeat", "3")
    try:
        job.wait_for("step     2/", timeout=120)
        stopped = job.workers()[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        t = job.wait_for("has made no progress", timeout=30)
        assert t - t0 <= 3 + 2, f"reported after {t - t0:.1f} s"
        line = job.seen[-1]
        assert line.startswith(f"funcpar: rank 1 ({os.uname().nodename} pid {stopped}) has made no progress for ")
        assert line.endswith("rank 0 ends the job rather than wait out the collective timeout (heartbeat interval "
                             "3 s: Mesh(heartbeat=...), $FUNCPAR_HEARTBEAT or --heartbeat; 0 turns it off)")
        os.kill(stopped, signal.SIGKILL)  # torchrun would only after its 30 s grace period
        assert job.proc.wait(timeout=60) == 1
        with pytest.raises(AssertionError):
            job.wait_for("(the end of the output)", timeout=5)
        assert sum("has made no progress" in x for x in job.seen) == 1, job.seen  # said once, not again at the end
    finally:
        job.kill_all()


def _run(tmp_path, *args, timeout=180):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    p = subprocess.run([*TRAIN, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def _snapshot(root):
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mesh, setup, args, message", [
    ("tp=2,dp=2", lambda d: (d / "bad.jsonl").write_text('{"text": "a"}\n{"text": oops}\n'),
     ["--data", "bad.jsonl", "--out", "out"], "funcpar: bad.jsonl:2: not valid JSON (Expecting value at column 10)"),
    ("dp=2", lambda d: (d / "afile").write_text("x"), ["--out", "afile/out"],
     "funcpar: cannot prepare the run folder afile/out: [Errno 20] Not a directory: 'afile/out'"),
    ("dp=2", lambda d: None, ["--data", "missing.jsonl", "--out", "out"],
     "funcpar: data file missing.jsonl does not exist"),
])
def test_a_user_error_in_a_multi_rank_run_is_one_line_printed_once(tmp_path, mesh, setup, args, message):
    """Every rank fails alike (or rank 0 fails before a barrier and the others hear why): one line, at once."""
    setup(tmp_path)
    before = _snapshot(tmp_path)
    p, took = _run(tmp_path, "--mesh", mesh, "--steps", "3", *args)
    assert p.returncode == 1
    assert p.stderr == message + "\n" and p.stdout == ""
    assert took < 60  # not the 600 s collective timeout
    assert _snapshot(tmp_path) == before


def test_debug_shows_the_traceback(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": oops}\n')
    p, _ = _run(tmp_path, "--mesh", "1", "--steps", "1", "--data", "bad.jsonl", "--out", "out", "--debug")
    assert p.returncode == 1 and "Traceback (most recent call last)" in p.stderr
    assert "funcpar.data.DataError: bad.jsonl:1: not valid JSON" in p.stderr


_ENDING = """
import atexit, sys, threading, time
from funcpar.cli.launch import run_and_exit
atexit.register(lambda: print("atexit handler ran"))  # (stdout is a pipe: block-buffered, flushed at the end)
def late():
    time.sleep(0.3)
    print("non-daemon thread finished")
def command():
    threading.Thread(target=late).start()
    print("command ran")
    {end}
run_and_exit(command)
print("not reached")
"""


@pytest.mark.parametrize("end, code, err", [
    ("pass", 0, ""), ("raise SystemExit(3)", 3, ""), ("raise SystemExit('funcpar: a reason')", 1, "funcpar: a reason\n"),
])
def test_the_command_line_ends_as_python_would_without_its_teardown(end, code, err):
    """`python -m funcpar` skips the interpreter's finalization (about 1 s a process after torch), and nothing else:
    non-daemon threads are joined, atexit handlers run, buffered output is flushed, the status and message kept."""
    p = subprocess.run([sys.executable, "-c", _ENDING.format(end=end)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert (p.returncode, p.stderr) == (code, err)
    assert p.stdout == "command ran\nnon-daemon thread finished\natexit handler ran\n"


def test_an_exception_in_the_command_line_is_python_s_own_traceback():
    p = subprocess.run([sys.executable, "-c", _ENDING.format(end="raise RuntimeError('boom')")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.rstrip().endswith("RuntimeError: boom")
    assert "atexit handler ran" in p.stdout and "not reached" not in p.stdout


def test_the_error_file_is_whole_or_absent_when_its_writer_dies_mid_write(tmp_path, monkeypatch):
    """torchrun's agent parses every failed worker's error file and ends the whole job, restarts unspent, on one it
    cannot parse (the soak saw "Expecting value: line 1 column 1"): a worker killed while writing it must leave no
    part-written file. report() writes beside it and renames; a write that dies part-way leaves the old file."""
    import json

    from funcpar.parallel import lifeline

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    lifeline.report("first", echo=False)
    assert json.loads(error_file.read_text())["message"] == "first"

    def dies(obj, fh):  # (a kill mid-write: part of the JSON out, then the writer is gone)
        fh.write('{"message": ')
        fh.flush()
        raise OSError("killed")

    monkeypatch.setattr(lifeline.json, "dump", dies)
    lifeline.report("second", echo=False)
    assert json.loads(error_file.read_text())["message"] == "first"
