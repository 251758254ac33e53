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


# ------------------------------------------------------------------ start-up is a call; a mesh is a value


def test_an_abstract_mesh_is_a_sibling_of_mesh_not_one():
    from funcpar.parallel import p2p
    from funcpar.parallel.mesh import MeshBase

    abstract, local = fp.Mesh.abstract(tp=2), fp.Mesh()
    assert not isinstance(abstract, fp.Mesh) and isinstance(abstract, fp.AbstractMesh)
    assert isinstance(abstract, MeshBase) and isinstance(local, MeshBase)
    assert abstract.comm is p2p.SIMULATION and local.comm is p2p.WIRE  # the kind chooses the communication, once
    assert abstract.group("tp") is None and abstract.lane("tp", 1) is None  # no process group, no job joined
    assert repr(abstract.with_sequence_parallel()) == "Mesh(pp=1, dp=1, tp=2, sequence_parallel)"


def test_collectives_and_messages_on_an_abstract_mesh_go_through_its_simulation(monkeypatch):
    import torch.distributed as dist

    from funcpar.parallel import p2p, transport

    calls = []

    class Spy(type(fp.Mesh.abstract().comm)):
        def __getattribute__(self, name):
            if not name.startswith("_"):
                calls.append(name)
            return super().__getattribute__(name)

    for name in ("all_reduce", "all_to_all_single", "broadcast", "isend", "irecv", "batch_isend_irecv"):
        monkeypatch.setattr(dist, name, lambda *a, **k: pytest.fail("an abstract mesh called torch.distributed"))
    mesh = fp.Mesh.abstract(tp=2, pp=2)
    mesh.comm = Spy()
    with transport.recording() as log:
        assert torch.equal(C.reduce_from_region(torch.ones(4), mesh, "tp"), torch.full((4,), 2.0))  # every rank's 1
        assert torch.equal(C.all_gather(torch.arange(2.0), mesh, "tp"), torch.tensor([0.0, 1, 0, 1]))
        assert torch.equal(C.reduce_scatter(torch.ones(4), mesh, "tp"), torch.full((2,), 2.0))
        assert torch.equal(C.broadcast(torch.ones(2), mesh, "tp"), torch.ones(2))
        p2p.isend(torch.ones(3), mesh, "pp", 1, tag=0).wait()
        buf = torch.full((3,), 7.0)
        assert p2p.irecv(buf, mesh, "pp", 1, tag=0).wait() is buf and torch.equal(buf, torch.full((3,), 7.0))
    assert log == []  # nothing posted, nothing recorded
    assert calls == ["all_reduce", "all_gather", "reduce_scatter", "reduce_scatter_segments", "broadcast", "isend",
                     "irecv"]
    assert mesh.traffic == {"tp": 2 * 16 / 2 + 16 / 2 + 16 / 2, "pp": 2 * 12 / 2}  # counted as a ring sends


def test_starting_the_job_outside_one_is_refused(monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(fp.MeshError, match=r"init_distributed: this process is not part of a torch.distributed job "
                                           r"\(RANK/WORLD_SIZE are unset\)"):
        fp.init_distributed()
    with pytest.raises(fp.MeshError, match=r"Mesh\(pp=1, dp=2, tp=1\) needs 2 processes, but this process is not"):
        fp.Mesh(dp=2)
    assert not torch.distributed.is_initialized()


def _start_in_a_started_world():
    import torch.distributed as dist

    from funcpar.parallel import lifeline

    group = dist.distributed_c10d._get_default_group()
    fp.init_distributed()  # the program (here the harness) started the job: kept, the lifeline added
    watcher = lifeline._state["watcher"]
    fp.init_distributed()  # again: nothing new
    m = harness.mesh(dp=2)
    same = dist.distributed_c10d._get_default_group() is group and lifeline._state["watcher"] is watcher
    return same, watcher.is_alive(), C.all_reduce(torch.tensor([m.rank + 1.0]), m, "dp").item()


def test_the_start_up_call_keeps_a_job_the_program_started():
    for same, alive, total in harness.run(2, _start_in_a_started_world):
        assert same and alive and total == 3.0


_START_UP_SCRIPT = """
import atexit, json, os, sys
import torch
import torch.distributed as dist

def at_exit():  # registered first, so it runs after funcpar's own exit hook
    out["at exit"] = "destroyed" if not dist.is_initialized() else "still initialized"
    open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w").write(json.dumps(out))

atexit.register(at_exit)
import funcpar as fp
from funcpar.parallel import lifeline

out = {}
if sys.argv[2] == "call first":
    fp.init_distributed(heartbeat=7)
    out["started"], watcher = dist.is_initialized(), lifeline._state["watcher"]
    fp.init_distributed()
    mesh = fp.Mesh(dp=2)  # the job started already: joined, the heartbeat kept
    out["one lifeline"] = lifeline._state["watcher"] is watcher
else:
    mesh = fp.Mesh(dp=2, heartbeat=7)  # the one-liner: the mesh starts the job
    out["started"] = out["one lifeline"] = True
out["heartbeat"] = lifeline._state["watcher"].interval
out["sum"] = fp.collectives.all_reduce(torch.tensor([mesh.rank + 1.0]), mesh, "dp").item()
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["call first", "mesh alone"])
def test_a_job_starts_with_the_start_up_call_or_with_a_mesh_alone(tmp_path, how):
    import json

    p = _torchrun(tmp_path, _START_UP_SCRIPT, str(tmp_path), how)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in (0, 1):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == {
            "started": True, "one lifeline": True, "heartbeat": 7.0, "sum": 3.0, "at exit": "destroyed"}
