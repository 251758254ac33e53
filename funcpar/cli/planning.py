"""Planning a run before starting it: how each parameter is sharded over a mesh, and the memory each rank needs.

Everything here works on shapes only (``model.init(cfg, device="meta")``) and an abstract mesh
(:meth:`funcpar.Mesh.abstract`), so ``funcpar plan`` starts no processes and allocates no parameters.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import threading
import weakref
from typing import Any

import optree
import torch
import torch.nn.functional as F
import torch.nn.attention.bias as attention_bias
from torch.nn.attention.bias import CausalBias
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from funcpar.cli.timing import SYNC, op_key, seconds
from funcpar.nn import attention as A
from funcpar.nn import layers as L
from funcpar.parallel.collectives import on_simulated_wire
from funcpar.spec import broadcast_specs, local_shape
from funcpar.state import Handoff

__all__ = ["params_like", "local_params", "sharding_table", "memory_plan", "OPTIMIZER_SLOTS", "print_plan",
           "trace_step", "trace_plan", "MemoryTrace", "runtime_bytes", "tokens_per_second", "mib", "traffic_text",
           "extrapolation_note"]

# fp32 tensors of optimizer state per parameter
OPTIMIZER_SLOTS = {"adamw": 2, "lion": 1, "sgd": 1}


def params_like(model, cfg) -> Any:
    """The model's parameter tree as shapes only (meta tensors)."""
    return model.init(cfg, device="meta")


def local_params(params_like, specs, mesh) -> Any:
    """This rank's leaves of ``mesh`` (shards by ``specs``) as meta tensors: what :func:`trace_step` starts from."""
    leaves = [torch.empty(local_shape(s, tuple(x.shape), mesh, p), dtype=x.dtype, device="meta")
              for p, s, x in broadcast_specs(specs, params_like)]
    return optree.tree_unflatten(optree.tree_structure(params_like, none_is_leaf=True), leaves)


def sharding_table(params_like, specs, mesh) -> str:
    """One row per leaf (layers collapsed when alike): global shape, spec, local shape, MiB per rank."""
    rows: dict[str, list] = {}
    for path, spec, x in broadcast_specs(specs, params_like):
        key = re.sub(r"\.\d+\.", ".*.", path)
        loc = local_shape(spec, tuple(x.shape), mesh, path)
        mib = math.prod(loc) * x.element_size() / 2**20
        row = rows.setdefault(key, [key, tuple(x.shape), spec, loc, mib, 0])
        row[5] += 1
    lines = [f"{'leaf':<28} {'global shape':<16} {'spec':<18} {'local shape':<16} {'MiB/rank':>9}"]
    for key, shape, spec, loc, mib, count in rows.values():
        name = key if count == 1 else f"{key} (x{count})"
        lines.append(f"{name:<28} {str(shape):<16} {str(spec):<18} {str(loc):<16} {mib * count:>9.3f}")
    return "\n".join(lines)


def vocab_note(cfg, tokens: int | None = None) -> str | None:
    """A line for under the sharding table where the vocabulary tables hold rows no token uses: padded for tp
    (``vocab_rows``), or beyond a tokenizer's ``tokens``; None where every row is a token."""
    size, rows = getattr(cfg, "vocab_size", None), getattr(cfg, "vocab_rows", None)
    notes = []
    if size and rows and rows != size:
        notes.append(f"vocab_size {size} padded to {rows} rows, a multiple of 128 and of tp (the {rows - size} extra "
                     f"rows are never predicted and are not exported)")
    if size and tokens and tokens < size:
        notes.append(f"the tokenizer's {tokens} tokens use {tokens} of the model's vocab_size {size}")
    return "vocabulary: " + "; ".join(notes) if notes else None


def memory_plan(params_like, specs, mesh, zero: int, opt_slots: int = 2) -> dict[str, float]:
    """Per-rank MiB of parameters, gradients and optimizer state (``opt_slots`` fp32 tensors per parameter).

    With ``zero >= 1`` a leaf's optimizer state is split over every mesh axis (pipeline stages aside) along which
    the leaf is replicated; with ``zero >= 2`` its gradient is split over ``dp`` too; with ``zero=3`` the parameters
    held between steps as well (and the optimizer state over ``dp`` only, as :mod:`funcpar.train.zero3` partitions it).
    """
    params = grads = opt = 0.0
    dp = mesh.axis_size("dp")
    for path, spec, x in broadcast_specs(specs, params_like):
        n = math.prod(local_shape(spec, tuple(x.shape), mesh, path))
        repl = [a for a in mesh.axis_names if a != "pp" and a not in spec.axes]
        parts = dp if zero == 3 else (math.prod(mesh.axis_size(a) for a in repl) if zero >= 1 else 1)
        params += n * x.element_size() / (dp if zero == 3 else 1)
        grads += n * x.element_size() / (dp if zero >= 2 else 1)
        opt += opt_slots * 4 * n / parts
    return {"params": params / 2**20, "grads": grads / 2**20, "optimizer": opt / 2**20,
            "total": (params + grads + opt) / 2**20}


def mib(n: float) -> str:
    """Bytes as MiB, or GiB from 1 GiB on: what the plan prints."""
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def traffic_text(t: dict[str, float]) -> str:
    """Bytes sent by mesh axis, in MiB, as the plan prints them."""
    return ", ".join(f"{a} {n / 2**20:,.1f} MiB" for a, n in sorted(t.items())) or "none"


def trace_plan(model, cfg, step, rows: int, seq_len: int, like: Any = None, gpu: bool = False,
               documents: bool | None = None) -> dict[str, Any]:
    """:func:`trace_step` of ``step`` (over an abstract mesh) on a token batch of ``rows`` x ``seq_len`` per rank,
    plus the host runtime's own resident set (``runtime``) where training runs on the host (a mesh on the CPU).
    ``like``: the model's :func:`params_like`, if the caller has it already. ``gpu``: the plan is for GPUs
    (``funcpar plan --gpu``), whatever device this machine traces on: the peak is a GPU's, with no host process in
    it (``runtime`` 0).

    A step whose gradient ``compile="auto"`` compiles (a CUDA mesh of data axes only) is traced with its eager
    gradient, and ``eager_trace`` is True: inductor plans the compiled graph's buffers itself, so the figure is the
    eager step's, an estimate for the compiled one (docs/GPU.md has how far apart the two were on one GPU).

    ``documents``: the batches carry packed documents' ``position_ids`` (default: where the model takes them, as
    ``funcpar train`` packs); the trace then runs the layers' document path (its position tables included).

    One step is traced after ``init``: a second adds nothing (its FLOPs, operators, bytes sent and peak are the
    first's: tests/test_time_model.py), and tracing is what a plan's time goes to."""
    like = params_like(model, cfg) if like is None else like
    ids = torch.zeros(rows, seq_len, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    if model.documents if documents is None else documents:
        batch["position_ids"] = ids
    if step.compiled is True:
        raise ValueError("a compile=True step cannot be traced on meta tensors: plan it with compile='auto' or False")
    gradient = step.mode.gradient
    compiled, was = gradient.compiled == "auto", gradient.compiled
    gradient.compiled = False  # (the gradient's own switch: the eager gradient, for this trace only)
    try:
        out = trace_step(step, local_params(like, step.specs, step.mesh), batch, steps=1)
    finally:
        gradient.compiled = was
    out["eager_trace"] = compiled
    out["runtime"] = runtime_bytes() if step.mesh.device.type == "cpu" and not gpu else 0
    return out


def print_plan(model, cfg, step, zero: int, optimizer: str, rows: int, seq_len: int, estimate=None,
               documents: bool | None = None, gpu: bool = False, traced: dict | None = None) -> None:
    """Print what ``funcpar plan`` shows: the parameter count, the sharding table, and per rank the memory of the
    parameters, gradients and optimizer state, the activations and the peak of a step (traced), and the traffic;
    with ``estimate(row, step)`` (:func:`funcpar.cli.timing.step_seconds`'s dict), the step's estimated time and
    throughput. ``gpu``: the plan is for GPUs (``--gpu``): its peak without the host process. ``traced``: the
    step's trace when made already (:func:`funcpar.cli.search.trace_layout`)."""
    from funcpar.tree import leaves_with_path

    mesh = step.mesh
    like, specs = params_like(model, cfg), step.specs
    print(f"{cfg.model_type} on {mesh!r}: {sum(x.numel() for _, x in leaves_with_path(like)):,} parameters")
    print(sharding_table(like, specs, mesh))
    if vocab_note(cfg):
        print(vocab_note(cfg))
    if step.executor is not None:  # this rank's stage
        print(step.executor.plan.describe())
        print(f"{step.executor.plan.schedule.name} over {step.options.accum_steps} micro-batches: planned bubble "
              f"{step.executor.plan.schedule.simulate()['bubble']:.1%}; memory below for pp rank 0")
    stage = like if step.executor is None else step.executor.plan.select(like)
    mem = memory_plan(stage, specs, mesh, zero, OPTIMIZER_SLOTS.get(optimizer, 2))
    print(f"per rank (zero={zero}, {optimizer}): params {mem['params']:.2f} MiB, grads "
          f"{mem['grads']:.2f} MiB, optimizer state {mem['optimizer']:.2f} MiB, total {mem['total']:.2f} MiB")
    t = traced or trace_plan(model, cfg, step, rows, seq_len, like, gpu=gpu, documents=documents)
    if t.get("extrapolated"):
        print(extrapolation_note(t["extrapolated"], step.options.accum_steps))
    for what in t.get("stood_in", ()):  # (a size the data decides: the trace has shapes, not values)
        print(f"(assumed where the data decides: {what})")
    host = f" + runtime {mib(t['runtime'])} (python, torch: host)" if t["runtime"] else ""
    acts = f"activations {mib(t['activations'])} per micro-batch; " if step.executor is None else ""
    how = (" (the eager step's trace: compile='auto' compiles this step's gradient and inductor plans its buffers)"
           if t["eager_trace"] else "")
    print(f"traced step, {rows} x {seq_len} tokens per rank in {step.options.accum_steps} micro-batch(es): {acts}peak "
          f"{mib(t['peak'])}{host} = {mib(t['peak'] + t['runtime'])} per rank{how}; "
          f"sends {traffic_text(t['traffic'])} per step; {t['flops'] / 1e12:,.3f} TFLOP per step per rank")
    if estimate is not None:
        e = estimate(t, step)
        comm = ", ".join(f"{a} {seconds(s)}" for a, s in e["comm"].items()) or "none"
        job, per_rank = tokens_per_second(rows, seq_len, mesh, e["step"], step.options.parallel.data_axes)
        print(f"estimated step: {seconds(e['step'])} (compute {seconds(e['compute'])}, communication {comm}); "
              f"{job / seq_len:,.2f} samples/s, {job:,.0f} tokens/s for the job, {per_rank:,.0f} per rank. "
              f"Assumed: {e['assumptions']}")


def extrapolation_note(how: dict[str, tuple], micro: int) -> str:
    """What a trace extrapolated from shorter ones (:func:`funcpar.cli.search.trace_layout`'s ``extrapolated``)
    says in a line."""
    said = []
    if "micro" in how:
        said.append(f"at {how['micro'][0]} and {how['micro'][1]} micro-batches, the step's {micro} extrapolated (each "
                    f"micro-batch's work is the same)")
    if "layers" in how:
        d1, d2, depth = how["layers"]
        said.append(f"at {d1} and {d2} layers a stage, its {depth:g} extrapolated (its layers are alike)")
    return f"(traced {'; '.join(said)})"


def tokens_per_second(rows: int, seq_len: int, mesh, step_seconds: float,
                      data_axes: tuple[str, ...] = ("dp",)) -> tuple[float, float]:
    """The job's tokens a second and each rank's share, from ``rows`` (one data rank's rows a step, every
    micro-batch together) of ``seq_len`` tokens: the job's step takes ``rows x dp x seq_len`` tokens (x ep where
    ``data_axes`` split the batch over it too) whatever the other axes (pp, tp and cp ranks share a row;
    micro-batches split it), and a rank's share is that over every rank of the mesh, as throughput tables count
    it."""
    job = rows * mesh.data_block(data_axes)[0] * seq_len / step_seconds
    return job, job / math.prod(mesh.shape.values())


# ------------------------------------------------------------------------------------------ tracing a step on meta


class MemoryTrace(TorchDispatchMode):
    """Live bytes of the tensors on ``device`` (default ``meta``) created while active, and their peak, per phase.

    Every operator's outputs are registered by storage (views share it) and counted until the storage is freed,
    so the trace follows what the real run allocates and frees. A value read back to the host from a meta tensor
    (``.item()``: one; ``.cpu()``: zeros) is a stand-in: the plan is about shapes, not numbers.

    On a real gloo mesh a collective's buffer is sometimes released by gloo's worker thread, a moment after the wait
    for it returned (the thread drops its reference after it marks the work done), so by then the step may have
    allocated its next tensor: the real peak can hold one such buffer more than the plan, depending on timing.
    ``late`` is the largest storage freed on a thread other than the one tracing: the most that timing can add.
    """

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = torch.device(device).type
        self.live = self.peak = self.late = 0
        self.phase, self.peaks, self.flops = "setup", {}, {}
        self.ops: dict[tuple, int] = {}  # the "step" phase's operators by cost (funcpar.cli.timing.op_key)
        self.sequence: list[tuple] = []  # and in their order: a GPU's queue of kernels (funcpar.cli.timing.queue)
        self._seen: set[int] = set()
        self._keys: dict[tuple, tuple] = {}
        self._lock, self._thread = threading.RLock(), threading.get_ident()  # frees come from gloo's threads too

    def mark(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            self.peaks[phase] = max(self.peaks.get(phase, 0), self.live)

    def _free(self, key: int, n: int) -> None:
        with self._lock:
            self._seen.discard(key)
            self.live -= n
            if threading.get_ident() != self._thread:
                self.late = max(self.late, n)

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        with self._lock:
            key = id(st)
            if key in self._seen:
                return
            self._seen.add(key)
            n = st.nbytes()
            self.live += n
            weakref.finalize(st, self._free, key, n)
            if self.live > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = self.live
                self.peak = max(self.peak, self.live)

    def _sync(self) -> None:
        """A value read back to the host: the host waits for the device (the queue drains: timing.queue)."""
        if self.phase == "step":
            self.sequence.append(SYNC)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and src.is_meta:
            if func is torch.ops.aten._local_scalar_dense.default:
                self._sync()
                return True if src.dtype == torch.bool else 1
            if func is torch.ops.aten.bincount.default:  # (no meta kernel: its length is data; ``minlength`` stands)
                weights = args[1] if len(args) > 1 else kwargs.get("weights")
                minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
                out = torch.zeros(max(int(minlength), 1), device="meta",
                                  dtype=torch.int64 if weights is None else weights.dtype)
                self._track(out)
                return out
            to = kwargs.get("device")
            if func is torch.ops.aten._to_copy.default and to is not None and torch.device(to).type != "meta":
                self._sync()
                return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype, device=to)
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                self._track(t)
        flops = _flops(func, args, kwargs, out)
        self.flops[self.phase] = self.flops.get(self.phase, 0) + flops
        if self.phase == "step" and not on_simulated_wire():  # (a simulated collective's copies: the wire's work)
            key = op_key(func, args, kwargs, out, flops)
            key = self._keys.setdefault(key, key)  # (one tuple per cost: the sequence holds references)
            self.ops[key] = self.ops.get(key, 0) + 1
            self.sequence.append(key)
        return out


def _flops(func, args, kwargs, out) -> float:
    """The floating-point operations of one operator call: torch's count (:mod:`torch.utils.flop_counter`: matmuls,
    convolutions, CUDA attention kernels), and torch's CPU flash attention (forward 4·B·H·Tq·Tk·D, half of it when
    causal: the kernel skips the masked blocks; backward 2.5x the forward, as torch counts flash's)."""
    packet = func.overloadpacket
    if packet in _CPU_FLASH:
        q, k = args[1:3] if packet is _CPU_FLASH[1] else args[:2]
        causal = (args[7] if packet is _CPU_FLASH[1] else (args[4] if len(args) > 4 else kwargs.get("is_causal")))
        B, H, Tq, D = q.shape
        fwd = 4 * B * H * Tq * k.shape[-2] * D * (0.5 if causal and Tq == k.shape[-2] else 1)
        return fwd * (2.5 if packet is _CPU_FLASH[1] else 1)
    count = flop_registry.get(packet)
    if count is None and str(packet).endswith("_"):  # an in-place variant (addmm_, baddbmm_): its out-of-place count
        count = flop_registry.get(getattr(torch.ops.aten, str(packet).split(".")[-1][:-1], None))
    return float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0


_CPU_FLASH = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)


def trace_step(step, params, batch, steps: int = 2, device: str = "meta") -> dict[str, Any]:
    """Rank 0's memory for ``step`` built over :meth:`funcpar.Mesh.abstract`: ``step.init(params)`` and ``steps``
    calls on ``batch`` (this rank's), run on meta tensors under a :class:`MemoryTrace`. ``params``: this rank's
    leaves (:func:`local_params`). Returns bytes: ``state`` (parameters and optimizer state between steps),
    ``activations`` (what the forward of one micro-batch keeps for the backward), ``step_peak`` (the most live at
    any point of a step, transients included), ``peak`` (the same over ``init`` too: the parameters and their copy
    into the step's buffers), ``traffic`` (bytes this rank sends per step, by mesh axis) and ``late``
    (:class:`MemoryTrace`: on a real mesh, the largest buffer the transport's own thread released; 0 on meta);
    ``flops``, the floating-point operations of one step on this rank (:func:`_flops`); and ``ops``, its operators
    tallied by cost (:func:`funcpar.cli.timing.op_key` -> calls a step), what :mod:`funcpar.cli.timing` prices, and
    ``sequence``: ``[(the operators of every traced step in order, steps, 1.0)]``, for a GPU's queue; ``stood_in``:
    what sizes the data decides were taken as (:func:`funcpar.nn.layers.data_size`), in words.

    ``device="cpu"`` traces a real step on a real mesh the same way (params and batch real): what the tests compare
    the plan with."""
    mesh = step.mesh
    if (device == "meta") != mesh.simulated:
        raise ValueError(f"trace_step traces meta tensors over an abstract mesh (fp.Mesh.abstract(...)), or real "
                         f"ones over a real mesh; not device={device!r} over {mesh!r}")
    rows = next(x for x in optree.tree_leaves(batch) if isinstance(x, torch.Tensor)).shape[0]
    L.STOOD_IN.clear()
    with MemoryTrace(device) as tr, _fused_attention_on_meta(mesh.device.type), _no_gpu_here(mesh.device):
        # fresh, so the trace sees them allocated; handed off, so they go where init lets them go whatever the
        # interpreter keeps of a call's arguments (funcpar.Handoff)
        state = step.init(Handoff(optree.tree_map(lambda x: x.clone(), params)))
        gc.collect()  # what init let go of is gone by now in the real run too: count no cycle that holds it
        held = tr.live
        a = step.options.accum_steps
        micro = optree.tree_map(lambda x: x[: rows // a] if isinstance(x, torch.Tensor) else x, batch)
        tr.mark("probe")  # (a measurement of the plan's, not of the run: its peak is left out of "peak")
        loss = step.loss(state, micro, requires_grad=True)
        activations = tr.live - held
        del loss
        traffic = getattr(mesh, "traffic", {})
        traffic.clear()
        tr.mark("step")
        for _ in range(steps):
            state, _ = step(state, batch)
        peak = max(v for phase, v in tr.peaks.items() if phase != "probe")
        return {"state": held, "activations": activations, "step_peak": tr.peaks["step"], "peak": peak,
                "traffic": {a: n / steps for a, n in traffic.items()}, "late": tr.late,
                "flops": tr.flops.get("step", 0.0) / steps, "ops": {k: n / steps for k, n in tr.ops.items()},
                "sequence": [(tr.sequence, steps, 1.0)], "stood_in": sorted(L.STOOD_IN)}


class _GpusOnMeta(torch.overrides.TorchFunctionMode):
    """While a plan for CUDA is traced on a machine without a GPU, a tensor asked for on ``cuda`` is made on meta
    (meta already stands for the mesh's device: :class:`_fused_attention_on_meta`): the step's few host tensors it
    moves to the device (its statistics) then trace like the rest, and a laptop plans a GPU cluster."""

    @staticmethod
    def _meta(x):
        if isinstance(x, torch.device) and x.type == "cuda" or isinstance(x, str) and x.split(":")[0] == "cuda":
            return torch.device("meta")
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args = tuple(self._meta(a) for a in args)
        kwargs = {k: self._meta(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _no_gpu_here(device: torch.device):
    """:class:`_GpusOnMeta` where ``device`` is CUDA and this machine has no GPU, else nothing."""
    return _GpusOnMeta() if device.type == "cuda" and not torch.cuda.is_available() else contextlib.nullcontext()


class _LowerRight(tuple):
    """What ``torch.nn.attention.bias.causal_lower_right(q_len, kv_len)`` makes, while a trace runs: the kernel's
    lower-right causal flag (:class:`_fused_attention_on_meta` runs it as a causal kernel of the same cost)."""

    def __new__(cls, *size: int):
        return super().__new__(cls, size)


class _fused_attention_on_meta:
    """While tracing, attention on meta tensors runs the fused kernel CPU and CUDA run (it keeps the output and a
    log-sum-exp for the backward, not the T x T scores): on meta, ``F.scaled_dot_product_attention`` would take the
    unfused math path and the plan would count scores the real run never holds. Meta tensors stand for
    ``device``'s (:data:`funcpar.nn.attention.META_DEVICE`): a context-parallel chunk takes that device's path."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        self.sdpa, self.meta_device, self.lower_right = F.scaled_dot_product_attention, A.META_DEVICE, \
            attention_bias.causal_lower_right
        F.scaled_dot_product_attention, A.META_DEVICE = self._attention, self.device
        # (a CausalBias, a tensor subclass, cannot be made under the trace's dispatch mode: a stand-in says the same)
        attention_bias.causal_lower_right = _LowerRight

    def __exit__(self, *exc):
        F.scaled_dot_product_attention, A.META_DEVICE = self.sdpa, self.meta_device
        attention_bias.causal_lower_right = self.lower_right

    def _attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not q.is_meta:
            return self.sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                             enable_gqa=enable_gqa)
        if isinstance(attn_mask, (CausalBias, _LowerRight)):  # CUDA's lower-right causal bias: a flag, no mask
            attn_mask, is_causal = None, True
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the kernel takes it: additive, q's dtype
            attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=q.dtype, device=q.device),
                                    torch.scalar_tensor(float("-inf"), dtype=q.dtype, device=q.device))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                          attn_mask=attn_mask, scale=scale)[0]


_RUNTIME: list[int] = []


def runtime_bytes() -> int:
    """The resident set of a process that has imported python, torch and funcpar and built nothing: what a rank
    holds on the host before its first tensor (measured once, in a fresh interpreter); with the compiled element-wise
    kernels on (:mod:`funcpar.nn.pointwise`, not ``FUNCPAR_FUSE=off``), after running one (torch.compile's machinery:
    about 90 MB more)."""
    if not _RUNTIME:
        import subprocess
        import sys

        from funcpar.nn import pointwise

        fuse = ("import torch; from funcpar.nn import pointwise as p; p.FUSE = 'on'; torch.set_grad_enabled(False); "
                "p.exp_and_sum(torch.zeros(2, 3), torch.zeros(2)); ") if pointwise.FUSE != "off" else ""
        code = ("import resource, funcpar; " + fuse +
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        _RUNTIME.append(int(out.stdout.split()[-1]))
    return _RUNTIME[0]
