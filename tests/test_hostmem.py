"""compile_step on a CPU mesh keeps the memory a step frees (funcpar.train.hostmem): no page is faulted in again after
the first steps, where glibc's defaults fault in every large tensor every step; and it leaves malloc alone
wherever the environment or the caller chose otherwise."""

import json
import os
import subprocess
import sys

import pytest

import funcpar as fp
from funcpar.train import hostmem
from funcpar.state import StepError

# one process, a fresh interpreter per run (the setting is process-wide and made once): a 1-layer Llama whose
# logits (8 x 128 tokens x 8192 vocabulary, float32) are 32 MiB, above glibc's largest mmap threshold
_RUN = r"""
import json, resource, torch
import funcpar as fp
from funcpar.models import llama
torch.manual_seed(0)
cfg = llama.Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16)
model = fp.get_model("llama")
mesh = fp.Mesh()
step = fp.compile_step(model.loss_fn(cfg, mesh), model.specs(cfg, mesh), mesh=mesh, zero=0)
state = step.init(llama.init(cfg))
ids = torch.randint(0, 8192, (8, 128))
faults = []
for i in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    state, m = step(state, {"input_ids": ids})
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print("RESULT " + json.dumps({"host_malloc": step.host_malloc, "faults": faults, "loss": float(m["loss"])}))
"""


def _run(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "FUNCPAR_HOST"))}
    full.update(env, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _RUN], env=full, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.split("RESULT ", 1)[1])


@pytest.mark.subprocess
@pytest.mark.skipif(hostmem._glibc() is None, reason="glibc's malloc only (this C library is not glibc)")
def test_cpu_step_faults_no_page_in_after_warmup_and_system_malloc_does():
    kept, system = _run(), _run(FUNCPAR_HOST_MALLOC="system")
    assert kept["host_malloc"] == "kept"
    assert system["host_malloc"] == "FUNCPAR_HOST_MALLOC=system"
    assert kept["loss"] == system["loss"]  # the same arithmetic either way
    # a 32 MiB tensor is 8192 pages: glibc's defaults fault in at least the logits' every step (about 25,000 pages
    # a step here); kept, a step faults in nothing, but for the heap growing now and then by one block that did
    # not fit in its free space (measured: 0-3 pages, and 8,193 in one step of six)
    assert min(system["faults"][4:]) > 8192, system
    assert sum(kept["faults"][4:]) < sum(system["faults"][4:]) / 5, (kept, system)
    assert sorted(kept["faults"][4:])[3] < 64, kept  # most steps fault in no page at all


@pytest.mark.parametrize("env, reason", [
    ({"FUNCPAR_HOST_MALLOC": "system"}, "FUNCPAR_HOST_MALLOC=system"),
    ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "the environment sets MALLOC_TRIM_THRESHOLD_"),
    ({"MALLOC_MMAP_MAX_": "8", "MALLOC_TOP_PAD_": "0"}, "the environment sets MALLOC_MMAP_MAX_, MALLOC_TOP_PAD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES sets glibc.malloc options"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc is preloaded (LD_PRELOAD)"),
    ({"LD_PRELOAD": "/opt/libtcmalloc_minimal.so"}, "tcmalloc is preloaded (LD_PRELOAD)"),
])
def test_malloc_left_alone_where_the_environment_chose(monkeypatch, env, reason):
    for k in list(os.environ):
        if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD", "FUNCPAR_HOST_MALLOC"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(hostmem, "_done", None)
    monkeypatch.setattr(hostmem, "_glibc", lambda: pytest.fail("malloc configured against the environment"))
    assert hostmem.keep_freed_memory() == reason
    assert hostmem.keep_freed_memory() == reason  # said again, not retried


def test_not_glibc_is_said_and_refused_option_is_an_error(monkeypatch):
    for k in list(os.environ):
        if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD", "FUNCPAR_HOST_MALLOC"):
            monkeypatch.delenv(k)
    monkeypatch.setattr(hostmem, "_done", None)
    monkeypatch.setattr(hostmem, "_glibc", lambda: None)
    assert hostmem.keep_freed_memory() == "the C library is not glibc"
    with pytest.raises(StepError, match="host_malloc must be 'keep' or 'system', got 'always'"):
        fp.compile_step(lambda p, b: p["w"].sum(), {"w": fp.P()}, mesh=fp.Mesh(), host_malloc="always")


def test_system_and_non_cpu_meshes_leave_malloc_alone(monkeypatch):
    monkeypatch.setattr(hostmem, "keep_freed_memory", lambda: pytest.fail("malloc configured"))
    loss = lambda p, b: p["w"].sum()  # noqa: E731
    assert fp.compile_step(loss, {"w": fp.P()}, mesh=fp.Mesh(), host_malloc="system").host_malloc == "system"
    meta = fp.Mesh.abstract(device="meta", dp=2)
    assert fp.compile_step(loss, {"w": fp.P()}, mesh=meta).host_malloc == "system"
    # a step refused for another option has changed nothing process-wide
    with pytest.raises(StepError, match="zero must be 0, 1, 2 or 3"):
        fp.compile_step(loss, {"w": fp.P()}, mesh=fp.Mesh(), zero=7)
    with pytest.raises(StepError, match="zero=3 gathers the model block by block"):
        fp.compile_step(loss, {"w": fp.P()}, mesh=fp.Mesh(), zero=3)
