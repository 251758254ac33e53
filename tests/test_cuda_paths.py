"""The code paths only CUDA jobs take, driven on the CPU: ``torch.cuda`` stubbed (device count, ``set_device``), the
backend gloo. One GPU is all a test machine ever has, so a multi-rank CUDA start-up cannot run for real anywhere
here; these tests are what guards it (issue 40: every multi-process CUDA job died in ``Mesh._join_world``, now ``mesh._start_world``)."""

import os
import subprocess
import sys

import pytest
import torch

import funcpar as fp
from funcpar.parallel.mesh import resolve_device


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: this process sees ``n`` CUDA devices (0: none); ``set_device`` calls are recorded."""
    calls = []

    def see(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(str(torch.device(d))))
        return calls

    return see


def _env(monkeypatch, rank, local_rank, local_world):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_a_rank_takes_the_gpu_of_its_local_rank_not_its_global_rank(gpus, monkeypatch):
    gpus(4)
    _env(monkeypatch, rank=5, local_rank=1, local_world=4)  # a two-node job's rank 5 on 4-GPU nodes
    assert resolve_device("cuda") == (torch.device("cuda", 1), None)
    assert resolve_device("auto") == (torch.device("cuda", 1), None)
    assert resolve_device(None) == (torch.device("cuda", 1), None)
    assert resolve_device("cuda:3") == (torch.device("cuda", 3), None)
    assert resolve_device("cpu") == (torch.device("cpu"), None)


def test_more_ranks_than_gpus_on_a_node_is_refused_in_one_line_naming_both_numbers(gpus, monkeypatch):
    gpus(1)
    _env(monkeypatch, rank=3, local_rank=3, local_world=4)
    with pytest.raises(fp.MeshError) as e:
        resolve_device("cuda")
    msg = str(e.value)
    assert "\n" not in msg
    assert "4 ranks on this node but 1 GPU visible" in msg
    assert "--nproc-per-node 1" in msg and "--device cpu" in msg
    # auto takes the CPU instead, and says why
    device, why = resolve_device("auto")
    assert device == torch.device("cpu") and why == msg
    with pytest.raises(fp.MeshError, match="only 1 GPU visible: use cuda:0 .. cuda:0"):
        resolve_device("cuda:2")


def test_cuda_without_a_gpu_and_unknown_devices_are_refused(gpus, monkeypatch):
    gpus(0)
    _env(monkeypatch, rank=0, local_rank=0, local_world=1)
    with pytest.raises(fp.MeshError, match="'cuda' asked for, but no GPU is visible"):
        resolve_device("cuda")
    assert resolve_device("auto") == (torch.device("cpu"), None)  # no GPU at all: nothing to warn about
    with pytest.raises(fp.MeshError, match="unknown device 'gpu'"):
        resolve_device("gpu")


def test_a_mesh_refuses_too_few_gpus_before_starting_the_job(gpus, monkeypatch):
    gpus(1)
    _env(monkeypatch, rank=1, local_rank=1, local_world=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(fp.MeshError, match="2 ranks on this node but 1 GPU visible"):
        fp.Mesh(dp=2, device="cuda")  # before any process group: nothing to wait for
    assert not torch.distributed.is_initialized()


_START_SCRIPT = """
import json, os, sys
import torch
calls = []
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 2
torch.cuda.set_device = lambda d: calls.append(str(torch.device(d)))
import funcpar as fp
import torch.distributed as dist

mesh = fp.Mesh(dp=2, device=sys.argv[2] if sys.argv[2] != "default" else None, backend="gloo", heartbeat=0)
t = torch.tensor([float(mesh.rank + 1)])
t = fp.collectives.all_reduce(t, mesh, "dp")
out = {"rank": mesh.rank, "device": str(mesh.device), "set_device": calls, "backend": dist.get_backend(),
       "sum": t.item()}
open(os.path.join(sys.argv[1], f"rank{mesh.rank}.json"), "w").write(json.dumps(out))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("device", ["default", "cuda"])
def test_a_multi_rank_mesh_on_cuda_starts_its_job(tmp_path, device):
    # issue 40: `import torch._dynamo` inside _join_world (now _start_world) made `torch` local there; set_device raised
    # UnboundLocalError on every rank of every multi-process CUDA job, before the first collective
    script = tmp_path / "start.py"
    script.write_text(_START_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script), str(tmp_path), device], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    import json

    for r in (0, 1):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert out == {"rank": r, "device": f"cuda:{r}", "set_device": [f"cuda:{r}"], "backend": "gloo",
                       "sum": 3.0}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLI_WITH_GPUS = """
import sys, torch
n = int(sys.argv[1])
torch.cuda.is_available = lambda: n > 0
torch.cuda.device_count = lambda: n
from funcpar.cli.main import entry
sys.argv = ["funcpar", *sys.argv[2:]]
entry()
"""


def _cli(gpus, *args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                           "CUDA_VISIBLE_DEVICES")}
    return subprocess.run([sys.executable, "-c", _CLI_WITH_GPUS, str(gpus), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.subprocess
@pytest.mark.parametrize("gpus", [0, 1])
def test_train_on_cuda_with_fewer_gpus_than_ranks_prints_one_line_before_starting_any(gpus, tmp_path):
    p = _cli(gpus, "train", "--mesh", "tp=2,dp=2", "--device", "cuda", "--out", str(tmp_path / "out"))
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and p.stdout == "", p.stderr
    if gpus:
        assert lines[0].startswith("funcpar: 4 ranks on this node but 1 GPU visible"), lines
        assert "--mesh 1" in lines[0] and "--device cpu" in lines[0]
    else:
        assert lines[0].startswith("funcpar: device 'cuda' asked for, but no GPU is visible"), lines
    assert not (tmp_path / "out").exists()  # no rank started, nothing written


@pytest.mark.subprocess
def test_device_option_is_checked_and_plan_takes_it(capsys):
    p = _cli(0, "train", "--device", "gpu")
    assert p.returncode != 0 and "funcpar: --device 'gpu'" in p.stderr and "auto, cpu, cuda" in p.stderr
    from funcpar.cli import main as cli

    # a plan for cuda needs no GPU here (issue 57): meta tensors stand for the GPU's, and no host process is added
    p = _cli(0, "plan", "--mesh", "dp=2", "--model", "llama-micro", "--device", "cuda")
    traced = [x for x in p.stdout.splitlines() if x.startswith("traced step")]
    assert p.returncode == 0 and len(traced) == 1 and "+ runtime" not in traced[0], p.stdout + p.stderr
    cli.main(["plan", "--mesh", "dp=2", "--model", "llama-micro", "--device", "cpu"])
    assert "+ runtime" in capsys.readouterr().out  # the host's resident set is added on the CPU


def test_the_plan_of_a_step_auto_compiles_says_its_peak_is_the_eager_traces(capsys):
    # compile="auto" compiles the gradient on a CUDA mesh of data axes only, where inductor plans the buffers: the
    # plan traces the eager gradient and says that its figure is the eager step's (docs/GPU.md: how far apart)
    from funcpar.cli import planning
    from funcpar.cli.options import BUILTIN_MODELS, DEFAULTS, build_step

    model = fp.get_model("llama")
    mesh = fp.Mesh.abstract(device="cpu", dp=2)
    cfg = model.config(BUILTIN_MODELS["llama-micro"]).with_mesh(mesh)
    plain = build_step(dict(DEFAULTS), model, cfg, mesh, model.specs(cfg, mesh))
    auto = build_step(dict(DEFAULTS), model, cfg, mesh, model.specs(cfg, mesh))
    auto.mode.gradient.compiled = "auto"  # what resolve_compile gives on a CUDA mesh of data axes only
    t_plain = planning.trace_plan(model, cfg, plain, 4, 32)
    t_auto = planning.trace_plan(model, cfg, auto, 4, 32)
    assert not t_plain["eager_trace"] and t_auto["eager_trace"] and auto.compiled == "auto"  # (left as it was)
    assert t_auto["peak"] == t_plain["peak"]  # the eager step's trace
    planning.print_plan(model, cfg, auto, 1, "adamw", 4, 32)
    line = capsys.readouterr().out.splitlines()[-1]
    assert f"peak {t_auto['peak'] / 2**20:,.1f} MiB" in line and "the eager step's trace: compile='auto'" in line


@pytest.mark.subprocess
def test_auto_runs_the_ranks_on_the_cpu_beside_too_few_gpus_and_says_why(tmp_path):
    # one GPU, the README's 4-rank main job: auto takes the CPU for every rank (the same run), with one warning
    out = tmp_path / "out"
    p = _cli(1, "train", "--model", "llama-micro", "--mesh", "dp=2", "--global-batch", "4", "--seq-len", "16",
             "--steps", "2", "--eval-every", "0", "--out", str(out), timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    warned = [line for line in p.stdout.splitlines() if "the ranks run on the CPU" in line]
    assert len(warned) == 1 and "2 ranks on this node but 1 GPU visible" in warned[0], p.stdout
    assert "(2 process(es), cpu)" in p.stdout
    assert (out / "hf" / "config.json").exists()


class _Work:
    def __init__(self):
        self.calls = []

    def wait(self, **kw):
        self.calls.append(kw)
        return True


def test_a_cuda_mesh_waits_on_the_stream_and_a_host_mesh_with_its_timeout():
    # NCCL's work.wait(timeout=) blocks the host until the collective ends (no kernels queued meanwhile); a CUDA
    # mesh leaves the bound to the process group's own timeout (NCCL's watchdog)
    from funcpar.parallel import mesh as mesh_module, transport

    for device, expected in (("cuda", {}), ("cpu", {"timeout": mesh_module.default_timeout()})):
        work = _Work()
        transport.wait(work, fp.Mesh.abstract(device=device, dp=2), "all_reduce", "dp")
        assert work.calls == [expected], device
