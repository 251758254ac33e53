"""funcpar and its peers side by side on the same Llama, batch, optimizer and local processes; writes RESULTS.md.

    python benchmarks/run.py                                   # small size, 3 repeats, every mesh
    python benchmarks/run.py --size both --repeats 5 --out benchmarks/RESULTS.md
    python benchmarks/run.py --meshes dp2,tp2 --impls funcpar,ds-zero1,torch-tp --repeats 1 --steps 2   # a quick look

The peers are optional (``pip install -e ".[bench]"`` adds DeepSpeed; torch's FSDP2 and TP come with torch >= 2.6,
transformers with the test extra); a peer whose package is missing is listed as such and the rest runs.

Meshes and implementations (``common.MESHES``):

    1       one process, 2 threads: funcpar Mesh() | transformers + torch.optim.AdamW (eager)
    dp2     2 ranks: funcpar Mesh(dp=2) zero=1 | DeepSpeed ZeRO-1 | DeepSpeed ZeRO-2 | torch FSDP2 (fully_shard)
    tp2     2 ranks: funcpar Mesh(tp=2) | DeepSpeed AutoTP | torch TP (parallelize_module, vocab-parallel head)
    tp2dp2  4 ranks: funcpar Mesh(tp=2, dp=2) zero=1 | DeepSpeed AutoTP + ZeRO-1 | torch TP + FSDP2
    pp2     2 ranks, 4 micro-batches: funcpar Mesh(pp=2) zero-bubble 1F1B | DeepSpeed PipelineModule (2 stages,
            ZeRO-0, 1F1B)

How. The runner writes one transformers ``LlamaForCausalLM`` (``save_pretrained``, fp32, untied head, seed 0) into
a temporary folder per size, measures the machine's fp32 matmul peak (every core, in this process), then launches
each (mesh, implementation) as its own job ``python -m torch.distributed.run --standalone --nproc-per-node N
benchmarks/worker.py ...`` with ``OMP_NUM_THREADS`` = threads per rank (1; 2 for the one-process mesh),
``DS_ACCELERATOR`` = the device and ``HF_HUB_OFFLINE=1``, one job at a time, all jobs of a repeat in one order and the next
repeat in the reverse order. Each job: ``--warmup`` untimed steps, then ``--steps`` timed steps (see worker.py).
Equal work: every implementation's first 2 losses (the initial weights on batch 0, then after one AdamW step on
batch 1) must agree with funcpar's on the same mesh within ``--tol`` (relative); a disagreement is marked in the
table. The runner also runs ``funcpar plan`` for each mesh to report the bytes funcpar's step sends per axis next
to the textbook count. Writes ``--out`` (RESULTS.md), the bar chart ``--plot`` and every job's record as JSON
(``--json``).

Device. ``--device auto`` (the default) runs every job on CUDA wherever torch sees a CUDA device, else on host
tensors: on CUDA each rank takes ``cuda:$LOCAL_RANK`` and NCCL (DeepSpeed's ``cuda`` accelerator, torch's device mesh
on ``cuda``), each step's clock stops after the device finished, the peak is an 8192x8192 fp32 matmul on ``cuda:0``
and the table adds each rank's peak of allocated device memory; a mesh with more ranks than the machine has GPUs is
listed as not run. On the host: gloo and ``DS_ACCELERATOR=cpu``. The command is the same.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common as C  # noqa: E402
from benchmarks import report  # noqa: E402

WORKER = os.path.join(ROOT, "benchmarks", "worker.py")
PROFILER = os.path.join(ROOT, "benchmarks", "profile_step.py")


def missing_package(impl: str) -> str | None:
    """Why ``impl`` cannot run here (a package it needs is absent), or None."""
    pkg = C.NEEDS.get(impl)
    if pkg and importlib.util.find_spec(pkg) is None:
        return f"{pkg} is not installed (pip install -e \".[bench]\")"
    if impl.startswith("torch-"):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
            from torch.distributed.tensor.parallel import loss_parallel  # noqa: F401
        except ImportError:
            return "needs torch >= 2.6 (torch.distributed.fsdp.fully_shard)"
    return None


def not_runnable(mesh: str, impl: str, device: str, gpus: int, precision: str = "fp32") -> str | None:
    """Why the job (``mesh``, ``impl``) cannot run here: a package missing, too few GPUs, or the precision not wired
    for that peer; None if it can."""
    return missing_package(impl) or C.devices_short(mesh, device, gpus) or C.precision_short(impl, precision)


def resolve_device(choice: str) -> tuple[str, int]:
    """``--device`` as ("cuda" | "cpu", the number of CUDA devices): ``auto`` is CUDA wherever torch sees one."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and not gpus:
        sys.exit("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                 "--device cpu runs the jobs on host tensors with gloo")
    return ("cuda" if choice == "cuda" or (choice == "auto" and gpus) else "cpu"), gpus


def measure_peak(threads: int, n: int, seconds: float, device: str = "cpu", precision: str = "fp32") -> float:
    """The best matmul FLOP/s of ``n`` x ``n`` matmuls in ``precision`` (fp32 or bf16) over ``seconds``: on
    ``threads`` threads, or on the first CUDA device (each matmul timed to its completion; TF32 as torch leaves it,
    off by default), measured in a child process there, so that the runner holds no CUDA context or cached memory on
    the jobs' rank-0 GPU."""
    if device == "cuda":
        code = (f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks import run; "
                f"print(run._peak({threads}, {n}, {seconds}, 'cuda', {precision!r}))")
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout.split()[-1])
    return _peak(threads, n, seconds, device, precision)


def _peak(threads: int, n: int, seconds: float, device: str, precision: str = "fp32") -> float:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    g = torch.Generator(device=device).manual_seed(0)  # random operands: zeros run faster than real data
    a, b = (torch.randn(n, n, device=device, dtype=dtype, generator=g) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a @ b
    sync()
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2.0 * n**3 / (time.perf_counter() - t))
    torch.set_num_threads(before)
    return best


def machine(device: str = "cpu") -> dict:
    cpu = platform.processor() or platform.machine()
    mem = 0.0
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            mem = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal")) / 2**20
    except OSError:
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "device": device}
    if device == "cuda":
        import torch

        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def versions() -> dict:
    from importlib import metadata

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "deepspeed"):
        try:
            out[pkg] = metadata.version(pkg)
        except Exception:  # noqa: BLE001
            out[pkg] = "not installed"
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "funcpar", "models"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        out["funcpar"] = f"git {sha}" + (" (+ uncommitted changes in funcpar/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        out["funcpar"] = "unknown commit"
    return out


def write_weights(size: dict) -> str:
    import torch
    import transformers

    folder = tempfile.mkdtemp(prefix="funcpar-bench-")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**C.hf_config(size))).save_pretrained(folder)
    return folder


def launch(mesh: str, impl: str, size: str, weights: str, args) -> dict:
    """One job; its record (``report.parse_job``) with the wall time and the machine's load while it ran."""
    spec = C.MESHES[mesh]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['nproc']}",
           WORKER, "--mesh", mesh, "--impl", impl, "--size", size, "--weights", weights,
           "--warmup", str(args.warmup), "--steps", str(args.steps)] + job_flags(impl, args)
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "DS_ACCELERATOR": args.device,
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    loads, done = [], threading.Event()

    def sample():
        while not done.wait(2.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    fields = {"mesh": mesh, "impl": impl, "size": size}
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
        rec = report.parse_job(p.stdout, p.stderr, p.returncode, **fields)
    except subprocess.TimeoutExpired:
        rec = {**fields, "error": f"timed out after {args.timeout} s"}
    finally:
        done.set()
        sampler.join()
    rec["wall_s"] = time.perf_counter() - t
    rec["load"] = sum(loads[len(loads) // 2:]) / len(loads[len(loads) // 2:]) if loads else os.getloadavg()[0]
    return rec


def plan_traffic(mesh: str, size: dict, weights: str) -> dict:
    """What ``funcpar plan`` says funcpar's step sends per axis on ``mesh`` (its "sends ... per step")."""
    axes = ",".join(f"{a}={n}" for a, n in C.MESHES[mesh]["axes"].items())
    cmd = [sys.executable, "-m", "funcpar", "plan", "--model", weights, "--mesh", axes, "--zero", "1",
           "--seq-len", str(size["seq"]), "--global-batch", str(size["global_batch"])]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:200]}
    return report.parse_plan(p.stdout)


def job_flags(impl: str, args) -> list[str]:
    """The device, precision and (funcpar's jobs) compile flags of a worker or profiler command line
    (benchmarks/lora.py's arguments have no precision or compile: fp32 and compile_step's default)."""
    flags = ["--device", args.device, "--precision", getattr(args, "precision", "fp32")]
    return flags + (["--compile", getattr(args, "compile", "auto")] if impl.startswith("funcpar") else [])


def profile(mesh: str, impl: str, size: str, weights: str, args) -> dict:
    """``profile_step.py`` for one (mesh, implementation): its phase split of a few profiled steps."""
    spec = C.MESHES[mesh]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['nproc']}",
           PROFILER, "--mesh", mesh, "--impl", impl, "--size", size, "--weights", weights] + job_flags(impl, args)
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "DS_ACCELERATOR": args.device,
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"mesh": mesh, "impl": impl, "error": f"timed out after {args.timeout} s"}
    for line in p.stdout.splitlines():
        if line.startswith("PROFILE "):
            return json.loads(line[8:])
    tail = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
    return {"mesh": mesh, "impl": impl, "error": tail[:300]}


def run_size(name: str, jobs: list[tuple[str, str]], args, records: list[dict], t0: float) -> dict:
    size = C.SIZES[name]
    weights = write_weights(size)
    try:
        why = {(m, i): not_runnable(m, i, args.device, args.gpus, args.precision) for m, i in jobs}
        runnable = [job for job in jobs if not why[job]]
        records += [{"mesh": m, "impl": i, "size": name, "missing": why[m, i]} for m, i in jobs if why[m, i]]
        for r in range(args.repeats):
            for k, (mesh, impl) in enumerate(runnable if r % 2 == 0 else runnable[::-1]):
                rec = launch(mesh, impl, name, weights, args)
                rec["repeat"] = r
                records.append(rec)
                what = (f"median {C.median(rec['times']):.3f} s/step, losses "
                        + " ".join(f"{x:.5f}" for x in rec["losses"][:2]) if "times" in rec
                        else f"FAILED: {rec['error']}")
                print(f"[{name} {r + 1}/{args.repeats} {k + 1}/{len(runnable)}] {C.mesh_label(mesh):<18} "
                      f"{C.impl_label(mesh, impl):<34} {what} (job {rec['wall_s']:.0f} s, load {rec['load']:.1f}, "
                      f"total {(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
        meshes = list(dict.fromkeys(m for m, _ in jobs if C.analytic_traffic(size, m)))  # (tp, dp: counted)
        planned = {m: plan_traffic(m, size, weights) for m in meshes} if not args.no_plan else {}
        profiles = []
        if args.profile:  # after the timed jobs, so the profiler's overhead touches none of them
            for mesh in dict.fromkeys(m for m, i in runnable if i == "funcpar"):
                for impl in ["funcpar"] + (["hf-eager"] if mesh == "1" else []):
                    profiles.append(profile(mesh, impl, name, weights, args))
                    print(f"[{name} profile] {C.mesh_label(mesh)} {impl}: "
                          + (f"{profiles[-1]['step_ms']:.0f} ms/step profiled" if "phases" in profiles[-1]
                             else profiles[-1]["error"]), flush=True)
    finally:
        shutil.rmtree(weights, ignore_errors=True)
    return {"planned": planned, "profiles": profiles}


def select_jobs(args) -> list[tuple[str, str]]:
    meshes = args.meshes.split(",")
    for m in meshes:
        if m not in C.MESHES:
            sys.exit(f"unknown mesh {m!r}; known: {', '.join(C.MESHES)}")
    impls = args.impls.split(",") if args.impls else None
    for i in impls or []:
        if i not in C.IMPLS:
            sys.exit(f"unknown implementation {i!r}; known: {', '.join(C.IMPLS)}")
    return [(m, i) for m in meshes for i in C.MESHES[m]["impls"] if impls is None or i in impls]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--size", default="small", choices=[*C.SIZES, "both"],
                    help="both: " + " and ".join(C.CPU_SIZES) + "; gpu (0.87B parameters) is sized for one GPU")
    ap.add_argument("--precision", default="fp32", choices=C.PRECISIONS,
                    help="bf16: bf16 compute, fp32 master weights and optimizer state (funcpar's param_dtype, the "
                         "eager loop under torch.autocast; the other peers are listed as not run); the matmul peak "
                         "is then measured in bf16")
    ap.add_argument("--device", default="auto", choices=C.DEVICES,
                    help="where the jobs run: cuda (NCCL, one GPU per rank, DS_ACCELERATOR=cuda) or cpu (gloo, "
                         "DS_ACCELERATOR=cpu); auto: cuda wherever torch sees a CUDA device")
    ap.add_argument("--compile", default="auto", choices=list(C.COMPILE),
                    help="funcpar's compile_step(compile=...): auto (its default: eager on host tensors, compiled on a "
                         "CUDA mesh of data axes only), on (True: torch.compile of the per-micro-batch gradient, "
                         "compiled in the warm-up steps) or off (False)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--meshes", default=",".join(C.MESHES), help="comma-separated, of " + ", ".join(C.MESHES))
    ap.add_argument("--impls", help="comma-separated subset of " + ", ".join(C.IMPLS) + " (None: all)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per job (at least 2: the losses checked)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per job")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative difference of the first losses flagged")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per job")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    ap.add_argument("--plot", help="the bar chart (None: results.png beside --out)")
    ap.add_argument("--json", help="every job's record (None: results.json beside --out)")
    ap.add_argument("--no-plan", action="store_true", help="skip the funcpar plan traffic figures")
    ap.add_argument("--profile", action="store_true", help="profile funcpar's step on each mesh after the timed jobs "
                                                            "(benchmarks/profile_step.py) and add where its time goes")
    ap.add_argument("--peak-seconds", type=float, default=3.0, help="how long the matmul peak is measured")
    ap.add_argument("--peak-from", metavar="JSON", help="with --rerender: take the matmul peak from another run's "
                                                        "results.json (when this run's measurements competed with "
                                                        "other work; RESULTS.md says so)")
    ap.add_argument("--note", action="append", default=[], help="with --rerender: a note to add (repeatable)")
    ap.add_argument("--rerender", metavar="JSON", help="write RESULTS.md and the plot again from a results.json "
                                                       "(no jobs run)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rerender:
        with open(args.rerender) as f:
            saved = json.load(f)
        if args.peak_from:
            with open(args.peak_from) as f:
                other = json.load(f)["meta"]
            m = saved["meta"]
            m["peak_note"] = (f"this run measured {' and '.join(f'{p / 1e9:.1f}' for p in m['peaks'])} GFLOP/s while "
                              f"other work competed for the cores; the peak used is that of the run of "
                              f"{other['date']} on the same machine ({other['peak_flops'] / 1e9:.1f} GFLOP/s, "
                              f"`--peak-from`)")
            m["peak_flops"], m["peaks"] = other["peak_flops"], other["peaks"]
        write_outputs(saved["meta"], saved["records"], saved["planned"], args, saved.get("profiles", {}))
        return
    if args.warmup < report.LOSSES_CHECKED:
        sys.exit(f"--warmup must be at least {report.LOSSES_CHECKED}: the equal-work check compares the first "
                 f"{report.LOSSES_CHECKED} losses, which are untimed")
    if importlib.util.find_spec("transformers") is None:
        sys.exit("the benchmark builds its model with transformers: pip install -e \".[bench]\"")
    jobs = select_jobs(args)
    args.device, args.gpus = resolve_device(args.device)
    print("jobs on " + (f"CUDA, NCCL: {args.gpus} GPU(s)" if args.device == "cuda" else "host tensors, gloo"),
          flush=True)
    why = {(m, i): not_runnable(m, i, args.device, args.gpus, args.precision) for m, i in jobs}
    missing = sorted({f"{C.impl_label(m, i)} on {C.mesh_label(m)} ({why[m, i]})" for m, i in jobs if why[m, i]})
    for line in missing:
        print(f"not run: {line}", flush=True)
    t0, at_start = time.perf_counter(), versions()  # the funcpar commit the jobs ran (others may commit meanwhile)
    threads, n = (1, 8192) if args.device == "cuda" else (os.cpu_count() or 1, 2048)
    peaks = [measure_peak(threads, n, args.peak_seconds, args.device, args.precision)]
    where = "cuda:0" if args.device == "cuda" else f"{threads} threads"
    print(f"matmul peak: {peaks[0] / 1e9:.1f} GFLOP/s ({args.precision}, {where})", flush=True)
    records, planned, profiles = [], {}, {}
    for name in (C.CPU_SIZES if args.size == "both" else [args.size]):
        done = run_size(name, jobs, args, records, t0)
        planned[name], profiles[name] = done["planned"], done["profiles"]
    peaks.append(measure_peak(threads, n, args.peak_seconds, args.device, args.precision))  # again at the end: the larger is the machine's
    print(f"matmul peak at the end: {peaks[1] / 1e9:.1f} GFLOP/s; using {max(peaks) / 1e9:.1f}", flush=True)
    meta = {"command": "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "wall_s": time.perf_counter() - t0,
            "machine": machine(args.device), "versions": at_start, "peak_flops": max(peaks), "peaks": peaks,
            "peak_threads": threads, "peak_n": n, "peak_seconds": args.peak_seconds, "warmup": args.warmup,
            "steps": args.steps, "repeats": args.repeats, "missing": missing, "tol": args.tol,
            "precision": args.precision, "compile": args.compile}
    write_outputs(meta, records, planned, args, profiles)


def write_outputs(meta: dict, records: list[dict], planned: dict, args, profiles: dict) -> None:
    """RESULTS.md, the plot and (unless re-rendering it) the JSON of every job."""
    out_dir = os.path.dirname(os.path.abspath(args.out))
    plot_path = args.plot or os.path.join(out_dir, "results.png")
    json_path = args.json or os.path.join(out_dir, "results.json")
    tol = meta.get("tol", args.tol)
    meta["notes"] = (setup_notes(meta.get("precision", "fp32"), meta.get("compile", "off"),
                                 meta["machine"].get("device", "cpu"))
                     + notes(records, meta["machine"]["cores"] or 1) + list(getattr(args, "note", [])))
    sizes = {name: {"planned": planned.get(name, {}), "profiles": profiles.get(name, []),
                    "rows": report.summarize(records, name, C.flops_per_step(C.SIZES[name]), meta["peak_flops"], tol)}
             for name in planned}
    os.makedirs(out_dir, exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report.document(meta, sizes, tol))
    report.plot([r for s in sizes.values() for r in s["rows"]], plot_path)
    if not args.rerender:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "records": records, "planned": planned, "profiles": profiles}, f, indent=1)
    print(f"wrote {args.out}, {plot_path}" + ("" if args.rerender else f", {json_path}")
          + f" ({meta['wall_s'] / 60:.1f} min)")
    for name, s in sizes.items():
        print(f"\n{name}\n" + report.table(s["rows"], tol) + "\n\n" + report.summary(s["rows"]))


def setup_notes(precision: str, compiled: str = "auto", device: str = "cpu") -> list[str]:
    """What every job of a run did, in words: the precision, ``--compile``, and on CUDA without the host-only
    sentences (gloo's rings, threads per rank)."""
    notes = list(SETUP_NOTES)
    if precision != "fp32":
        how = ("bf16 compute with fp32 master weights, gradients reduced and optimizer state in fp32 (funcpar "
               "`compile_step(..., param_dtype=torch.bfloat16)`: bf16 copies of the parameters for the forward and "
               "backward, fp32 masters in the optimizer state; the eager loop's forward under "
               "`torch.autocast(dtype=torch.bfloat16)`: fp32 parameters, autocast's bf16 matmuls, its fp32 list for "
               "softmax, norms and the loss; the other peers not run)")
        notes[0] = notes[0].replace("Every implementation: fp32, ", f"Every implementation: {how}; ", 1)
    notes[1] = notes[1].replace("no `compile=`", {
        "auto": "`compile=\"auto\"`, its default: eager on host tensors, compiled on a CUDA mesh of data axes only",
        "on": "`compile=True` (`--compile on`: torch.compile of the per-micro-batch gradient, compiled in the "
              "warm-up steps)",
        "off": "`compile=False`"}[compiled])
    if device == "cuda":
        notes[1] = notes[1][: notes[1].index(" On host tensors (gloo)")]
        notes = [n.replace("transformers model, gloo,", "transformers model, NCCL,") for n in notes
                 if not n.startswith("The one-process mesh runs 2 threads")]
        notes.append("On CUDA: every rank on its own GPU with NCCL; each step's clock stops after "
                     "`torch.cuda.synchronize`.")
    return notes


SETUP_NOTES = [
    "Every implementation: fp32, AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on every parameter), "
    "the gradient clipped to global norm 1.0, one micro-batch per step, the same global batch split over dp. "
    "Timing: rank 0's clock between a barrier before and one after each step.",
    "funcpar: `fp.compile_step(model.loss_fn(cfg, mesh), model.specs(cfg, mesh), zero=1, clip_norm=1.0)` with "
    "`fp.optim.adamw` and its defaults (donated state, no `compile=`; RMSNorm, SwiGLU and the cross-entropy's exp as "
    "`torch.compile`d element-wise kernels, `funcpar.nn.pointwise`'s default on host tensors, compiled in the warm-up "
    "steps); weights through `fp.hf.load`. On host "
    "tensors (gloo) its ZeRO reduce-scatter and all-gather are rings of `batch_isend_irecv` exchanges "
    "(`funcpar/parallel/collectives.py`): gloo's own take 2.5-3x the time of its all-reduce of the same bytes.",
    "transformers eager: `LlamaForCausalLM` (SDPA attention), `torch.optim.AdamW` with its defaults (on CPU the "
    "per-parameter loop), `clip_grad_norm_`.",
    "DeepSpeed: `deepspeed.initialize` on the transformers model, gloo, optimizer `AdamW` with `torch_adam` (torch's), "
    "`gradient_clipping` 1.0; ZeRO stage 1 or 2; AutoTP through the config (`tensor_parallel.autotp_size`, with ZeRO "
    "stage 0, or 1 over dp).",
    "torch FSDP2: `fully_shard` on each decoder layer and on the model (parameters resharded after the forward: "
    "ZeRO-3); torch TP: `parallelize_module` with Megatron's plan (q/k/v, gate/up column-parallel; o, down "
    "row-parallel; the embedding split over the vocabulary, the head's logits kept sharded and the cross-entropy under "
    "`loss_parallel`); TP + FSDP2 on a 2-D device mesh (dp, tp). torch's clipping is one global-norm all-reduce over "
    "the local shards, written out in worker.py (the norm `clip_grad_norm_` computes, each element counted once whether it \
is a plain replicated tensor or a DTensor sharded over tp, dp or both).",
    "The one-process mesh runs 2 threads; the others 1 thread per rank, so Mesh(tp=2, dp=2) puts 4 ranks on the 2 "
    "cores (time-shared: its s/step includes the ranks waiting for a core).",
]


def notes(records: list[dict], cores: int) -> list[str]:
    out = []

    def own(r):  # the load a job makes by itself: its threads, or the cores
        return max(cores, C.MESHES[r["mesh"]]["nproc"] * C.MESHES[r["mesh"]]["threads"])

    busy = [r for r in records if r.get("load", 0) > own(r) + 1]
    if busy:
        which = ", ".join(f"{C.impl_label(r['mesh'], r['impl'])} (repeat {r.get('repeat', 0) + 1}, load {r['load']:.1f})"
                          for r in busy)
        out.append(f"{len(busy)} job(s) ran while the machine's 1-minute load average was more than 1 above what "
                   f"the job makes itself on {cores} cores: {which}. Either something else competed for the cores "
                   "or the average still carried the previous job (it lags by about a minute; a 4-rank job leaves "
                   "about 4 behind); their times may be inflated")
    return out


if __name__ == "__main__":
    main()
