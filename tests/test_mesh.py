"""Mesh on real gloo worlds: rank layout read back from the process groups, world-size mismatch, and a rank that
dies or stalls mid-collective turning into an error on the others within the configured timeout."""

import os
import time

import pytest
import torch

import funcpar as fp
import harness
from funcpar.parallel import collectives as C


def _layout(sizes):
    import torch.distributed as dist

    m = harness.mesh(**sizes)
    from_groups = {a: dist.get_process_group_ranks(m.group(a)) for a in ("pp", "dp", "tp")}
    return m.rank, m.coords, from_groups, {a: m.group_ranks(a) for a in ("pp", "dp", "tp")}, m.timeout


def test_rank_layout_tp_innermost():
    tp_groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    dp_groups = [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank, coords, groups, listed, timeout in harness.run(8, _layout, {"tp": 4, "dp": 2}):
        assert coords == {"pp": 0, "dp": rank // 4, "tp": rank % 4}
        for g in (groups, listed):
            assert g["tp"] == next(x for x in tp_groups if rank in x)
            assert g["dp"] == next(x for x in dp_groups if rank in x)
            assert g["pp"] == [rank]
        assert timeout.total_seconds() == 60  # FUNCPAR_TIMEOUT, set by the harness, configures the default


def test_rank_layout_with_pipeline_axis():
    # Mesh(pp=2, dp=2, tp=2): rank = (p*dp + d)*tp + t
    for rank, coords, groups, _, _ in harness.run(8, _layout, {"pp": 2, "dp": 2, "tp": 2}):
        p, d, t = rank // 4, (rank // 2) % 2, rank % 2
        assert coords == {"pp": p, "dp": d, "tp": t}
        assert groups["pp"] == [d * 2 + t, 4 + d * 2 + t]
        assert groups["dp"] == [p * 4 + t, p * 4 + 2 + t]
        assert groups["tp"] == [p * 4 + d * 2, p * 4 + d * 2 + 1]


def _mismatch():
    out = []
    for sizes in ({"tp": 2}, {"tp": 4, "dp": 2}):
        try:
            fp.Mesh(**sizes)
        except fp.MeshError as e:
            out.append(str(e))
    local = fp.Mesh()  # a size-1 mesh is process-local, whatever the world
    out.append((local.size, local.coords))
    return out


def test_mesh_size_must_match_world():
    for errs in harness.run(4, _mismatch):
        assert errs[0] == (
            "Mesh(pp=1, dp=1, tp=2) has 2 ranks but the torch.distributed world has 4 processes: "
            "choose pp*dp*tp = 4 or launch with torchrun --nproc-per-node 2"
        )
        assert "Mesh(pp=1, dp=2, tp=4) has 8 ranks but the torch.distributed world has 4 processes" in errs[1]
        assert errs[2] == (1, {"pp": 0, "dp": 0, "tp": 0})


def _peer_fails(mode, timeout):
    m = fp.Mesh(tp=2, timeout=timeout)
    C.reduce_from_region(torch.ones(2), m, "tp")  # the group works
    if m.rank == 1:
        if mode == "exit":
            os._exit(7)
        time.sleep(timeout * 3)  # alive but stuck, e.g. in a long host-side computation
        return "stalled"
    t0 = time.monotonic()
    try:
        C.reduce_from_region(torch.ones(2), m, "tp")
    except C.CollectiveError as e:
        return time.monotonic() - t0, str(e)
    return "no error"


@pytest.mark.parametrize("mode", ["exit", "stall"])
def test_dead_or_stuck_rank_becomes_an_error_within_timeout(mode):
    timeout = 3.0
    pool = harness.Pool(2)
    try:
        results = pool.run(_peer_fails, mode, timeout, allow_death=True, timeout=60)
    finally:
        pool.close()
    assert isinstance(results[1], harness.Died) if mode == "exit" else results[1] == "stalled"
    elapsed, msg = results[0]
    assert elapsed < timeout + 5, elapsed
    assert "all_reduce(sum) over mesh axis 'tp' of Mesh(pp=1, dp=1, tp=2) (rank 0, group ranks [0, 1]) failed" in msg
    assert "a peer rank has died or stopped responding (timeout 3 s)" in msg


_EXIT_SCRIPT = """
import atexit, os, sys
import torch.distributed as dist

def threads():
    return len(os.listdir("/proc/self/task"))

def check():  # registered first, so it runs after funcpar's own exit handler
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}"), "w") as f:
        f.write(("destroyed" if not dist.is_initialized() else "still initialized") + f" {before} {threads()}")

atexit.register(check)
import funcpar as fp
import torch
before = threads()
mesh = fp.Mesh(dp=2)
step = fp.compile_step(lambda p, b: (p["w"] * b).sum(), {"w": fp.P()}, mesh=mesh)  # holders of the mesh
state, _ = step(step.init({"w": torch.ones(3)}), torch.ones(1, 3))
assert threads() > before  # gloo's worker threads
"""


def _torchrun(tmp_path, text: str, *args: str):
    """``text`` as a script under a fresh 2-rank ``torchrun`` (outside the test workers' world)."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(text)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # torchrun looks at its workers every 2 s (default 0.1 s): a survivor gets to report before it is torn down,
    # rather than race the launcher's SIGTERM on a loaded machine
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "--monitor-interval=2", str(script), *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.subprocess
def test_a_job_tears_its_process_groups_down_before_the_interpreter_exits(tmp_path):
    # left to interpreter finalization, gloo can abort a rank with SIGABRT (pytorch/pytorch#190489, issue 16)
    p = _torchrun(tmp_path, _EXIT_SCRIPT, str(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    for r in (0, 1):
        state, before, at_exit = (tmp_path / f"rank{r}").read_text().split()
        assert state == "destroyed"
        # every group (and its gloo threads) is gone before interpreter finalization, even with meshes still held
        assert int(at_exit) == int(before), (before, at_exit)


_ABORT_SCRIPT = """
import os, time
import funcpar as fp
import torch

def user_code_that_aborts():
    time.sleep(1.0)
    os.abort()  # as a C++ terminate in an extension would

mesh = fp.Mesh(dp=2, timeout=60)
fp.collectives.all_reduce(torch.ones(3), mesh, "dp")
if mesh.rank == 1:
    user_code_that_aborts()
fp.collectives.all_reduce(torch.ones(3), mesh, "dp")  # rank 0 waits here for the rank that died
"""


@pytest.mark.subprocess
def test_a_rank_that_aborts_leaves_its_python_stack_and_the_survivor_names_the_collective(tmp_path):
    # issue 16: an abort must not be silent; the dying rank says where it was, the others what they were waiting on
    p = _torchrun(tmp_path, _ABORT_SCRIPT)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "Fatal Python error: Aborted" in out and "in user_code_that_aborts" in out, out[-3000:]
    # rank 0 either saw the peer's socket close (a CollectiveError naming rank, axis and operation) or was stopped
    # by the launcher inside the collective (its stack, through funcpar's collective, from the SIGTERM)
    named = "all_reduce(sum) over mesh axis 'dp' of Mesh(pp=1, dp=2, tp=1) (rank 0" in out
    stopped = "Current thread" in out and "in _raw_all_reduce" in out
    assert named or stopped, out[-3000:]
