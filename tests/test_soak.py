"""Issue 12's fault-injection soak: ``funcpar train`` at ``Mesh(tp=2, dp=2)`` for 100 steps, a random rank killed
(SIGKILL) at a random moment three times and resumed each time with ``--resume``; the final parameters equal the
uninterrupted run's bit for bit. The seed is random per run and printed on failure (``FUNCPAR_SOAK_SEED`` fixes it)."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_lifeline import _Job, _children, _rank_of

pytestmark = [pytest.mark.soak, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 100  # (three kills among them; 100 keeps the suite within its time on a slow day)
ARGS = ["--mesh", "tp=2,dp=2", "--steps", str(STEPS), "--global-batch", "8", "--seq-len", "32", "--warmup", "10",
        "--save-every", "10", "--keep", "2", "--eval-every", "0", "--log-every", "1"]


def _train(out: Path, *extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "funcpar", "train", "--model", "llama-micro", *ARGS, "--out",
                           str(out), *extra], cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)


def _step_of(line: str) -> int | None:
    if line.startswith("step ") and "/" in line:
        return int(line.split("/")[0].split()[-1])
    return None


def test_a_run_killed_three_times_and_resumed_ends_bit_equal_to_the_uninterrupted_run(tmp_path):
    seed = int(os.environ.get("FUNCPAR_SOAK_SEED", random.randrange(2**31)))
    rng = random.Random(seed)
    where = f"(FUNCPAR_SOAK_SEED={seed})"
    ref = _train(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    kills = sorted(rng.sample(range(2, STEPS), 3))
    events = []
    for k in kills:
        job = _Job(tmp_path, *ARGS, "--resume")  # writes to tmp_path / "out"
        try:
            while True:  # the first step at or past k (a resumed run repeats the steps since its checkpoint)
                job.wait_for("step ", timeout=300)
                step = _step_of(job.seen[-1])
                if step is not None and step >= k:
                    break
            time.sleep(rng.uniform(0.0, 0.3))  # anywhere in the step or the save after it
            workers = {_rank_of(p): p for p in _children(job.proc.pid)}
            victim = rng.choice(sorted(workers))
            os.kill(workers[victim], signal.SIGKILL)
            code = job.proc.wait(timeout=120)
            events.append(f"killed rank {victim} after step {step}: exit {code}")
            assert code != 0, f"{where} {events}"
        finally:
            job.kill_all()
    last = _train(tmp_path / "out", "--resume")
    assert last.returncode == 0, f"{where} {events}\n{last.stderr}"
    assert "resumed from" in last.stdout, f"{where} {events}"
    want, got = load_file(tmp_path / "ref" / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "hf" /
                                                                                     "model.safetensors")
    assert want.keys() == got.keys()
    unequal = [k for k in want if not torch.equal(want[k], got[k])]
    assert unequal == [], f"{where} {events}: {unequal}"
    print(where, *events, sep="\n")
