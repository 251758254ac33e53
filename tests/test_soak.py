"""The fault-injection soak (issues 12 and 46): ``funcpar train --max-restarts 3`` at ``Mesh(tp=2, dp=2)`` for 40
steps, a random rank killed (SIGKILL) at a random moment twice; torchrun restarts the ranks, they resume from the
run's last checkpoint by themselves, the job exits 0, and the final parameters equal the uninterrupted run's bit for
bit. The seed is random per run and printed on failure (``FUNCPAR_SOAK_SEED`` fixes it); the time from each kill to
the first step logged after it is printed (a figure, not an assertion)."""

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

from jobs import Job, children, rank_of

pytestmark = [pytest.mark.soak, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40  # (two kills among them, four checkpoints; short enough for the suite's time on a slow day)
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


def _next_step(job: Job, at_least: int) -> tuple[int, float]:
    """The first logged step at or past ``at_least`` (a resumed run repeats the steps since its checkpoint), and
    when it came."""
    while True:
        t = job.wait_for("step ", timeout=300)
        step = _step_of(job.seen[-1])
        if step is not None and step >= at_least:
            return step, t


def test_a_run_that_loses_a_rank_twice_restarts_resumes_and_ends_bit_equal_by_itself(tmp_path):
    seed = int(os.environ.get("FUNCPAR_SOAK_SEED", random.randrange(2**31)))
    rng = random.Random(seed)
    where = f"(FUNCPAR_SOAK_SEED={seed})"
    ref = _train(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    kills = sorted(rng.sample(range(2, STEPS - 5), 2))
    job = Job(tmp_path, "--model", "llama-micro", *ARGS, "--max-restarts", "3")  # writes to tmp_path / "out"
    events, recoveries = [], []
    try:
        for k in kills:
            step, _ = _next_step(job, k)
            time.sleep(rng.uniform(0.0, 0.3))  # anywhere in the step or the save after it
            workers = {rank_of(p): p for p in children(job.proc.pid)}
            victim = rng.choice(sorted(workers))
            os.kill(workers[victim], signal.SIGKILL)
            killed = time.monotonic()
            events.append(f"killed rank {victim} after step {step}")
            job.wait_for("resuming", timeout=300)
            _, back = _next_step(job, 0)
            recoveries.append(back - killed)
        code = job.proc.wait(timeout=600)
    finally:
        job.kill_all()
    assert code == 0, f"{where} {events}\n" + "\n".join(job.seen[-30:])
    assert sum("restart" in line and "resuming" in line for line in job.seen) == 2, f"{where} {events}"
    want, got = load_file(tmp_path / "ref" / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "hf" /
                                                                                     "model.safetensors")
    assert want.keys() == got.keys()
    unequal = [k for k in want if not torch.equal(want[k], got[k])]
    assert unequal == [], f"{where} {events}: {unequal}"
    print(where, *events, "seconds from each kill to the first step after it: "
          + ", ".join(f"{s:.1f}" for s in recoveries), sep="\n")


def test_an_elastic_restart_on_fewer_ranks_resumes_on_a_smaller_dp_mesh(tmp_path):
    """`--mesh tp=2,dp=auto` under torchrun: dp is the world size over tp. A job of 4 ranks (dp=2) saved at step 4
    and went on; its group restarts with 2 ranks (an elastic `--nnodes 1:2` job that lost a node: the workers see
    WORLD_SIZE=2 and TORCHELASTIC_RESTART_COUNT=1, as torchrun gives them), which resume from step 4 by themselves
    on dp=1 and finish with the losses of the 4-rank run (the same global batches; the sums only reordered)."""
    import json
    import shutil
    import socket

    ref = _train(tmp_path / "ref", "--steps", "6", "--save-every", "2", "--keep", "3")
    assert ref.returncode == 0, ref.stderr
    shutil.copytree(tmp_path / "ref", tmp_path / "out")
    (tmp_path / "out" / "checkpoints" / "latest").write_text("step-4\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_RESTART_COUNT": "1"}
    cmd = [sys.executable, "-m", "funcpar", "train", "--model", "llama-micro", *ARGS, "--steps", "6", "--save-every",
           "2", "--keep", "3", "--mesh", "tp=2,dp=auto", "--out", str(tmp_path / "out")]
    ranks = [subprocess.Popen(cmd, cwd=tmp_path, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs[0][1][-2000:]
    said = outs[0][0]
    assert "a rank failed; torchrun restarted the ranks (restart 1): resuming" in said
    assert "resumed from" in said and "at step 4" in said
    assert "Mesh(pp=1, dp=1, tp=2) (2 process(es)" in said
    rows, want = ({r["step"]: r["loss"] for r in map(json.loads, (tmp_path / o / "metrics.jsonl").read_text()
                                                     .splitlines())} for o in ("out", "ref"))
    assert sorted(rows) == list(range(1, 7))
    assert all(abs(rows[s] - want[s]) <= 1e-5 * want[s] for s in (5, 6)), (rows, want)
