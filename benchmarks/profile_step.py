"""Where funcpar's step time goes, per mesh: a ``torch.profiler`` trace of a few steps, split into phases and kinds.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/profile_step.py --mesh dp2 --size small --weights FOLDER [--impl funcpar|hf-eager] [--steps 3]

(``benchmarks/run.py --profile`` runs it for every mesh after the timing jobs and puts the tables in RESULTS.md.)

The job is built exactly as ``worker.py`` builds it. After ``--warmup`` steps, ``--steps`` steps run under the
profiler. funcpar's phases are marked by wrapping its methods here (``record_function``; nothing in funcpar changes):

- ``forward+backward``: the ``torch.func`` gradient of the loss, per micro-batch;
- ``bucket copies``: the gradients copied into their flat buckets (``ZeroLayout.flat``; on host tensors ZeRO's
  reduce-scatter reads the gradient leaves where they lie instead);
- ``reduce``: the buckets' reduce-scatter (ZeRO) or all-reduce over the data axes (``ZeroLayout.reduce``,
  ``collectives.reduce_scatter_segments``);
- ``norm+stats``: the global gradient norm and loss all-reduce (``Step._statistics``);
- ``optimizer``: AdamW's update (``optimizer.update``) and its application (``Step._apply``), or both at once
  (``optimizer.fused.apply``);
- ``gather``: the updated parameters all-gathered into every rank's buffers (``StateBuffers.publish``);
- ``rest``: the step's remaining wall time (batch checks, bookkeeping, the barrier waits are outside the step).

For the eager peer (``--impl hf-eager``) the phases are forward, backward, clipping and optimizer.

Each phase's wall time is split by what ran in it, from every op's *self* time: ``matmul`` (mm, addmm, bmm,
linear's kernels), ``attention`` (the SDPA kernels and their backward), ``collectives`` (every c10d/gloo/nccl op,
including its wait), ``copies`` (copy_, clone, cat, to, contiguous, index and scatter copies), ``other ops`` (the
element-wise ops, reductions, the optimizer's ``_foreach`` kernels) and ``python`` (the phase's wall time not spent
in any op: Python, ``torch.func``'s transforms and the dispatcher between ops). Rank 0 prints ``PROFILE {json}``.

On CUDA (``--device cuda``, or ``auto`` where torch sees one) each phase marker synchronizes the device at both ends,
so a phase's wall time is its work done, and the kinds are the device's: each kernel (and copy) in the CUDA activity
counted once, by its own name where that says what it is (cuBLAS/CUTLASS/nvjet GEMMs, flash/fused attention, NCCL,
memcpy: :func:`kernel_kind`), else by the op that launched it; ``python`` is then the rest of the phase: host
overhead the device waited for. (The trace lists each kernel twice, as its own event and inside its launching op's
device time; counting both put Hopper's GEMMs, named nvjet/sm90_xmma, in "other ops" a second time.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common as C  # noqa: E402
from benchmarks import worker as W  # noqa: E402

KINDS = ("matmul", "attention", "collectives", "copies", "other ops", "python")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkldnn", "aten::mkldnn")
_COPIES = ("aten::copy_", "aten::clone", "aten::cat", "aten::_to_copy", "aten::contiguous", "aten::index_put",
           "aten::index_select", "aten::index", "aten::scatter", "aten::gather", "aten::embedding_dense_backward",
           "aten::narrow_copy", "aten::stack")


def kind_of(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gloo", "nccl", "c10d", "all_reduce", "allreduce", "reduce_scatter", "all_gather",
                            "allgather", "barrier", "broadcast", "send", "recv", "record_param_comms")):
        return "collectives"
    if any(k in n for k in ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
                            "fmha")):
        return "attention"
    if name.startswith(_MATMUL):
        return "matmul"
    if name.startswith(_COPIES):
        return "copies"
    return "other ops"


_KERNEL_KINDS = (  # (kind, name fragments), the first match wins: attention's CUTLASS kernels are attention
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("collectives", ("nccl",)),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "triton_tem_fused_mm",
                "triton_tem_fused_addmm", "triton_tem_fused_bmm")),
    ("copies", ("memcpy", "copy_kernel", "catarraybatchedcopy")),
)


def kernel_kind(name: str) -> str | None:
    """The kind a device kernel's own name gives, or None when the name does not say (an element-wise kernel, a
    Triton fusion): then the op that launched it decides."""
    n = name.lower()
    return next((kind for kind, parts in _KERNEL_KINDS if any(p in n for p in parts)), None)


def _on_device(e) -> bool:
    """A kernel, copy or set on the device itself (not an op or runtime call on the host)."""
    return getattr(getattr(e, "device_type", None), "name", "CPU") != "CPU"


SYNC = [lambda: None]  # the device's synchronize on CUDA (main sets it): phase markers wait for their kernels


def _wrap(owner, attr: str, label: str) -> None:
    import torch

    fn = getattr(owner, attr)
    sync = SYNC if label.startswith("phase:") else [lambda: None]  # (collectives overlap: not theirs)

    def wrapped(*a, **k):
        sync[0]()  # (the work queued before the phase is not the phase's)
        with torch.profiler.record_function(label):
            out = fn(*a, **k)
            sync[0]()
            return out

    setattr(owner, attr, wrapped)


def mark_funcpar(run) -> None:
    """Phase markers around funcpar's step methods (class-level, plus the step's own gradient function)."""
    import funcpar.train.buffers as B
    import funcpar.parallel.collectives as FC
    import funcpar.parallel.layout as L
    import funcpar.train.step as S

    _wrap(L.ZeroLayout, "flat", "phase:bucket copies")
    _wrap(L.ZeroLayout, "reduce", "phase:reduce")
    _wrap(FC, "reduce_scatter_segments", "phase:reduce")  # ZeRO's reduce-scatter from the gradient leaves (host)
    _wrap(S.Step, "_statistics", "phase:norm+stats")
    _wrap(S.Step, "_apply", "phase:optimizer")
    _wrap(B.StateBuffers, "publish", "phase:gather")
    step = run.step
    _wrap(step.mode, "grad", "phase:forward+backward")
    if step.executor is not None:  # a pipeline's micro-batches, forward and backward, with the stages' sends
        _wrap(step.executor, "run", "phase:forward+backward")
    opt = step.optimizer  # an InPlaceTransformation of functions: a copy with the update wrapped
    box = type("Box", (), {"update": opt.update, "apply": opt.fused.apply if opt.fused else None})
    _wrap(box, "update", "phase:optimizer")
    if opt.fused is not None:  # AdamW's fused update, written into the parameters
        _wrap(box, "apply", "phase:optimizer")
    step.optimizer = opt._replace(update=box.update, fused=opt.fused and opt.fused._replace(apply=box.apply))


def mark_eager(model, optimizer) -> None:
    import torch

    _wrap(model, "forward", "phase:forward")
    _wrap(torch.Tensor, "backward", "phase:backward")
    _wrap(torch.nn.utils, "clip_grad_norm_", "phase:norm+stats")
    _wrap(optimizer, "step", "phase:optimizer")


def mark_collectives() -> None:
    """Markers around every collective funcpar issues (with its wait) and torch.distributed's own entry points."""
    import torch.distributed as dist

    import funcpar.parallel.collectives as FC

    for name in ("_raw_all_reduce", "_raw_all_gather", "_raw_reduce_scatter"):
        _wrap(FC, name, "comm:" + name[5:])
    _wrap(FC, "reduce_scatter_segments", "comm:reduce_scatter")  # ZeRO's, from the gradient leaves: its ring's waits
    _wrap(FC, "_wait", "comm:wait")  # every bounded wait, e.g. column_parallel's for the all-reduce it overlaps
    import funcpar.parallel.p2p as P2P

    _wrap(P2P.Pending, "wait", "comm:p2p")  # a pipeline stage waiting for its neighbour's activations or gradients
    for name in ("sendrecv", "send", "recv"):
        _wrap(P2P, name, "comm:p2p")
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "batch_isend_irecv", "broadcast",
                 "all_gather", "reduce_scatter"):
        if hasattr(dist, name):
            _wrap(dist, name, "comm:" + name)


def _chain(e) -> list[str]:
    """The names of ``e``'s parents on its thread and its own, root first."""
    chain, p = [], e
    while p is not None:
        chain.append(p.name)
        p = p.cpu_parent
    return chain[::-1]


def phases_of(events, steps: int, step_wall_us: float, device: bool = False) -> dict:
    """{phase: {"wall_ms": .., kind: ..}} per step from the profiler's events inside the ``step`` markers: each
    event's self time goes to the outermost phase around it (``rest`` if none) and to its kind: ``collectives``
    under a ``comm:`` marker, ``python`` for a marker's own time, else by the op's name (:func:`kind_of`).

    With ``device``, the kinds are device time: each device event (kernel, memcpy) once, its kind by its own name
    (:func:`kernel_kind`) or else by the host op that launched it (linked by correlation id; under a ``comm:``
    marker: collectives), its phase that of its launching op, or by its own start where none is linked; ``python`` is
    the phase's wall time the kernels leave. A phase belongs to the step and phase whose markers' time span holds the
    op's start, whatever its thread (on CUDA autograd runs the backward on a thread of its own, outside the markers'
    parent chain). A trace with no device events (an older profiler) falls back to each host op's own device time."""
    out = defaultdict(lambda: defaultdict(float))
    spans = []  # (start, end, phase or None for the step) of the markers, device mode only
    for e in events if device else ():
        if e.name == "step" or e.name.startswith("phase:") and not any(c.startswith("phase:") for c in _chain(e)[:-1]):
            spans.append((e.time_range.start, e.time_range.end, None if e.name == "step" else e.name[6:]))
    kernels = [e for e in events if _on_device(e)] if device else []
    launched = {}  # a launching op's id -> its (phase, kind), for the kernels linked to it

    def phase_at(t):
        where = [ph for a, b, ph in spans if a <= t <= b]
        return None if not where else next((ph for ph in where if ph is not None), "rest")

    for e in events:
        if _on_device(e):
            continue
        chain = _chain(e)
        if device:
            phase = phase_at(e.time_range.start)
            if phase is None:
                continue  # the barriers between steps
        elif "step" not in chain:
            continue  # the barriers between steps
        else:
            phase = next((c[6:] for c in chain if c.startswith("phase:")), "rest")
        if e.name.startswith("phase:") and phase == e.name[6:] and not any(
                c.startswith("phase:") for c in chain[:-1]):
            out[phase]["wall_ms"] += e.cpu_time_total / 1e3
        if any(c.startswith("comm:") for c in chain):
            kind = "collectives"
        elif e.name == "step" or e.name.startswith("phase:"):
            kind = "python"
        else:
            kind = kind_of(e.name)
        if not device:
            out[phase][kind] += e.self_cpu_time_total / 1e3
        elif kernels:  # (the host's runtime calls are linked to ops too: only ops launch)
            if not getattr(e, "linked_correlation_id", 0) and kind != "python":
                launched[e.id] = (phase, kind)
        elif kind != "python":
            out[phase][kind] += e.self_device_time_total / 1e3
    for k in kernels:
        op = getattr(k, "linked_correlation_id", 0) or None  # (0: launched by no op in the trace)
        phase, kind = launched.get(op, (phase_at(k.time_range.start), "other ops"))
        if phase is not None:
            out[phase][kernel_kind(k.name) or kind] += (k.time_range.end - k.time_range.start) / 1e3
    out["rest"]["wall_ms"] = step_wall_us / 1e3 * steps - sum(v["wall_ms"] for k, v in out.items() if k != "rest")
    if device:
        for d in out.values():
            d["python"] = max(0.0, d["wall_ms"] - sum(v for k, v in d.items() if k not in ("wall_ms", "python")))
    return {ph: {k: v / steps for k, v in d.items()} for ph, d in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description="profile one implementation's step on one mesh (under torchrun)")
    ap.add_argument("--mesh", required=True, choices=sorted(C.MESHES))
    ap.add_argument("--impl", default="funcpar", choices=["funcpar", "hf-eager"])
    ap.add_argument("--size", required=True, choices=sorted(C.SIZES))
    ap.add_argument("--weights", required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=C.DEVICES)
    ap.add_argument("--precision", default="fp32", choices=C.PRECISIONS)
    ap.add_argument("--compile", default="auto", choices=sorted(C.COMPILE))
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(C.MESHES[args.mesh]["threads"])
    W.setup_device(args)
    gpu = args.dev.type == "cuda"
    SYNC[0] = W._sync(args)
    size = C.SIZES[args.size]
    run = W.BUILDERS[args.impl](args, size, rank, world)
    mark_collectives()
    if args.impl == "funcpar":
        mark_funcpar(run)
    else:
        mark_eager(run.model, run.optimizer)
    barrier = dist.barrier if world > 1 else (lambda: None)
    for i in range(args.warmup):
        run(i)
    walls = []
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * gpu
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.warmup, args.warmup + args.steps):
            SYNC[0]()
            barrier()
            t = time.perf_counter()
            with torch.profiler.record_function("step"):
                run(i)
                SYNC[0]()
            walls.append(time.perf_counter() - t)
    phases = phases_of(prof.events(), args.steps, sum(walls) / len(walls) * 1e6, device=gpu)
    out = {"mesh": args.mesh, "impl": args.impl, "size": args.size, "step_ms": sum(walls) / len(walls) * 1e3,
           "phases": phases}
    if os.environ.get("PROFILE_DEBUG") and rank == 0:
        tops = defaultdict(float)
        for e in prof.events():
            ph, p = None, e
            while p is not None:
                if p.name.startswith("phase:"):
                    ph = p.name
                p = p.cpu_parent
            tops[(ph, e.name)] += e.self_cpu_time_total / 1e3 / args.steps
        for (ph, n), v in sorted(tops.items(), key=lambda x: -x[1])[:60]:
            print(f"{ph}\t{n}\t{v:.1f}")
    if rank == 0:
        print("PROFILE " + json.dumps(out), flush=True)
    barrier()


if __name__ == "__main__":
    main()
