"""benchmarks/: the runner's parsing, table, equal-work check and plot on made-up worker outputs (no processes)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import common as C  # noqa: E402
from benchmarks import report  # noqa: E402


DP_BYTES = C.analytic_traffic(C.SIZES["small"], "dp2")["dp"]["bytes"]


def _out(mesh, impl, times, losses, rss):
    noise = "[INFO] deepspeed says hello\n" if impl.startswith("ds") else ""
    payload = {"mesh": mesh, "impl": impl, "size": "small", "times": times, "losses": losses, "rss_mb": rss}
    if impl == "funcpar" and mesh == "dp2":  # rank 1 sent a little more
        payload["traffic"] = [{"dp": DP_BYTES}, {"dp": DP_BYTES * 1.001}]
    return noise + "RESULT " + json.dumps(payload) + "\n"


def _records():
    recs = []
    for rep in range(2):
        recs += [
            report.parse_job(_out("dp2", "funcpar", [1.0, 1.2, 1.1], [8.30000, 8.10000, 7.9], [900, 950]), "", 0,
                             mesh="dp2", impl="funcpar", size="small"),
            report.parse_job(_out("dp2", "ds-zero1", [2.0, 2.2], [8.30001, 8.10001, 7.9], [1200, 1100]), "", 0,
                             mesh="dp2", impl="ds-zero1", size="small"),
            report.parse_job(_out("dp2", "torch-fsdp2", [1.5, 1.5], [8.30000, 8.20000, 7.9], [1000, 1000]), "", 0,
                             mesh="dp2", impl="torch-fsdp2", size="small"),
            report.parse_job("ERROR " + json.dumps({"rank": 1, "error": "RuntimeError: gloo does not do that"}), "x",
                             1, mesh="dp2", impl="ds-zero2", size="small"),
        ]
    recs.append({"mesh": "tp2", "impl": "ds-autotp", "size": "small", "missing": "deepspeed is not installed"})
    recs.append(report.parse_job(_out("tp2", "funcpar", [0.5], [8.3, 8.1], [700, 710]), "", 0,
                                 mesh="tp2", impl="funcpar", size="small"))
    recs.append(report.parse_job("", "Traceback\nValueError: torch TP broke\nmore", 1, mesh="tp2", impl="torch-tp",
                                 size="small"))
    return recs


def test_parse_job_takes_the_result_line_or_one_line_of_why():
    rec = report.parse_job("noise\nRESULT " + json.dumps({"times": [1.0], "losses": [2.0], "rss_mb": [3]}), "", 0,
                           mesh="1", impl="funcpar", size="small")
    assert rec["times"] == [1.0] and rec["mesh"] == "1" and "error" not in rec
    bad = report.parse_job("", "Traceback\n  File x\nValueError: no\n", 1, mesh="1", impl="hf-eager", size="small")
    assert bad["error"] == "exit 1: ValueError: no"


def test_table_ratios_mfu_memory_and_the_equal_work_check():
    flops = C.flops_per_step(C.SIZES["small"])
    rows = report.summarize(_records(), "small", flops, peak_flops=flops / 0.5, tol=1e-4)
    by = {(r["mesh"], r["impl"]): r for r in rows}
    fp_, ds, fsdp = by["dp2", "funcpar"], by["dp2", "ds-zero1"], by["dp2", "torch-fsdp2"]
    assert fp_["s_per_step"] == pytest.approx(1.1) and ds["s_per_step"] == pytest.approx(2.1)
    assert ds["ratio"] == pytest.approx(2.1 / 1.1)
    assert fp_["funcpar_over_best"] == pytest.approx(1.1 / 1.5) and fp_["best_peer"] == C.IMPLS["torch-fsdp2"]
    assert fp_["mfu"] == pytest.approx(0.5 / 1.1)
    assert ds["rss_mb"] == 1200 and fp_["rss_mb"] == 950
    assert ds["agree"] is True  # 1.2e-6 relative
    assert fsdp["agree"] is False  # the second loss differs by 1.2%
    assert by["dp2", "ds-zero2"]["status"] == "failed" and by["tp2", "ds-autotp"]["status"] == "missing"

    text = report.table(rows, 1e-4)
    lines = {ln.split(" | ")[1]: ln for ln in text.splitlines()[2:]}
    assert "| 1.100 (1.100-1.100) | 1.00 (funcpar/best peer 0.73) | 45.5% | 950 |" in lines["funcpar Mesh(dp=2) zero=1"]
    assert "| 2.100 (2.100-2.100) | 1.91 |" in lines["DeepSpeed ZeRO-1"] and "yes (1.2e-06)" in lines["DeepSpeed ZeRO-1"]
    assert "**NO** (1.2e-02 > 1e-04)" in lines["torch FSDP2 (fully_shard)"]
    assert "FAILED: RuntimeError: gloo does not do that" in lines["DeepSpeed ZeRO-2"]
    assert "not run: deepspeed is not installed" in lines["DeepSpeed AutoTP"]
    assert "FAILED: exit 1: ValueError: torch TP broke" in lines["torch TP (parallelize_module)"]
    assert "| Mesh(dp=2) | 1.100 | torch FSDP2 (fully_shard) | 1.500 | 0.73 |" in report.summary(rows)
    assert "(no peer ran)" in report.summary(rows)


def test_the_mfu_target_line_states_the_verdict_and_the_peak_readings():
    """The issue's MFU target (dp=2, small, fp32) gets a verdict line over the peak used, the per-job range, and the
    same step over the lowest peak reading where the machine's rate moved; other sizes and bf16 get none."""
    flops = C.flops_per_step(C.SIZES["small"])
    rows = report.summarize(_records(), "small", flops, peak_flops=flops / 0.5, tol=1e-4)  # funcpar dp2: 1.1 s
    met = report.mfu_targets(rows, "small", flops, [flops / 0.5])
    assert met == [f"- MFU target, funcpar Mesh(dp=2): 45.5% of the peak used ({flops / 0.5 / 1e9:.1f} GFLOP/s), "
                   "target >= 65% not met; the per-job medians 45.5%-45.5%."]
    fast = [dict(r, mfu=0.7) for r in rows]
    two = report.mfu_targets(fast, "small", flops, [flops / 0.5, flops / 0.6])
    assert "70.0% of the peak used" in two[0] and "target >= 65% met" in two[0]
    assert f"over the lowest peak reading ({flops / 0.6 / 1e9:.1f} GFLOP/s, 17% below" in two[0]
    assert two[0].endswith(f" {0.6 / 1.1:.1%}.")  # the timed median over the lower reading
    assert report.mfu_targets(rows, "large", flops, [flops]) == []
    assert report.mfu_targets(rows, "small", flops, [flops], precision="bf16") == []


def test_document_plot_and_traffic(tmp_path):
    flops = C.flops_per_step(C.SIZES["small"])
    rows = report.summarize(_records(), "small", flops, peak_flops=1e11, tol=1e-4)
    planned = {"dp2": report.parse_plan("traced step, ...; peak 1 MiB per rank; sends dp 119.9 MiB per step"),
               "tp2": report.parse_plan("garbage")}
    assert planned["dp2"] == {"dp": pytest.approx(119.9 * 2**20)}
    meta = {"command": "python benchmarks/run.py", "date": "today", "wall_s": 60, "peak_threads": 2, "peak_n": 2048,
            "peak_seconds": 3, "peak_flops": 1e11, "warmup": 2, "steps": 4, "repeats": 2,
            "machine": {"cpu": "a CPU", "cores": 2, "memory_gib": 8.0}, "versions": {"torch": "2"},
            "missing": ["DeepSpeed AutoTP (deepspeed is not installed)"], "notes": ["a note"]}
    doc = report.document(meta, {"small": {"rows": rows, "planned": planned}}, 1e-4)
    assert "100.0 GFLOP/s" in doc and "a CPU, 2 cores" in doc and "**NO**" in doc and "- a note" in doc
    assert f"| Mesh(dp=2) | dp | {C.fmt_bytes(DP_BYTES)} |" in doc
    assert f"| 119.9 MiB | {C.fmt_bytes(DP_BYTES * 1.001)} (1.0010x analytic) |" in doc
    assert "| Mesh(tp=2) | tp |" in doc and "(no 'sends ... per step' line)" in doc
    path = tmp_path / "r.png"
    report.plot(rows, str(path))
    assert path.stat().st_size > 1000


def test_analytic_traffic_counts():
    s = C.SIZES["small"]
    t = C.analytic_traffic(s, "tp2dp2")
    act = 4 * 256 * 512 * 4  # b (8 rows / dp 2) x s x h, fp32
    assert t["tp"]["bytes"] == (4 * 4 + 2) * act * 2 * 1 / 2
    p = C.param_count(s)
    assert t["dp"]["bytes"] == pytest.approx(2 * (p["sharded"] / 2 + p["norms"]) * 4 / 2)
    assert C.analytic_traffic(s, "1") == {}


def test_profile_tables_split_the_step_and_state_the_compute_floor():
    flops = C.flops_per_step(C.SIZES["small"])
    rows = report.summarize(_records(), "small", flops, peak_flops=1e11, tol=1e-4)  # dp2: funcpar 1.1, best 1.5
    phases = {"forward+backward": {"wall_ms": 800, "matmul": 600, "attention": 100, "other ops": 90, "python": 10},
              "reduce": {"wall_ms": 150, "collectives": 150}, "optimizer": {"wall_ms": 50, "other ops": 50}}
    prof = [{"mesh": "dp2", "impl": "funcpar", "size": "small", "step_ms": 1000, "phases": phases},
            {"mesh": "tp2", "impl": "funcpar", "error": "exit 1: boom"}]
    text = report.profile_tables(prof, rows)
    assert "| Mesh(dp=2) | funcpar Mesh(dp=2) zero=1 | 1000 | 800 | 150 | 50 |" in text
    # the whole step by kind; compute 70% of it: 0.7 * 1.1 / 1.5 = 0.51
    assert "| 600 (60%) | 100 (10%) | 150 (15%) | 0 (0%) | 140 (14%) | 10 (1%) | 0.51 (70% of the step) |" in text
    assert "- Mesh(dp=2): funcpar / best peer 0.73, target <= 0.8 met." in text
    slow = [dict(r, s_per_step=2.0) if r["mesh"] == "dp2" and r["impl"] == "funcpar" else r for r in rows]
    text = report.profile_tables(prof, slow)  # 2.0 / 1.5 = 1.33; floor 0.7 * 1.33 = 0.93 > 0.8
    assert "target <= 0.8 not met; compute floor 0.93, unreachable here" in text
    mid = [dict(r, s_per_step=1.25) if r["mesh"] == "dp2" and r["impl"] == "funcpar" else r for r in rows]
    text = report.profile_tables(prof, mid)  # 1.25 / 1.5 = 0.83; floors 0.7 and (0.7 + 0.15) x 0.83 = 0.71
    assert ("target <= 0.8 not met; compute floor 0.58, with its collectives as profiled 0.71: it needs 4% of "
            "funcpar's step removed; the target leaves 138 ms a step for the element-wise ops, optimizer, copies, "
            "Python, which take 188 ms now.") in text  # 1200 - 0.85 x 1250 = 137.5; 0.15 x 1250 = 187.5
    comm = [dict(r, s_per_step=1.6) if r["mesh"] == "dp2" and r["impl"] == "funcpar" else r for r in rows]
    text = report.profile_tables(prof, comm)  # floors 0.7 x 1.07 = 0.75 and 0.85 x 1.07 = 0.91
    assert "compute floor 0.75, with its collectives as profiled 0.91: the matmuls, attention and communication " \
           "alone exceed the target" in text and "(240 ms a step now)" in text
    assert "profile of" not in text  # a failed profile among good ones is left out of the tables
    assert report.profile_tables(prof[1:], rows) == "- profile of Mesh(tp=2) funcpar failed: exit 1: boom"


def test_pipeline_mesh_runs_funcpar_zero_bubble_against_deepspeeds_pipe_engine_on_equal_micro_batches():
    """pp2: funcpar Mesh(pp=2) with zero-bubble 1F1B and DeepSpeed's PipelineModule, the global batch cut into the same
    micro-batches; no bytes row (funcpar counts the collectives of tp and dp, not a pipeline's sends), so no
    ``funcpar plan`` for it; every other mesh keeps one micro-batch."""
    from benchmarks import worker

    assert C.MESHES["pp2"]["impls"] == ["funcpar", "ds-pipe"] and C.MESHES["pp2"]["nproc"] == 2
    assert C.micro_batches("pp2") == 4 and C.SIZES["small"]["global_batch"] % C.micro_batches("pp2") == 0
    assert all(C.micro_batches(m) == 1 for m in C.MESHES if m != "pp2")
    assert C.impl_label("pp2", "funcpar") == "funcpar Mesh(pp=2) zero-bubble 1F1B, 4 micro-batches"
    assert C.pipeline("pp2") == {"pipeline": "zb"} and C.pipeline("dp2") == {}
    assert C.impl_label("pp2", "ds-pipe") == "DeepSpeed PipelineModule (2 stages)" and C.NEEDS["ds-pipe"] == "deepspeed"
    assert C.analytic_traffic(C.SIZES["small"], "pp2") == {}
    assert worker.BUILDERS["ds-pipe"] is worker.build_ds_pipe
    rows = report.summarize([report.parse_job(_out("pp2", impl, [1.0, t], [8.3, 8.1], [700, 700]), "", 0,
                                              mesh="pp2", impl=impl, size="small")
                             for impl, t in (("funcpar", 1.0), ("ds-pipe", 1.5))], "small",
                            C.flops_per_step(C.SIZES["small"]), peak_flops=1e11, tol=1e-4)
    assert [r["impl"] for r in rows] == ["funcpar", "ds-pipe"] and rows[1]["s_per_step"] == pytest.approx(1.25)


def test_on_cuda_every_job_runs_nccl_one_gpu_per_rank_and_the_report_says_so(monkeypatch):
    """The same command on a CUDA machine: ``--device auto`` picks CUDA where torch sees it, the jobs get NCCL and
    DeepSpeed's cuda accelerator, a mesh with more ranks than GPUs is reported as not run (NCCL refuses two ranks on
    one device), device memory joins the table. Here (no CUDA) auto is the host and ``--device cuda`` is refused."""
    import subprocess
    import types

    import torch

    from benchmarks import run

    assert (C.backend("cuda"), C.backend("cpu")) == ("nccl", "gloo")
    assert run.not_runnable("dp2", "funcpar", "cuda", 1) == "needs 2 GPUs (one per rank), this machine has 1"
    assert run.not_runnable("tp2dp2", "funcpar", "cuda", 2) == "needs 4 GPUs (one per rank), this machine has 2"
    assert run.not_runnable("1", "funcpar", "cuda", 1) is None and run.not_runnable("tp2dp2", "funcpar", "cpu", 0) is None
    if not torch.cuda.is_available():
        assert run.resolve_device("auto") == ("cpu", 0)
        with pytest.raises(SystemExit, match="no CUDA device"):
            run.resolve_device("cuda")
    seen = {}

    def fake_run(cmd, env, **kw):
        seen["cmd"], seen["env"] = cmd, env
        return types.SimpleNamespace(stdout="RESULT " + json.dumps({"times": [1.0], "losses": [1.0], "rss_mb": [1],
                                                                     "gpu_mb": [2]}), stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = run.parse_args(["--device", "cuda"])
    args.gpus = 1
    rec = run.launch("1", "ds-zero1", "small", "/w", args)
    assert seen["env"]["DS_ACCELERATOR"] == "cuda" and _flag(seen["cmd"], "--device") == "cuda"
    assert rec["gpu_mb"] == [2]
    rows = report.summarize([dict(rec, impl="funcpar", mesh="1"), dict(rec, impl="hf-eager", mesh="1")], "small",
                            1e9, 1e12, 1e-4)
    assert "| peak RSS / GPU memory per rank (MB, max) |" in report.table(rows, 1e-4)
    assert "| 1 / 2 |" in report.table(rows, 1e-4)
    meta = {"command": "c", "date": "d", "wall_s": 1, "peak_threads": 1, "peak_n": 8192, "peak_seconds": 3,
            "peak_flops": 5e13, "warmup": 2, "steps": 4, "repeats": 1, "versions": {},
            "machine": {"cpu": "x", "cores": 16, "memory_gib": 1.0, "device": "cuda", "gpus": ["NVIDIA H100"]}}
    doc = report.document(meta, {"small": {"rows": rows}}, 1e-4)
    assert "the jobs on CUDA (NCCL, one GPU per rank): NVIDIA H100" in doc and "(measured, fp32, cuda:0," in doc


def test_profile_on_cuda_takes_the_kernels_time_of_each_op():
    """profile_step on CUDA: each op's kind gets the device time of the kernels it launched, and ``python`` is what
    the phase's (synchronized) wall time leaves; on the host, self CPU times as before."""
    import types

    from benchmarks import profile_step as PS

    def ev(name, parent, start, end, self_cpu=0.0, dev=0.0):
        return types.SimpleNamespace(name=name, cpu_parent=parent, cpu_time_total=end - start,
                                     self_cpu_time_total=self_cpu, self_device_time_total=dev,
                                     time_range=types.SimpleNamespace(start=start, end=end))

    step = ev("step", None, 0, 10000, self_cpu=10.0)
    fb = ev("phase:forward+backward", step, 500, 9500, self_cpu=1000.0)
    events = [step, fb, ev("aten::mm", fb, 600, 700, self_cpu=50.0, dev=4000.0),
              ev("aten::mul", fb, 800, 900, self_cpu=20.0, dev=1000.0),
              ev("aten::mm", None, 5000, 5100, self_cpu=30.0, dev=2000.0),  # the backward's thread: no parents
              ev("aten::_efficient_attention_backward", None, 6000, 6100, dev=500.0),
              ev("aten::mm", None, 11000, 11100, dev=7000.0)]  # after the step: not counted
    gpu = PS.phases_of(events, 1, 10000.0, device=True)["forward+backward"]
    assert gpu == {"wall_ms": 9.0, "matmul": 6.0, "other ops": 1.0, "attention": 0.5, "python": 1.5}
    cpu = PS.phases_of(events, 1, 10000.0)["forward+backward"]  # on the host: by the parent chain, self CPU times
    assert cpu == {"wall_ms": 9.0, "matmul": 0.05, "other ops": 0.02, "python": 1.0}


def test_profile_on_cuda_counts_each_kernel_once_by_its_own_name_or_its_launching_op():
    """A CUDA trace lists each kernel as an event of its own as well as inside its launching op's device time: each
    kernel counts once, by its name where it says (Hopper's nvjet/xmma GEMMs, flash attention's CUTLASS kernels,
    NCCL, memcpy), else by the op that launched it; the phase is the launching op's. Before, the GEMMs counted twice,
    the second time as "other ops", and the kinds summed to more than the step."""
    import types

    from benchmarks import profile_step as PS

    cpu_t, gpu_t = types.SimpleNamespace(name="CPU"), types.SimpleNamespace(name="CUDA")

    def ev(name, parent, start, end, id=0, dev=0.0, linked=0, on=cpu_t):
        return types.SimpleNamespace(name=name, cpu_parent=parent, cpu_time_total=end - start, id=id,
                                     self_cpu_time_total=0.0, self_device_time_total=dev, device_type=on,
                                     linked_correlation_id=linked, time_range=types.SimpleNamespace(start=start, end=end))

    step = ev("step", None, 0, 10000)
    fb = ev("phase:forward+backward", step, 500, 8000)
    opt = ev("phase:optimizer", step, 8100, 9900)
    comm = ev("comm:all_reduce", fb, 7000, 7100)
    ops = [ev("aten::mm", fb, 600, 700, id=1, dev=3000.0), ev("aten::mul", fb, 800, 900, id=2, dev=500.0),
           ev("aten::_scaled_dot_product_flash_attention_backward", None, 5000, 5100, id=3, dev=800.0),
           ev("aten::copy_", fb, 5200, 5300, id=4, dev=100.0), ev("c10d::allreduce_", comm, 7010, 7090, id=5),
           ev("aten::_fused_adamw_", opt, 8150, 8200, id=6, dev=400.0),
           ev("cudaLaunchKernel", None, 8160, 8170, id=2, linked=6)]  # a runtime call: its id is not an op's
    kernels = [ev("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", None, 650, 3650, linked=1, on=gpu_t),
               ev("void at::native::vectorized_elementwise_kernel<4, MulFunctor>", None, 3700, 4200, linked=2,
                  on=gpu_t),
               ev("void pytorch_flash::flash_bwd_kernel<Flash_bwd_kernel_traits, cutlass::half_t>", None, 5100, 5900,
                  linked=3, on=gpu_t),
               ev("Memcpy DtoD (Device -> Device)", None, 5900, 6000, linked=4, on=gpu_t),
               ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", None, 7020, 7620, linked=5, on=gpu_t),
               ev("triton_poi_fused_0", None, 7700, 7800, linked=0, on=gpu_t),  # launched by no op in the trace
               ev("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", None, 8300, 8700, linked=6,
                  on=gpu_t),
               ev("nvjet_tst_after_the_step", None, 11000, 12000, linked=99, on=gpu_t)]  # outside every step
    got = PS.phases_of([step, fb, opt, comm, *ops, *kernels], 1, 10000.0, device=True)
    assert got["forward+backward"] == pytest.approx({"wall_ms": 7.5, "matmul": 3.0, "other ops": 0.6, "attention": 0.8,
                                                     "copies": 0.1, "collectives": 0.6, "python": 2.4})
    assert got["optimizer"] == pytest.approx({"wall_ms": 1.8, "other ops": 0.4, "python": 1.4})
    kinds = sum(v for d in got.values() for k, v in d.items() if k != "wall_ms")
    assert kinds == pytest.approx(10.0)  # the kinds add up to the step, no kernel counted twice
    assert PS.kernel_kind("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32") == "matmul"
    assert PS.kernel_kind("fmha_cutlassB_f32_aligned_64x64_k64_sm80") == "attention"
    assert PS.kernel_kind("triton_red_fused__to_copy_mul_sum_1") is None


def test_lora_benchmark_launches_its_jobs_on_the_resolved_device(monkeypatch, tmp_path):
    """benchmarks/lora.py shares run.launch: its arguments carry the device (a launch without it failed)."""
    import subprocess
    import types

    from benchmarks import lora, run

    seen = []

    def fake_run(cmd, env, **kw):
        seen.append((cmd, env["DS_ACCELERATOR"]))
        return types.SimpleNamespace(stdout="RESULT " + json.dumps({"times": [1.0], "losses": [1.0],
                                                                     "rss_mb": [10]}), stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(run, "write_weights", lambda size: str(tmp_path / "w"))
    out = tmp_path / "LORA.md"
    lora.main(["--meshes", "1", "--repeats", "1", "--device", "cpu", "--out", str(out)])
    assert [c[c.index("--impl") + 1] for c, _ in seen] == ["funcpar", "funcpar-lora"]
    assert all(_flag(c, "--device") == "cpu" and _flag(c, "--precision") == "fp32" and acc == "cpu" for c, acc in seen)
    assert "| Mesh() | 1.000 | 1.000 | 1.00 | 10 | 10 |" in out.read_text()
    # on a machine with one GPU a 4-rank mesh is listed as not run (as run.py does) and the one-process mesh runs
    seen.clear()
    monkeypatch.setattr(run, "resolve_device", lambda device: ("cuda", 1))
    lora.main(["--meshes", "tp2dp2,1", "--repeats", "1", "--device", "cuda", "--out", str(out)])
    assert [(c[c.index("--mesh") + 1], acc) for c, acc in seen] == [("1", "cuda")] * 2
    text = out.read_text()
    assert "| Mesh(tp=2, dp=2) | not run: needs 4 GPUs (one per rank), this machine has 1 |" in text
    assert "| Mesh() | 1.000 | 1.000 | 1.00 | 10 | 10 |" in text


def _flag(cmd: list[str], name: str) -> str:
    """The value after ``name`` in a command line."""
    return cmd[cmd.index(name) + 1]


def test_bf16_runs_funcpar_and_the_eager_loop_only_and_the_report_says_bf16(monkeypatch):
    """--precision bf16: the jobs get it, the peers not wired for it are listed as not run (not silently run in fp32),
    the peak and the notes say bf16."""
    import subprocess
    import types

    from benchmarks import run

    monkeypatch.setattr(run, "missing_package", lambda impl: None)  # (DeepSpeed is an optional extra)
    assert run.not_runnable("1", "hf-eager", "cpu", 0, "bf16") is None
    assert run.not_runnable("1", "funcpar-lora", "cpu", 0, "bf16") is None  # (build_funcpar: param_dtype too)
    assert run.not_runnable("1", "funcpar", "cuda", 1, "bf16") is None
    assert "wired for funcpar, funcpar-generic and hf-eager only" in run.not_runnable("dp2", "ds-zero1", "cpu", 0, "bf16")
    assert run.not_runnable("dp2", "ds-zero1", "cuda", 1, "bf16").startswith("needs 2 GPUs")
    seen = {}

    def fake_run(cmd, env, **kw):
        seen["cmd"] = cmd
        return types.SimpleNamespace(stdout="RESULT " + json.dumps({"times": [1.0], "losses": [1.0], "rss_mb": [1]}),
                                     stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = run.parse_args(["--device", "cpu", "--precision", "bf16", "--size", "gpu"])
    run.launch("1", "funcpar", "gpu", "/w", args)
    assert _flag(seen["cmd"], "--precision") == "bf16" and _flag(seen["cmd"], "--size") == "gpu"
    assert run.setup_notes("bf16")[0].startswith("Every implementation: bf16 compute with fp32 master weights")
    assert run.setup_notes("fp32")[0].startswith("Every implementation: fp32, AdamW")
    assert "; AdamW (lr 1e-3" in run.setup_notes("bf16")[0]
    on_gpu = " ".join(run.setup_notes("fp32", device="cuda"))
    assert "gloo" not in on_gpu and "2 threads" not in on_gpu and "NCCL" in on_gpu
    assert "`compile=\"auto\"`, its default" in run.setup_notes("bf16")[1]
    assert "`compile=True`" in run.setup_notes("bf16", "on")[1] and "`compile=False`" in run.setup_notes("fp32", "off")[1]
    run.launch("1", "funcpar", "gpu", "/w", run.parse_args(["--compile", "on"]))
    assert _flag(seen["cmd"], "--compile") == "on"
    run.launch("1", "funcpar", "gpu", "/w", run.parse_args([]))
    assert _flag(seen["cmd"], "--compile") == "auto"
    run.launch("1", "hf-eager", "gpu", "/w", run.parse_args(["--compile", "on"]))
    assert "--compile" not in seen["cmd"]
    assert C.COMPILE == {"auto": "auto", "on": True, "off": False}
    meta = {"command": "c", "date": "d", "wall_s": 1, "peak_threads": 1, "peak_n": 8192, "peak_seconds": 3,
            "peak_flops": 5e14, "warmup": 2, "steps": 4, "repeats": 1, "versions": {}, "precision": "bf16",
            "machine": {"cpu": "x", "cores": 16, "memory_gib": 1.0, "device": "cuda", "gpus": ["NVIDIA H100"]}}
    assert "matmul peak (measured, bf16, cuda:0" in report.document(meta, {}, 1e-4)
    with pytest.raises(SystemExit):
        run.parse_args(["--precision", "fp8"])


def test_the_bf16_peak_multiplies_bf16_operands():
    """run._peak in bf16 times bf16 matmuls (a float32 product timed under a bf16 label would halve every MFU)."""
    import torch

    from benchmarks import run

    seen = []
    real = torch.Tensor.__matmul__

    def spy(a, b):
        seen.append((a.dtype, b.dtype))
        return real(a, b)

    torch.Tensor.__matmul__ = spy
    try:
        assert run._peak(1, 64, 0.01, "cpu", "bf16") > 0
    finally:
        torch.Tensor.__matmul__ = real
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}
