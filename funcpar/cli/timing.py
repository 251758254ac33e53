"""A train step's time on paper: each traced operator on a device's roofline, each mesh axis's bytes over its link,
a pipeline's bubble by its schedule.

:class:`funcpar.cli.planning.MemoryTrace` tallies the operators of a step traced on meta tensors by what costs time:
their kind (a matmul, fused attention, any other kernel, a view), their floating-point operations and the bytes they
read and write (:func:`op_key`). :func:`step_seconds` prices that tally on a :class:`Device`:

- a matmul takes ``max(FLOPs / (peak x ceiling), bytes / (bandwidth x streaming))`` (the roofline: small or thin
  matmuls are bound by memory, large ones by the tensor cores' reached rate);
- fused attention the same with its own share of the peak (``attention``); any other kernel its bytes over the
  reached bandwidth; every kernel at least ``launch``;
- on a GPU the host queues kernels while they run (``dispatch`` seconds per operator, views included), so the step
  ends when the queue of its operators, in their traced order, does (:func:`queue`); on the CPU the two are one
  thread and add up.

Each constant says where it comes from (:data:`DEVICES`, :data:`GPU_REACHED`); benchmarks/time_model.py checks the
model against every measured step the repository holds and prints the error at each.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from funcpar.parallel.mesh import STANDARD_AXES

HALF = (torch.bfloat16, torch.float16)
SYNC = ("sync", False, 0.0, 0)  # in a traced sequence: the host reads a value back and waits for the device


def op_key(func, args, kwargs, out, flops: float) -> tuple[str, bool, float, int]:
    """One operator call's cost as :func:`step_seconds` prices it: ``(kind, half, flops, bytes)``. ``kind``: ``mm``
    (torch counts its FLOPs and it is not attention), ``attention``, ``view`` (aliases its input: no kernel) or
    ``kernel``; ``half``: its first tensor is bf16/fp16 (the tensor cores' rate); ``bytes``: the elements of every
    tensor it reads and writes (a view: 0)."""
    name = str(func.overloadpacket)
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    for x in args:
        if isinstance(x, (list, tuple)):
            tensors += [y for y in x if isinstance(y, torch.Tensor)]
    half = bool(tensors) and tensors[0].dtype in HALF
    if getattr(func, "is_view", False):
        return "view", half, 0.0, 0
    outs = [x for x in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(x, torch.Tensor)]
    nbytes = sum(x.numel() * x.element_size() for x in (*tensors, *outs))
    kind = "attention" if "attention" in name else ("mm" if flops else "kernel")
    return kind, half, float(flops), int(nbytes)


@dataclass(frozen=True)
class Device:
    """What :func:`step_seconds` needs of a device: its datasheet (``flops``: dense matmul FLOP/s for ``half`` and
    ``fp32`` operands; ``bandwidth``: memory bytes/s; ``memory``: bytes) and the shares of it a step reaches
    (``ceiling``: a large matmul's, by the same keys; ``attention``: a fused attention kernel's share of the half
    rate; ``streaming``: an element-wise kernel's share of the bandwidth), with the fixed costs of an operator
    (``launch``: a kernel's least device time; ``dispatch``: the host's time to issue one eagerly). ``synchronous``:
    the host computes too (the CPU), so the host's and the kernels' times add. ``sources``: where each figure comes
    from, in words."""

    name: str
    flops: dict[str, float]
    bandwidth: float
    memory: float
    ceiling: dict[str, float]
    attention: float
    streaming: float
    launch: float
    dispatch: float
    synchronous: bool = False
    sources: str = ""


# A GPU's reached shares, measured on the H200 funcpar ran on (benchmarks/gpu/RESULTS-*.md, 2026-11-26): its matmul
# peak (8192^2 matmuls) 803 of 989 TFLOP/s in bf16 and 51.2 of 67 in fp32. The attention share is FlashAttention-2's
# (Dao 2023: its forward reaches 50-73% of an A100's peak, its backward less): 0.5. Streaming at 80% of the HBM
# datasheet is what a copy kernel reaches. ``launch`` and ``dispatch`` were fitted on the same H200's small-Llama fp32
# step (0.023 s: thousands of small kernels, bound by the host) and its 0.87B bf16 step (0.136 s eager), by
# benchmarks/time_model.py; the A100's are assumed the same (no A100 measurement here).
GPU_REACHED = dict(ceiling={"half": 803 / 989, "fp32": 51.2 / 67}, attention=0.5, streaming=0.8, launch=3e-6,
                   dispatch=9e-6)
_GPU_SOURCE = ("datasheet rates; reached shares measured on an H200 (benchmarks/gpu/RESULTS-*.md) and fitted by "
               "benchmarks/time_model.py")
DEVICES = {
    "h100": Device("NVIDIA H100 SXM", {"half": 989e12, "fp32": 67e12}, 3.35e12, 80 * 2**30, **GPU_REACHED,
                   sources=_GPU_SOURCE),
    "h200": Device("NVIDIA H200 SXM", {"half": 989e12, "fp32": 67e12}, 4.8e12, 141e9, **GPU_REACHED,
                   sources=_GPU_SOURCE),
    "a100": Device("NVIDIA A100 SXM 80GB", {"half": 312e12, "fp32": 19.5e12}, 2.039e12, 80 * 2**30, **GPU_REACHED,
                   sources=_GPU_SOURCE),
    "a100-40g": Device("NVIDIA A100 SXM 40GB", {"half": 312e12, "fp32": 19.5e12}, 1.555e12, 40 * 2**30,
                       **GPU_REACHED, sources=_GPU_SOURCE),
}
# Bytes per second one GPU sends over a link in a collective: what NCCL reaches (its bus bandwidth), not the
# datasheet (NVLink 4: 450 GB/s a direction, ~360 reached; NVLink 3, an A100's: 300, ~240 reached; a 400 Gb/s NIC
# per GPU: 50 GB/s, ~45 reached); ``loopback``: gloo between processes of one host (fitted on this machine's dp=2
# step by benchmarks/time_model.py).
LINKS = {"nvlink": 360e9, "nvlink3": 240e9, "ib400": 45e9, "ib200": 22e9, "eth100": 11e9, "loopback": 1.5e9}
DEFAULT_LINKS = {"a100": ("nvlink3", "ib200"), "a100-40g": ("nvlink3", "ib200")}  # else ("nvlink", "ib400")

# The host's own rates, measured once per process (:func:`host_device`): one thread's matmul rate and copy bandwidth.
# ``ceiling`` is 1 (the measured rate is already what a large matmul reaches); the fixed cost of an eager operator
# on the host and the share of the measured matmul rate a step's matmuls reach were fitted on this machine's steps
# of the benchmarks' small Llama (benchmarks/time_model.py).
CPU_REACHED = dict(ceiling={"half": 0.25, "fp32": 0.85}, attention=0.5, streaming=1.0, launch=0.0, dispatch=25e-6,
                   synchronous=True)
_HOST: list[Device] = []


def host_device(threads: int = 1) -> Device:
    """This machine's CPU as a :class:`Device` for ``threads`` threads: one thread's fp32 matmul rate (1024^2
    matmuls) and copy bandwidth, measured once (about a second), times ``threads`` (at most the cores)."""
    if not _HOST:
        was = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            pin_host(_measure_matmul(), _measure_copy(), "measured here (funcpar.cli.timing.host_device)")
        finally:
            torch.set_num_threads(was)
    one, n = _HOST[0], max(1, min(threads, os.cpu_count() or 1))
    return replace(one, name=f"this machine's CPU ({n} thread{'s' * (n > 1)})",
                   flops={k: v * n for k, v in one.flops.items()}, bandwidth=one.bandwidth * n)


def pin_host(flops: float, bandwidth: float | None = None, sources: str = "pinned by the caller") -> None:
    """Set one thread's matmul rate (and copy bandwidth; default: measured) instead of measuring them: a benchmark
    prices its steps at the rates it measured beside them."""
    _HOST.clear()
    _HOST.append(Device("this machine's CPU (1 thread)", {"half": flops, "fp32": flops},
                        bandwidth or _measure_copy(), float("inf"), **CPU_REACHED, sources=sources))


def _measure_matmul(n: int = 1024, seconds: float = 0.4) -> float:
    a = torch.randn(n, n)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _measure_copy(n: int = 1 << 24, seconds: float = 0.3) -> float:
    a, b = torch.ones(n), torch.empty(n)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


def operator_seconds(kind: str, half: bool, flops: float, nbytes: int, dev: Device) -> float:
    """One operator's device time on ``dev`` (:func:`op_key`'s fields), without the host's dispatch."""
    if kind == "view":
        return 0.0
    rate = dev.flops["half" if half else "fp32"]
    memory = nbytes / (dev.bandwidth * dev.streaming)
    if kind == "mm":
        return max(flops / (rate * dev.ceiling["half" if half else "fp32"]), memory, dev.launch)
    if kind == "attention":
        return max(flops / (rate * dev.attention), memory, dev.launch)
    return max(memory, dev.launch)


def queue(sequence: list[tuple], dev: Device) -> float:
    """When a GPU finishes ``sequence`` (:func:`op_key`s in the order the host issues them): the host issues one
    every ``dispatch`` seconds, the device runs each from when it is issued or the last one ends, whichever is
    later; at a :data:`SYNC` the host waits for the device. A long matmul lets the host run ahead and hide the
    small kernels after it; a run of small kernels waits on the host."""
    issued = done = 0.0
    cost: dict[tuple, float] = {}
    for key in sequence:
        if key is SYNC:
            issued = max(issued, done)
            continue
        t = cost.get(key)
        if t is None:
            t = cost[key] = operator_seconds(*key, dev)
        issued += dev.dispatch
        done = max(done, issued) + t
    return done


def compute_seconds(ops: dict[tuple, int], dev: Device, share: float = 1.0, sequence: tuple | None = None
                    ) -> dict[str, float]:
    """A traced tally of operators (:class:`~funcpar.cli.planning.MemoryTrace`'s ``ops``: :func:`op_key` -> calls)
    priced on ``dev``: ``device`` and ``host`` seconds, by kind too (``mm``, ``attention``, ``kernel``), and the
    step's compute ``seconds``: on a synchronous device their sum; on a GPU, where the host queues kernels ahead,
    the end of the ``sequence``'s queue (:func:`queue`: ``[(operators in order, steps, weight)]``, one trace's, or
    several traces' and the weights that extrapolate from them: :func:`~funcpar.cli.search.trace_layout`), else the
    longer of the two.
    ``share``: the part of the device this rank gets (ranks of one host sharing its cores: cores / ranks)."""
    by_kind: dict[str, float] = {}
    host = 0.0
    for (kind, half, flops, nbytes), n in ops.items():
        by_kind[kind] = by_kind.get(kind, 0.0) + n * operator_seconds(kind, half, flops, nbytes, dev) / share
        host += n * dev.dispatch / (share if dev.synchronous else 1.0)
    device = sum(by_kind.values())
    if dev.synchronous:
        seconds = device + host
    elif sequence:
        seconds = sum(w * queue(ops_in_order, dev) / steps for ops_in_order, steps, w in sequence)
    else:
        seconds = max(device, host)
    return {"device": device, "host": host, **by_kind, "seconds": seconds}


def comm_seconds(traffic: dict[str, float], axes: dict[str, int], links: tuple[str, str],
                 gpus_per_node: int) -> dict[str, tuple[float, str]]:
    """Each mesh axis's bytes a step (``traffic``) over the link it crosses: within a node when the axis and the axes
    inside it (in the mesh's order) span at most ``gpus_per_node`` ranks, else between nodes. Returns seconds and the
    link by axis."""
    order = [a for a in ("pp", "dp", *[a for a in axes if a not in STANDARD_AXES], "cp", "ep", "tp") if a in axes]
    out = {}
    for i, a in enumerate(order):
        span = math.prod(axes[b] for b in order[i:])
        link = links[0] if span <= gpus_per_node else links[1]
        if traffic.get(a):
            out[a] = (traffic[a] / LINKS[link], link)
    return out


def step_seconds(row: dict[str, Any], axes: dict[str, int], dev: Device, links: tuple[str, str],
                 gpus_per_node: int = 8, bubble: float = 0.0, share: float = 1.0) -> dict[str, Any]:
    """A step's seconds on a mesh of ``dev`` from a plan ``row`` (:func:`~funcpar.cli.planning.trace_plan`: its
    operator tally ``ops`` and bytes sent by axis, ``traffic``): the compute (:func:`compute_seconds`), stretched by
    a pipeline's ``bubble`` (the share of the step a stage idles: its schedule's), plus each axis's communication
    (:func:`comm_seconds`), not overlapped (funcpar overlaps only tp's backward all-reduce with the weight
    gradients, a small part). Returns ``compute``, ``comm`` by axis, their sum ``step``, the compute's parts
    (``parts``) and the assumptions in words (``assumptions``)."""
    parts = compute_seconds(row["ops"], dev, share, row.get("sequence"))
    compute = parts["seconds"] / (1 - bubble)
    comm = comm_seconds(row["traffic"], axes, links, gpus_per_node)
    step = compute + sum(t for t, _ in comm.values())
    bound = ("host and device in turn" if dev.synchronous else
             "host-bound" if parts["host"] > parts["device"] else "device-bound")
    said = (f"{dev.name}: matmuls at {dev.ceiling['half']:.0%} of {dev.flops['half'] / 1e12:,.3g} TFLOP/s (half) or "
            f"{dev.ceiling['fp32']:.0%} of {dev.flops['fp32'] / 1e12:,.3g} (fp32), attention at {dev.attention:.0%}, "
            f"other kernels at {dev.streaming:.0%} of {dev.bandwidth / 1e9:,.0f} GB/s, {dev.dispatch * 1e6:.0f} µs "
            f"of host time an operator ({bound})"
            + (f", {share:.2g} of it per rank" if share < 1 else "")
            + "".join(f", {a} over {link} at {LINKS[link] / 1e9:g} GB/s" for a, (_, link) in comm.items())
            + (f"; {gpus_per_node} devices a node" if comm else "") + "; no overlap of compute and communication"
            + (f"; the pipeline idles {bubble:.0%} of the step (its schedule's bubble)" if bubble else ""))
    return {"compute": compute, "comm": {a: t for a, (t, _) in comm.items()}, "step": step, "parts": parts,
            "assumptions": said}


def least_seconds(ops: dict[tuple, float], dev: Device, share: float = 1.0) -> float:
    """The least time a tally of operators (:func:`compute_seconds`'s ``ops``) takes on ``dev``: each matmul's and
    fused attention's FLOPs at the rate it reaches, each other kernel's bytes at the reached bandwidth.
    :func:`operator_seconds` never prices one lower, so it bounds a step's compute from below: what the layout search
    orders layouts by before tracing them. A tally may hold negative counts (a difference of traces): the sum is
    then at least 0."""
    out = 0.0
    for (kind, half, flops, nbytes), n in ops.items():
        if kind in ("mm", "attention"):
            share_of_peak = dev.ceiling["half" if half else "fp32"] if kind == "mm" else dev.attention
            out += n * flops / (dev.flops["half" if half else "fp32"] * share_of_peak)
        elif kind == "kernel":
            out += n * nbytes / (dev.bandwidth * dev.streaming)
    return max(out, 0.0) / share


def pipeline_bubble(step) -> float:
    """The share of ``step`` its pipeline stages idle (its schedule's simulation), 0 off pipelines."""
    return step.executor.plan.schedule.simulate()["bubble"] if getattr(step, "executor", None) else 0.0


@dataclass(frozen=True)
class Pricing:
    """How ``funcpar plan`` prices a traced step: on ``dev`` (:data:`DEVICES`, or :func:`host_device`), each axis's
    bytes over ``links`` (within a node, between nodes) with ``gpus_per_node``. ``host``: the mesh's ranks are
    processes of this one machine, sharing its cores (each rank ``threads`` threads)."""

    dev: Device
    links: tuple[str, str]
    gpus_per_node: int = 8
    host: bool = False
    threads: int = 1

    def share(self, axes: dict[str, int]) -> float:
        """The part of the device one rank of ``axes`` gets: all of a GPU; of the host, its cores over the ranks'
        threads (at most 1)."""
        if not self.host:
            return 1.0
        cores = os.cpu_count() or 1
        return min(1.0, cores / ((math.prod(axes.values()) or 1) * min(self.threads, cores)))

    def __call__(self, row: dict[str, Any], axes: dict[str, int], step=None) -> dict[str, Any]:
        """:func:`step_seconds` of a traced ``row`` of the mesh ``axes`` (``step``: its pipeline's bubble)."""
        nodes = self.gpus_per_node if not self.host else math.prod(axes.values()) or 1  # (a host: one node)
        return step_seconds(row, axes, self.dev, self.links, nodes, pipeline_bubble(step), self.share(axes))

    def floor(self, ops: list[dict[tuple, float]], calls: float, axes: dict[str, int], bubble: float = 0.0,
              traffic: dict[str, float] | None = None) -> float:
        """The least time of a step whose operators include the tallies ``ops`` (each priced by
        :func:`least_seconds`) among ``calls`` operators (each costs the host its ``dispatch``: on the CPU besides
        the kernels, on a GPU while they run), stretched by a pipeline's ``bubble``, and which sends at least
        ``traffic`` (bytes by axis, over their links)."""
        share, dev = self.share(axes), self.dev
        kernels = sum(least_seconds(part, dev, share) for part in ops)
        host = calls * dev.dispatch / (share if dev.synchronous else 1.0)
        nodes = self.gpus_per_node if not self.host else math.prod(axes.values()) or 1
        comm = sum(t for t, _ in comm_seconds(traffic or {}, axes, self.links, nodes).values())
        return (kernels + host if dev.synchronous else max(kernels, host)) / (1 - bubble) + comm


def seconds(s: float) -> str:
    """A duration with three significant figures: ``1.23 s``, ``0.156 s``, ``12.3 ms``, ``45.6 µs``."""
    if s >= 0.1 or s <= 0:
        return f"{s:.3g} s" if s < 100 else f"{s:,.0f} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-4 else f"{s * 1e6:.3g} µs"
