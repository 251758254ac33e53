"""``funcpar train`` as a background job for the tests that watch its processes (tests/test_lifeline.py,
test_soak.py, test_cli_run.py): its output line by line with the time each line came, its workers by rank.

Linux only: processes are found through /proc.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "funcpar", "train", "--model", "llama-micro", "--eval-every", "0", "--save-every", "0"]


def children(pid: int) -> list[int]:
    """The ids of the processes whose parent is ``pid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def rank_of(pid: int) -> int:
    """The ``RANK`` in the environment of process ``pid``."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=")[1])


class Job:
    """``funcpar train`` in the background, its merged output read line by line with the time each line came."""

    def __init__(self, tmp_path, *args):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([*TRAIN, "--out", str(tmp_path / "out"), *args], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line.rstrip("\n")))
        self.lines.put((time.monotonic(), None))

    def wait_for(self, text: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                t, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if text in line:
                return t
        raise AssertionError(f"no line with {text!r} within {timeout} s; output:\n" + "\n".join(self.seen))

    def workers(self) -> dict[int, int]:
        return {rank_of(pid): pid for pid in children(self.proc.pid)}

    def kill_all(self):
        for pid in [*children(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
