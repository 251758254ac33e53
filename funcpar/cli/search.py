"""Searching the layouts of N devices for the fastest train step that fits (``funcpar plan --devices N``).

A *layout* is a mesh over pp x dp x tp (x cp) with a ZeRO stage, remat on or off, a micro-batch count and, on
pipelines, a schedule. Each is judged by its step traced on meta tensors (:func:`trace_layout`, in bounded time: a
step of many micro-batches at two short counts, a deep model of alike layers at two shallow depths, the figures
extrapolated), priced by :class:`funcpar.cli.timing.Pricing`.

Tracing every layout would take hours for a 7B model, so the search orders them by a *floor* first: the least time
their step can take (:meth:`Search.floor`: its matmuls, kernels and dispatch at the device's rates and its tp and cp
bytes, from four traces of one row through two and three layers per distinct tp x cp shard, over the schedule's
bubble). It judges layouts in that order, each kind (pipeline or not, each ZeRO stage) in turn, and leaves out each
layout whose floor is above both the best few found and the best of its kind, and each one a judged layout covers
(:func:`covers`: a knob set no faster on a layout that fits). ``budget`` seconds bound it. What it leaves out it
counts and says why.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from typing import Any

from funcpar.cli.planning import memory_plan, mib, params_like, trace_plan, traffic_text
from funcpar.cli.timing import seconds
from funcpar.pipeline.schedule import make_schedule
from funcpar.tree import leaves_with_path

__all__ = ["DEPTHS", "trace_layout", "stage_depth", "combine", "candidate_meshes", "micro_counts", "layouts",
           "Search", "covers", "rank_meshes", "print_ranking"]

DEPTHS = (2, 3)  # layers a (virtual) stage is traced at, to extrapolate a deeper model's
SHOWN = 4  # the best layouts the search makes sure of (it prints why each after the first is slower)


# ------------------------------------------------------------------------------------------ one layout's trace


def trace_layout(build, axes: dict[str, int], zero: int, gpu: bool = False, documents: bool | None = None,
                 built: tuple | None = None, **over) -> dict[str, Any]:
    """:func:`funcpar.cli.planning.trace_plan` of the step ``build(axes, zero, **over)`` makes (``(model, cfg,
    step, rows, seq_len)``; ``built``: that tuple, when made already), in bounded time.

    A step of many micro-batches (more than the two short counts ``m1 = 2 pp`` (or the virtual stages, if more; 2 off
    pipelines) and ``m2 = m1 +
    max(pp, 2)`` together) is traced at those counts of the same micro-batch (``build(axes, zero, m)``): a
    pipeline's schedule and an accumulation reach their in-flight micro-batches by then, and what still grows with
    the count is linear in it. A model whose layers are alike (:func:`stage_depth`), with more layers a stage than
    :data:`DEPTHS` together, is traced at those depths a stage (``build(axes, zero, m, d)``): its FLOPs, operators,
    bytes sent and memory are linear in the layers. The traces are combined by :func:`combine` with the weights that
    extrapolate to the step (``extrapolated``: ``{"micro": (m1, m2), "layers": (d1, d2, depth)}``, each where
    used). The row keeps the step's micro-batches (``micro_batches``), rows and sequence length. (A pipeline is
    traced on its first stage, rank 0's: funcpar cuts the stages to equal weights, the head's counted, so the first
    stands for the others.)"""
    built = built or build(axes, zero, **over)
    model, cfg, step, rows, seq_len = built
    m, pp = step.options.accum_steps, axes.get("pp", 1)
    m1 = max(2 * pp, step.executor.plan.V) if pp > 1 else 2  # (an interleaved rank warms up chunks x pp)
    m2 = m1 + max(pp, 2)
    counts = _line(m, m1, m2) if m > m1 + m2 and rows % m == 0 else [(None, 1.0)]
    depth = stage_depth(model, cfg, step)
    half = depth is not None and step.executor is not None and depth % 1 == 0.5 and step.executor.plan.V % 2 == 0
    ds = [d + 0.5 for d in DEPTHS] if half else DEPTHS  # (a stage that ends on half a layer: traced so too)
    depths = _line(depth, *ds) if depth is not None and depth > sum(ds) else [(None, 1.0)]
    try:
        traces = _traces(build, axes, zero, built, counts, depths, gpu, documents, **over)
    except ValueError:  # (a config the shallow copies cannot be made of: traced whole)
        depths = [(None, 1.0)]
        traces = _traces(build, axes, zero, built, counts, depths, gpu, documents, **over)
    how = {**({"micro": (m1, m2)} if counts[0][0] else {}), **({"layers": (*ds, depth)} if depths[0][0] else {})}
    return combine(traces) | {"extrapolated": how, "micro_batches": m, "rows": rows, "seq_len": seq_len,
                              "step": step}


def _traces(build, axes, zero, built, counts, depths, gpu, documents, **over) -> list[tuple[float, dict]]:
    """:func:`trace_layout`'s traces with their weights: one per micro-batch count and depth (None: the step's)."""
    out = []
    for k, wk in counts:
        for d, wd in depths:
            b = built if k is None and d is None else build(axes, zero, k, d, **over)
            out.append((wk * wd, trace_plan(*b[:4], built[4], gpu=gpu, documents=documents)))
    return out


def _line(x: float, a: int, b: int) -> list[tuple[int, float]]:
    """The points ``a``, ``b`` and the weights that extrapolate a line through them to ``x``."""
    return [(a, (b - x) / (b - a)), (b, (x - a) / (b - a))]


def stage_depth(model, cfg, step) -> float | None:
    """The layers each of rank 0's (virtual) stages holds on average (the whole model's off pipelines), where the
    model's layers are alike: the same leaves and shapes, and every per-layer setting of ``cfg`` (a list with an
    entry per layer: ``layer_types``, ...) the same. None where they differ or the model names no layer list: such a
    model is traced whole."""
    name = getattr(model.stages, "layers", None)
    like = params_like(model, cfg) if name is not None else None
    layers = like.get(name) if isinstance(like, dict) else None
    if not isinstance(layers, (list, tuple)) or len(layers) < 2:
        return None
    shapes = {tuple((p, tuple(x.shape), x.dtype) for p, x in leaves_with_path(layer)) for layer in layers}
    lists = [v for v in getattr(cfg, "__dict__", {}).values() if isinstance(v, (list, tuple)) and len(v) == len(layers)]
    if len(shapes) > 1 or any(len({repr(x) for x in v}) > 1 for v in lists):
        return None
    if step.executor is None:
        return float(len(layers))
    plan = step.executor.plan
    units = sum(len(plan.ranges[v]) for v in plan.virtual)
    return units / (2 if plan.first is not None else 1) / len(plan.virtual)


def combine(traces: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """The weighted sum of traces (:func:`funcpar.cli.planning.trace_step`'s dicts), field by field: FLOPs,
    memory, operators and bytes sent; the GPU queue's sequences kept with their weights. The last trace gives the
    rest. A peak extrapolated alone can fall below the step's: it is at least that."""
    out = dict(traces[-1][1])
    for k in ("flops", "state", "step_peak", "peak", "activations"):
        out[k] = sum(w * t[k] for w, t in traces)
        out[k] = out[k] if k == "flops" else round(out[k])
    for k in ("ops", "traffic"):
        out[k] = {key: sum(w * t[k].get(key, 0) for w, t in traces) for key in {x for _, t in traces for x in t[k]}}
    out["sequence"] = [(ops, n, w * v) for w, t in traces for ops, n, v in t["sequence"]]
    out["peak"] = max(out["peak"], out["step_peak"])
    return out


# ------------------------------------------------------------------------------------------ the layouts


def candidate_meshes(devices: int, context: bool = False, pipeline: bool = False) -> list[dict[str, int]]:
    """Every ``dp x tp`` factorisation of ``devices``; with ``context``, every ``dp x cp x tp`` one; with
    ``pipeline``, every ``pp x ...`` one too (a cp or pp axis only where it has more than one rank)."""
    out = []
    for pp in (n for n in range(1, devices + 1) if devices % n == 0 and (pipeline or n == 1)):
        rest = devices // pp
        for tp in (n for n in range(1, rest + 1) if rest % n == 0):
            for cp in (n for n in range(1, rest // tp + 1) if rest // tp % n == 0 and (context or n == 1)):
                out.append({**({"pp": pp} if pp > 1 else {}), "dp": rest // tp // cp, **({"cp": cp} if cp > 1 else {}),
                            "tp": tp})
    return out


def micro_counts(rows: int, pp: int = 1, size: int | None = None) -> list[int]:
    """The micro-batch counts a dp rank's ``rows`` are searched at: ``rows / size`` with a fixed size; off pipelines
    every count that splits them; on ``pp`` stages the counts of ``pp`` times a power of two that split them, and
    ``rows`` (a row a micro-batch), the fewer micro-batches the larger their matmuls, the more the smaller the
    bubble."""
    if size:
        return [rows // size] if rows % size == 0 else []
    splits = [m for m in range(1, rows + 1) if rows % m == 0]
    if pp <= 1:
        return splits
    return [m for m in splits if m >= pp and (m == rows or m % pp == 0 and (m // pp) & (m // pp - 1) == 0)]


def layouts(devices: int, global_batch: int, context: bool = False, pipeline: bool = False, zeros=(1, 2, 3),
            remats=(None,), schedules=(None,), micro_size: int | None = None, search_micro: bool = False
            ) -> list[dict[str, Any]]:
    """Every layout of ``devices`` ranks as a row: ``axes`` (:func:`candidate_meshes`), ``zero`` (of ``zeros``),
    ``remat`` (of ``remats``; None: the command line's), ``schedule`` (on pipelines, of ``schedules``) and ``micro``
    (with ``search_micro``, each of :func:`micro_counts`; else None: the command line's)."""
    out = []
    for axes in candidate_meshes(devices, context, pipeline):
        pp, dp = axes.get("pp", 1), axes["dp"]
        counts = (micro_counts(global_batch // dp, pp, micro_size) or [None]) if search_micro and not \
            global_batch % dp else [None]
        for zero in zeros:
            for remat in remats:
                for schedule in schedules if pp > 1 else (None,):
                    out += [{"axes": axes, "zero": zero, "remat": remat, "schedule": schedule, "micro": m}
                            for m in counts]
    return out


def _over(r: dict[str, Any]) -> dict[str, Any]:
    """A layout row's options over the command line's, as ``build`` takes them."""
    return {k: v for k, v in (("remat", r["remat"]), ("pipeline", r["schedule"]), ("micro_batches", r["micro"]))
            if v is not None}


# ------------------------------------------------------------------------------------------ the search


class Search:
    """Judges layout rows (:func:`layouts`) of ``build(axes, zero, micro=None, layers=None, **over)`` (``(model,
    cfg, step, rows, seq_len)`` of one dp rank, or a ``ValueError`` saying why the layout cannot run) against
    ``memory`` bytes a device, fastest first by ``estimate(row, axes, step)`` when given (:class:`Pricing`, whose
    ``floor`` orders the search; the model's ``layers`` and the ``global_batch`` size the floors). ``gpu``: a plan
    for GPUs (peaks without the host process); ``documents``: as :func:`trace_layout`; ``log``: where a line goes
    after each layout judged (``print`` to stderr, say); ``budget``: seconds after which the search stops
    (counted from the start of :meth:`run`: the floors' traces count, though they are not cut short); ``slots``:
    the optimizer's state tensors a parameter; ``chunks``: an interleaved or zero-bubble pipeline's virtual stages a
    rank, where the command line sets them. ``said`` counts the layouts left out, by why."""

    def __init__(self, build, memory: float, estimate=None, documents: bool | None = None, gpu: bool = False,
                 layers: int | None = None, global_batch: int | None = None, log=None, budget: float = math.inf,
                 slots: int = 2, chunks: int | None = None):
        self.build, self.memory, self.estimate, self.documents, self.gpu = build, memory, estimate, documents, gpu
        self.layers, self.global_batch, self.log, self.budget = layers, global_batch, log, budget
        self.slots, self.chunks = slots, chunks
        self.unjudged_floor = math.inf
        self.said: Counter = Counter()
        self._units: dict[tuple, tuple | None] = {}

    def judge(self, r: dict[str, Any]) -> dict[str, Any]:
        """Build, prune by the state a rank holds between steps (:func:`held`, untraced), else trace
        (:func:`trace_layout`) and price one layout row, in place: ``fits``, ``need`` (its peak, with the host
        runtime on the CPU), ``time``; or ``why`` it is not traced."""
        axes, zero, over = r["axes"], r["zero"], _over(r)
        try:
            built = self.build(axes, zero, **over)
            state = held(*built[:3], zero, self.slots)
            if state > self.memory:  # (pruned before its trace: what it holds between steps is over already)
                r |= {"fits": False, "why": f"does not fit: its parameters, gradients and optimizer state alone take "
                                            f"{mib(state)} a rank (not traced)"}
                return r
            r |= trace_layout(self.build, axes, zero, self.gpu, self.documents, built, **over)
            step = r.pop("step")
            r["need"] = r["peak"] + r["runtime"]
            r["fits"] = r["need"] <= self.memory
            if self.estimate is not None:
                r["time"] = self.estimate(r, axes, step)
        except ValueError as e:
            r |= {"fits": False, "why": str(e)}
        except RuntimeError as e:  # (a path the meta trace cannot follow: shown as that layout's row, not the end)
            r |= {"fits": False, "why": f"not traced on meta tensors: {str(e).splitlines()[0][:150]}"}
        return r

    def floor(self, r: dict[str, Any]) -> float:
        """The least time layout ``r``'s step can take: its matmuls' FLOPs at the device's reached rate, the
        host's dispatch of its layers' operators and their other kernels' bytes (one row's matmuls through its
        stage's layers, per :meth:`_unit`, times a dp rank's rows; the layers' operators and kernels times its
        micro-batches but one, off pipelines, with the embedding and head's matmuls; a pipeline stage's matmuls alone
        (its layers taken half a layer under the mean, the cut's rounding), over its schedule's bubble), plus the tp
        and cp bytes its rows send without remat. 0 where there is nothing to bound it by."""
        axes = r["axes"]
        unit = self._unit(axes.get("tp", 1), axes.get("cp", 1)) if self.layers and self.estimate else None
        if unit is None or not self.global_batch or self.global_batch % axes["dp"]:
            return 0.0
        layer, ends, kernels, calls, sent = unit
        pp, rows, micro = axes.get("pp", 1), self.global_batch // axes["dp"], r["micro"] or 1
        depth = self.layers / pp if pp == 1 else max(self.layers / pp - 0.5, 0.0)  # (a cut within half a layer)
        ops = {k: rows * n * depth + (rows * ends.get(k, 0) if pp == 1 else 0) for k, n in layer.items()}
        traffic = {a: rows * max(n * depth + (end if pp == 1 else 0), 0.0) for a, (n, end) in sent.items()}
        bubble = 0.0
        if pp > 1 and r["schedule"] and r["micro"]:
            bubble = _bubble(r["schedule"], pp, r["micro"], self.chunks or (2 if r["schedule"] == "interleaved" else 1))
            if bubble is None:
                return 0.0  # (a schedule these counts cannot make: its build says why)
        if pp > 1:  # (a stage's per-micro-batch work is not an accumulation's: its matmuls alone bound it)
            kernels, calls = {}, 0.0
        # (the unit's per-micro-batch work holds an accumulation's add, which the first micro-batch skips)
        return self.estimate.floor([{k: max(n, 0.0) for k, n in ops.items()},
                                    {k: (micro - 1) * depth * n for k, n in kernels.items()}],
                                   (micro - 1) * depth * calls, axes, bubble, traffic)

    def _unit(self, tp: int, cp: int) -> tuple | None:
        """One row's matmuls (:func:`funcpar.cli.timing.op_key` -> calls) per layer and the embedding and head's,
        the other kernels a layer runs per micro-batch (of one row: a micro-batch of more moves more bytes) and
        all its operators, and one row's bytes sent by axis (tp, cp) per layer and besides, on a tp x cp shard:
        traces of one and two micro-batches of a row through :data:`DEPTHS` layers, once per shard shape (the
        optimizer's operators, once a step and fewer where ZeRO flattens the state, cancel out)."""
        key = (tp, cp)
        if key not in self._units:
            axes = {"dp": 1, **({"cp": cp} if cp > 1 else {}), "tp": tp}
            try:
                (a, ta), (b, tb), (c, _), (d, _) = [
                    (t["ops"], t["traffic"]) for t in (trace_plan(*self.build(
                        axes, 0, m, k, micro_batches=self.global_batch, remat=False), gpu=self.gpu,
                        documents=self.documents) for m in (1, 2) for k in DEPTHS)]
            except (ValueError, RuntimeError):
                self._units[key] = None
                return None
            step = DEPTHS[1] - DEPTHS[0]
            mm = {k for k in (*a, *b) if k[0] in ("mm", "attention")}
            per = {k: (b.get(k, 0) - a.get(k, 0)) / step for k in mm}
            calls = (sum(d.values()) - sum(c.values()) - sum(b.values()) + sum(a.values())) / step
            kernels = {k: (d.get(k, 0) - c.get(k, 0) - b.get(k, 0) + a.get(k, 0)) / step
                       for k in {*a, *b, *c, *d} if k[0] == "kernel"}  # (one row's a micro-batch: a floor)
            per_sent = {x: (tb.get(x, 0) - ta.get(x, 0)) / step for x in {*ta, *tb}}
            sent = {x: (n, ta.get(x, 0) - DEPTHS[0] * n) for x, n in per_sent.items()}
            self._units[key] = (per, {k: a.get(k, 0) - DEPTHS[0] * per[k] for k in mm}, kernels, max(calls, 0.0),
                                sent)
        return self._units[key]

    def run(self, rows: list[dict[str, Any]], shown: int = SHOWN) -> list[dict[str, Any]]:
        """Judge ``rows`` in order of their floors (each kind in turn: :func:`_round_robin`) and return the judged
        ones, fits first, fastest (else fewest bytes sent, then lowest peak) first. Left out (counted in
        ``said``): a layout whose floor is above both the ``shown``-th best time found and the best of its kind
        (pipeline or not, its ZeRO stage: ``floor``); one a judged layout of the same mesh covers (:func:`covers`:
        ``covered``); once the search has taken ``budget`` seconds (the floors' traces counted, though they run to
        the end, and the layout being judged finishes; one layout is judged at least), the rest (``budget``;
        ``self.unjudged_floor``: the lowest floor among them, so the answer is known best where it is above the best
        time found)."""
        start = time.perf_counter()
        for r in rows:
            r["floor"] = self.floor(r)
        out, times, by_mesh, best = [], [], {}, {}
        for r in _round_robin(sorted(rows, key=_order)):
            if any(covers(a, r, self.estimate is not None) for a in by_mesh.get(_mesh(r), ())):
                self.said["covered"] += 1
                continue
            kind = _kind(r)
            cut = max(sorted(times)[shown - 1] if len(times) >= shown else math.inf, best.get(kind, math.inf))
            if r["floor"] > cut:
                self.said["floor"] += 1
                continue
            if out and time.perf_counter() - start > self.budget:  # (one judged at least)
                self.said["budget"] += 1
                self.unjudged_floor = min(self.unjudged_floor, r["floor"])
                continue
            t = time.perf_counter()
            out.append(self.judge(r))
            by_mesh.setdefault(_mesh(r), []).append(r)
            if self.log:  # (a long search says where it is)
                est = f" (a step {seconds(r['time']['step'])}, at least {seconds(r['floor'])})" if "time" in r else ""
                self.log(f"plan: {len(out)} judged, {sum(self.said.values())} left out; {_label(r)}: "
                         f"{'fits' if r['fits'] else r.get('why', 'over the memory')[:60]}{est}, "
                         f"{seconds(time.perf_counter() - t)} to trace")
            if r["fits"] and "time" in r:
                times.append(r["time"]["step"])
                best[kind] = min(best.get(kind, math.inf), r["time"]["step"])
        return sorted(out, key=lambda r: (not r["fits"], "why" in r, r["time"]["step"] if "time" in r else 0,
                                          sum(r.get("traffic", {}).values()), r.get("need", 0)))


# the knobs that trade time for memory, each value no faster than the one before it on the same layout otherwise
# (tests/test_search.py checks each on traced steps): ZeRO 1 before 2 before 3 (gathers, per-micro-batch reductions);
# remat off before on; off pipelines fewer micro-batches before more; 1F1B before GPipe (the same work and bubble,
# more in flight). ZeRO 0 holds more than 1 but is not always slower (it skips the flattening: a host-bound step can
# gain), so it is judged after 1 and skipped only where 1 does not fit.
_ZERO_ORDER = {1: 0, 2: 1, 3: 2, 0: 3}
_SCHEDULE_ORDER = {"1f1b": 0, "gpipe": 1}


@functools.lru_cache(maxsize=4096)
def _bubble(schedule: str, pp: int, micro: int, chunks: int) -> float | None:
    """The share of a step ``schedule``'s stages idle at these counts (its simulation), None where it cannot be
    made: one simulation per distinct schedule, not per layout (thousands of layouts share a few hundred)."""
    try:
        return make_schedule(schedule, pp, micro, chunks).simulate()["bubble"]
    except ValueError:
        return None


def _kind(r: dict[str, Any]) -> tuple[bool, int]:
    """A layout's kind, as the search and the table take turns and keep bests by: pipeline or not, its ZeRO stage."""
    return r["axes"].get("pp", 1) > 1, r["zero"]


def _round_robin(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (in floor order) taken in turn from each kind (pipeline or not, each ZeRO stage), each kind in its
    own order: floors are looser on some kinds than on others, and a time limit should reach every kind's best."""
    kinds: dict[tuple, list] = {}
    for r in rows:
        kinds.setdefault(_kind(r), []).append(r)
    turns = [iter(k) for k in kinds.values()]
    out = []
    while turns:
        for it in list(turns):
            r = next(it, None)
            if r is None:
                turns.remove(it)
            else:
                out.append(r)
    return out


def _order(r: dict[str, Any]) -> tuple:
    """The search's order: by floor, then each knob's faster value first (so a layout's coverer comes first)."""
    return (r["floor"], r["micro"] or 0, _SCHEDULE_ORDER.get(r["schedule"], 2), str(r["schedule"]),
            _ZERO_ORDER[r["zero"]], bool(r["remat"]))


def covers(a: dict[str, Any], b: dict[str, Any], timed: bool = True) -> bool:
    """Whether judged layout ``a`` makes judging ``b`` (the same mesh) pointless: ``a`` fits and ``b`` differs only
    by knobs set to values no faster (ZeRO 1 -> 2 -> 3; remat on; off pipelines more micro-batches; GPipe for
    1F1B); or ``a`` does not fit and ``b`` differs only by knobs that hold more (ZeRO 0 for 1, GPipe for 1F1B).
    Not ``timed`` (no estimate: the layouts rank by bytes sent, then peak), only the second."""
    if "why" in a or a is b or a["axes"] != b["axes"] or a["fits"] and not timed:
        return False
    pp = a["axes"].get("pp", 1) > 1
    schedule = a["schedule"] == b["schedule"] or (a["schedule"], b["schedule"]) == ("1f1b", "gpipe")
    if a["fits"] and timed:
        zero = a["zero"] == b["zero"] or (a["zero"], b["zero"]) in {(1, 2), (1, 3), (2, 3)}
        micro = a["micro"] == b["micro"] if pp else (a["micro"] or 0) <= (b["micro"] or 0)
        return schedule and zero and micro and bool(a["remat"]) <= bool(b["remat"])
    zero = a["zero"] == b["zero"] or (a["zero"], b["zero"]) == (1, 0)
    return schedule and zero and a["micro"] == b["micro"] and a["remat"] == b["remat"]


def held(model, cfg, step, zero: int, slots: int = 2) -> float:
    """Bytes a rank of ``step`` holds between steps at least (:func:`memory_plan` of its stage, float32 state of
    ``slots`` tensors a parameter: AdamW's two): a layout over ``--memory`` by this alone is pruned untraced."""
    like = params_like(model, cfg)
    stage = like if step.executor is None else step.executor.plan.select(like)
    return memory_plan(stage, step.specs, step.mesh, zero, slots)["total"] * 2**20


def rank_meshes(build, devices: int, memory: float, zeros=(1, 2, 3), context: bool = False, estimate=None,
                documents: bool | None = None, pipeline: bool = False, gpu: bool = False, **space) -> list[dict]:
    """The layouts of ``devices`` ranks (:func:`layouts`: with ``context``, cp axes too; with ``pipeline``, pp
    axes; ``space``: its ``remats``, ``schedules``, ``micro_size`` and ``search_micro``) judged by a
    :class:`Search` (``build``, ``memory``, ``estimate``, and from ``space`` the model's ``layers``, the
    ``global_batch``, ``log``, ``budget``, ``slots`` and ``chunks``: as there), fits first, fastest first. Every
    row keeps the search's counts of what it left out, by why, as ``said`` (and ``unjudged_floor``:
    :meth:`Search.run`)."""
    knobs = {k: space.pop(k, d) for k, d in (("layers", None), ("global_batch", None), ("log", None),
                                             ("budget", math.inf), ("slots", 2), ("chunks", None))}
    search = Search(build, memory, estimate, documents, gpu, **knobs)
    rows = layouts(devices, knobs["global_batch"] or devices, context, pipeline, zeros, **space)
    out = search.run(rows)
    for r in out:
        r["said"], r["unjudged_floor"] = search.said, search.unjudged_floor
    return out


def _mesh(r: dict[str, Any]) -> str:
    return ",".join(f"{a}={n}" for a, n in r["axes"].items())


# ------------------------------------------------------------------------------------------ the table


def print_ranking(rows: list[dict[str, Any]], devices: int, memory: float, shown: int = 8) -> None:
    """:func:`rank_meshes`'s rows as a table: the ``shown`` fastest layouts that fit (each with its estimated step
    and samples a second, when timed) and the fastest of each kind not among them (pipeline or not, each ZeRO
    stage), layouts alike in every figure but the ZeRO stage once (the first in the order); then why each of the
    next three is slower than the first (:func:`_why_slower`), what did not fit, why layouts could not run, and
    what the search left out untraced."""
    timed = any("time" in r for r in rows)
    fits, seen = [], set()
    for r in (r for r in rows if r["fits"]):
        same = (_mesh(r), r["remat"], r["schedule"], r["micro_batches"], r["need"], sum(r["traffic"].values()),
                round(r["time"]["step"], 12) if timed else 0)
        if same not in seen:
            seen.add(same)
            fits.append(r)
    kinds = {}
    for r in fits:
        kinds.setdefault(_kind(r), r)
    table = fits[:shown] + [r for r in kinds.values() if r not in fits[:shown]]
    order = "fastest by the estimate first" if timed else "fewest bytes sent first"
    print(f"layouts of {devices} devices with {memory / 2**30:g} GiB each that fit ({order}):")
    print(f"{'mesh':<18} {'zero':>4} {'remat':>5} {'micro':>5} {'schedule':<11} {'peak/rank':>10} "
          f"{'activations':>11}  {'sends per step':<30}" + ("  est. step  samples/s" if timed else ""))
    for r in table:
        print(_table_row(r))
    if not table:
        judged = "of those judged " if rows and rows[0].get("said", {}).get("budget") else ""
        print(f"(no layout {judged}fits in {memory / 2**30:g} GiB a device: see what did not fit, below)")
    if timed and fits:
        print("the estimate, for the first: " + fits[0]["time"]["assumptions"])
        for r in fits[1:4]:
            print(f"  {_label(r)}: {_why_slower(fits[0], r)}")
    _print_left_out(rows, len(rows) - len(table))


def _table_row(r: dict[str, Any]) -> str:
    pp = r["axes"].get("pp", 1) > 1
    need = ("~" if r["eager_trace"] else "") + mib(r["need"])  # (a compiled step: its eager trace's figure)
    remat = "-" if r["remat"] is None else ("yes" if r["remat"] else "no")
    acts = "-" if pp else mib(r["activations"])  # (a pipeline's: in flight by its schedule, in the peak)
    est = f"  {seconds(r['time']['step']):>9}  {_samples(r):>9,.2f}" if "time" in r else ""
    schedule = (r["schedule"] or "-") if pp else "-"
    return (f"{_mesh(r):<18} {r['zero']:>4} {remat:>5} {r['micro_batches']:>5} {schedule:<11} "
            f"{need:>10} {acts:>11}  {traffic_text(r['traffic']):<30}{est}")


def _print_left_out(rows: list[dict[str, Any]], others: int) -> None:
    """The layouts that did not fit (the three nearest), why others could not run (each reason once), and the
    search's counts of what it left out untraced."""
    over = sorted((r for r in rows if not r["fits"] and "why" not in r), key=lambda r: r["need"])
    if over:
        print(f"traced but over the memory: {len(over)} layouts; the nearest: "
              + "; ".join(f"{_label(r)} peak {mib(r['need'])}" for r in over[:3]))
    reasons: dict[str, list[str]] = {}
    for r in (r for r in rows if "why" in r):
        reasons.setdefault(r["why"], []).append(_label(r))
    for why, where in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        print(f"not run ({len(where)} layout{'s' * (len(where) > 1)}, e.g. {where[0]}): {why}")
    said = rows[0].get("said", {}) if rows else {}
    if said.get("budget"):
        best = min((r["time"]["step"] for r in rows if r["fits"] and "time" in r), default=math.inf)
        known = "so the first above is the fastest" if rows[0]["unjudged_floor"] >= best else "some may be faster"
        print(f"the time limit (--search-seconds) left {said['budget']} layouts unjudged; none could take less than "
              f"{seconds(rows[0]['unjudged_floor'])} a step ({known})")
    if said:
        print(f"searched {sum(said.values()) + len(rows)} layouts: {len(rows)} judged ({others} not shown above), "
              f"{said.get('floor', 0)} left out untraced because their floor (their matmuls, kernels, dispatch and "
              f"tp/cp bytes at the device's rates) is above the best found, {said.get('covered', 0)} because a "
              f"judged layout of their mesh covers them (it fits and "
              f"they differ only by settings no faster: a higher ZeRO stage, remat, more micro-batches off pipelines, "
              f"GPipe for 1F1B; or it does not fit and they hold more)"
              + (f", {said['budget']} by the time limit" if said.get("budget") else ""))


def _label(r: dict[str, Any]) -> str:
    pp = r["axes"].get("pp", 1) > 1
    m = r.get("micro_batches") or r.get("micro")
    return (f"{_mesh(r)} zero={r['zero']}" + (f" {r['schedule']}" if pp and r["schedule"] else "")
            + (f" m={m}" if m else "") + (" remat" if r.get("remat") else ""))


def _samples(r: dict[str, Any]) -> float:
    """A ranked row's samples (rows of its sequence length) a second, the whole job's."""
    return r["rows"] * r["axes"].get("dp", 1) / r["time"]["step"]


def _why_slower(first: dict[str, Any], r: dict[str, Any]) -> str:
    """Where ``r``'s estimated step spends the time ``first``'s does not: its parts (compute, each axis's
    communication) against the first's, the largest first."""
    def parts(x):
        return {"compute": x["time"]["compute"], **{f"{a} communication": t for a, t in x["time"]["comm"].items()}}
    mine, best = parts(r), parts(first)
    more = sorted(((mine.get(k, 0) - best.get(k, 0), k) for k in {*mine, *best}), reverse=True)
    said = ", ".join(f"{k} {'+' if d >= 0 else '-'}{seconds(abs(d))}" for d, k in more
                     if abs(d) > 1e-3 * r["time"]["step"])
    return f"{r['time']['step'] / first['time']['step']:.2f}x the first's step ({said or 'the same parts'})"
