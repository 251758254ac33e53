"""Pipeline-parallel plans as data: which layers each stage holds, and the order in which each rank runs them.

A model's blocks (or their halves) are cut into contiguous *virtual stages* ``0 .. V-1`` (:func:`assign_units`;
:func:`assign_layers` is its even split of whole layers). The ``pp`` ranks of
the mesh axis ``pp`` hold them round-robin: with ``chunks`` virtual stages per rank, rank ``r`` holds virtual stages
``r, r + pp, r + 2 pp, ...``; its ``c``-th one (its *chunk* ``c``) is virtual stage ``v = c * pp + r``. Without
interleaving ``chunks == 1`` and virtual stage = rank. The global batch of a step is split into ``n_micro``
micro-batches, and every micro-batch ``m`` passes every virtual stage forward (``F``) and backward (``B``):

* ``F(m, v)`` needs ``F(m, v-1)`` done (its input activation; nothing for ``v == 0``, which reads the batch);
* ``B(m, v)`` needs ``F(m, v)`` done on its own rank (its saved activations) and ``B(m, v+1)`` done (the gradient
  of its output; for the last virtual stage, which computes the loss, only its own forward).

A :class:`Schedule` lists, per rank, the :class:`Action` s that rank runs, strictly in that order, one at a time.
The schedules differ in how many activations a rank keeps (``F`` run, ``B`` not yet) and in the *bubble*, the share
of rank-time spent waiting: GPipe runs every forward and then every backward (memory grows with ``n_micro``);
1F1B starts backwards as early as it can and so keeps at most ``pp`` micro-batches in flight; interleaved 1F1B
gives each rank several thin chunks so the pipeline fills and drains in smaller steps and the bubble shrinks.

This module only plans. :meth:`Schedule.validate` checks a plan is complete and well ordered,
:meth:`Schedule.simulate` runs it as a discrete-event simulation (zero communication latency) and reports the bubble
and the activation memory, and ``str(schedule)`` draws the timeline. The executor (:mod:`funcpar.pipe`) walks
``schedule.actions[rank]`` in order: for ``F`` receive the input activation from the rank holding ``v-1`` (or take
the micro-batch), run chunk ``c``'s blocks, keep what the backward needs and send the output to the rank holding
``v+1``; for ``B`` receive the output gradient from ``v+1`` (or start from the loss), run the backward of chunk ``c``,
accumulate the parameter gradients and send the input gradient to ``v-1``.
Only the standard library is imported here.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from typing import Sequence

__all__ = ["PipelineError", "Action", "Schedule", "assign_layers", "assign_units", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "make_schedule", "SCHEDULES"]


class PipelineError(ValueError):
    """A pipeline plan that cannot work: bad sizes, an incomplete or misordered schedule, a deadlock."""


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def assign_layers(n_layers: int, stages: int, parts: list[int] | None = None) -> list[range]:
    """The block indices each (virtual) stage holds, contiguous and in order.

    By default the split is balanced, earlier stages taking the extra layer (10 layers over 4 stages: 3, 3, 2, 2).
    ``parts`` gives the sizes instead: ``stages`` entries of at least 1 summing to ``n_layers``.
    """
    if stages < 1:
        raise PipelineError(f"a pipeline needs at least 1 stage, got {stages}")
    if stages > n_layers:
        raise PipelineError(f"{_plural(stages, 'pipeline stage')} but the model has only "
                            f"{_plural(n_layers, 'layer')}: each stage needs at least one")
    if parts is None:
        base, extra = divmod(n_layers, stages)
        sizes = [base + (1 if s < extra else 0) for s in range(stages)]
    else:
        sizes = list(parts)
        if len(sizes) != stages:
            raise PipelineError(f"parts has {_plural(len(sizes), 'entry', 'entries')} for {_plural(stages, 'stage')}")
        for s, size in enumerate(sizes):
            if size < 1:
                raise PipelineError(f"parts[{s}] is {size}: stage {s} needs at least one layer (parts {sizes})")
        if sum(sizes) != n_layers:
            raise PipelineError(f"parts {sizes} sum to {sum(sizes)} but the model has "
                                f"{_plural(n_layers, 'layer')}")
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def assign_units(n_layers: int, stages: int, costs: Sequence[float] | None = None, parts: list | None = None,
                 halves: bool = False) -> list[range]:
    """The *units* each (virtual) stage holds, contiguous and in order: a unit is a layer or, with ``halves``, half of
    one (unit ``2 i`` is layer ``i``'s first half, ``2 i + 1`` its second).

    ``parts`` gives each stage's size in layers (with ``halves`` in steps of 0.5: ``[2.5, 1.5]``). Otherwise, given
    ``costs`` (one per unit, the last including what comes after the blocks, such as the LM head), the split balances
    them: cut ``k`` falls at the unit boundary whose running cost is nearest ``k / stages`` of the total, every stage
    keeping at least one unit. Without costs (or with none positive), :func:`assign_layers`'s even split.
    """
    n = n_layers * (2 if halves else 1)
    if stages < 1:
        raise PipelineError(f"a pipeline needs at least 1 stage, got {stages}")
    if 1 <= n < stages:
        what = f"{_plural(n_layers, 'layer')}" + (f" ({n} halves)" if halves else "")
        raise PipelineError(f"{_plural(stages, 'pipeline stage')} but the model has only {what}: each stage needs "
                            f"at least one" + (" half" if halves else ""))
    if parts is not None and halves:
        units = []
        for s, size in enumerate(parts):
            if not isinstance(size, numbers.Real) or not float(size * 2).is_integer():
                raise PipelineError(f"parts[{s}] is {size!r}: a stage holds whole layers or halves of them "
                                    f"(parts {list(parts)})")
            units.append(int(size * 2))
        if len(units) == stages and sum(units) == n and min(units) < 1:
            s = units.index(min(units))
            raise PipelineError(f"parts[{s}] is {parts[s]}: stage {s} needs at least one layer or half of one "
                                f"(parts {list(parts)})")
        if len(units) == stages and sum(units) != n:
            raise PipelineError(f"parts {list(parts)} sum to {sum(parts)} but the model has "
                                f"{_plural(n_layers, 'layer')}")
        return assign_layers(n, stages, units)
    if parts is not None:
        for s, size in enumerate(parts):
            if not isinstance(size, numbers.Real) or not float(size).is_integer():
                raise PipelineError(f"parts[{s}] is {size!r}: this model's stages hold whole layers (its staged "
                                    f"form has no halves) (parts {list(parts)})")
        return assign_layers(n_layers, stages, [int(x) for x in parts])
    if costs is None or len(costs) != n or not sum(costs) > 0:
        return assign_layers(n, stages)
    cum = list(itertools.accumulate(costs))
    bounds = [0]
    for k in range(1, stages):
        target = cum[-1] * k / stages
        options = range(bounds[-1] + 1, n - (stages - k) + 1)  # units before cut k; later stages keep one each
        bounds.append(min(options, key=lambda c: (abs(cum[c - 1] - target), c)))
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclasses.dataclass(frozen=True)
class Action:
    """One pass of one micro-batch through one of a rank's chunks: ``kind`` is ``"F"`` or ``"B"``."""

    kind: str
    micro: int
    chunk: int = 0

    def label(self, chunks: int = 1) -> str:
        """``F3`` (or ``F3c1`` for chunk 1 when a rank holds several chunks)."""
        return f"{self.kind}{self.micro}" + (f"c{self.chunk}" if chunks > 1 else "")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-rank action lists over ``pp`` ranks, ``n_micro`` micro-batches and ``chunks`` virtual stages per rank."""

    name: str
    pp: int
    n_micro: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.chunks

    def stage_of(self, rank: int, chunk: int) -> int:
        """The virtual stage that ``chunk`` of ``rank`` is: ``chunk * pp + rank``."""
        return chunk * self.pp + rank

    def rank_layers(self, n_layers: int, parts: list[int] | None = None) -> list[list[range]]:
        """Per rank, per chunk, the block indices of :func:`assign_layers`'s even split over the virtual stages (the
        executor's cut is :func:`assign_units`')."""
        stages = assign_layers(n_layers, self.virtual_stages, parts)
        return [[stages[self.stage_of(r, c)] for c in range(self.chunks)] for r in range(self.pp)]

    def _where(self, rank: int, i: int, a: Action) -> str:
        return (f"rank {rank}, action {i} ({a.label(self.chunks)}: micro-batch {a.micro}, "
                f"virtual stage {self.stage_of(rank, a.chunk)})")

    def validate(self) -> Schedule:
        """Check every (micro-batch, virtual stage) runs once forward and once backward, forward first.

        Returns the schedule; raises :class:`PipelineError` naming the rank and the action.
        """
        if len(self.actions) != self.pp:
            raise PipelineError(f"{self.name}: {_plural(len(self.actions), 'action list')} for pp={self.pp}")
        for r, acts in enumerate(self.actions):
            seen: dict[tuple[str, int, int], int] = {}
            for i, a in enumerate(acts):
                if a.kind not in ("F", "B") or not 0 <= a.micro < self.n_micro or not 0 <= a.chunk < self.chunks:
                    raise PipelineError(f"{self.name}: {self._where(r, i, a)} is not an action of this schedule "
                                        f"(kind F or B, micro-batch < {self.n_micro}, chunk < {self.chunks})")
                key = (a.kind, a.micro, a.chunk)
                if key in seen:
                    raise PipelineError(f"{self.name}: {self._where(r, i, a)} runs twice "
                                        f"(first as action {seen[key]})")
                if a.kind == "B" and ("F", a.micro, a.chunk) not in seen:
                    raise PipelineError(f"{self.name}: {self._where(r, i, a)} comes before its forward "
                                        f"{Action('F', a.micro, a.chunk).label(self.chunks)}")
                seen[key] = i
            for m in range(self.n_micro):
                for c in range(self.chunks):
                    for kind in ("F", "B"):
                        if (kind, m, c) not in seen:
                            a = Action(kind, m, c)
                            raise PipelineError(f"{self.name}: rank {r} never runs {a.label(self.chunks)} "
                                                f"(micro-batch {m}, virtual stage {self.stage_of(r, c)})")
        return self

    def _deps(self, rank: int, a: Action) -> list[tuple[str, int, int]]:
        """What ``a`` waits for, as (kind, micro, virtual stage) keys."""
        v = self.stage_of(rank, a.chunk)
        if a.kind == "F":
            return [("F", a.micro, v - 1)] if v > 0 else []
        return [("F", a.micro, v)] + ([("B", a.micro, v + 1)] if v + 1 < self.virtual_stages else [])

    def _key_label(self, key: tuple[str, int, int]) -> str:
        kind, m, v = key
        return f"{Action(kind, m, v // self.pp).label(self.chunks)} on rank {v % self.pp}"

    def _deadlock(self, pos: list[int], done: dict) -> PipelineError:
        lines = []
        for r, acts in enumerate(self.actions):
            if pos[r] == len(acts):
                lines.append(f"rank {r} has finished")
                continue
            a = acts[pos[r]]
            waits = ", ".join(self._key_label(k) for k in self._deps(r, a) if k not in done)
            lines.append(f"rank {r} waits at {a.label(self.chunks)} (action {pos[r]}) for {waits}")
        return PipelineError(f"deadlock in {self.name} (pp={self.pp}, n_micro={self.n_micro}): no rank can move; "
                             + "; ".join(lines))

    def _spans(self, t_forward: float, t_backward: float) -> list[list[tuple[float, float, Action]]]:
        """Per rank, (start, finish, action) of every action, in list order."""
        self.validate()
        if t_forward <= 0 or t_backward <= 0:
            raise PipelineError(f"times must be positive, got t_forward={t_forward}, t_backward={t_backward}")
        done: dict[tuple[str, int, int], float] = {}
        pos, free = [0] * self.pp, [0.0] * self.pp
        spans: list[list[tuple[float, float, Action]]] = [[] for _ in range(self.pp)]
        while any(pos[r] < len(acts) for r, acts in enumerate(self.actions)):
            moved = False
            for r, acts in enumerate(self.actions):
                while pos[r] < len(acts):
                    a = acts[pos[r]]
                    deps = self._deps(r, a)
                    if any(k not in done for k in deps):
                        break
                    start = max([free[r]] + [done[k] for k in deps])
                    free[r] = start + (t_forward if a.kind == "F" else t_backward)
                    done[(a.kind, a.micro, self.stage_of(r, a.chunk))] = free[r]
                    spans[r].append((start, free[r], a))
                    pos[r] += 1
                    moved = True
            if not moved:
                raise self._deadlock(pos, done)
        return spans

    def simulate(self, t_forward: float = 1.0, t_backward: float = 2.0) -> dict:
        """Run the plan with these pass times and no communication latency.

        Returns ``makespan``, per-rank ``busy`` time, ``bubble`` (1 - total busy / (pp * makespan)),
        per-rank ``max_in_flight`` (most activations held: forwards run whose backward has not) and per-rank
        ``spans`` ((start, finish, action) in order). Validates first; raises :class:`PipelineError` on a deadlock.
        The times are per action, i.e. per chunk: an interleaved chunk holds ``1 / chunks`` of a rank's layers, so
        scale them for comparable makespans (the bubble, a fraction, is the same at any scale).
        """
        spans = self._spans(t_forward, t_backward)
        makespan = max(s[-1][1] for s in spans if s)
        busy = [sum(end - start for start, end, _ in s) for s in spans]
        in_flight = []
        for acts in self.actions:
            held = peak = 0
            for a in acts:
                held += 1 if a.kind == "F" else -1
                peak = max(peak, held)
            in_flight.append(peak)
        return {"makespan": makespan, "busy": busy, "bubble": 1.0 - sum(busy) / (self.pp * makespan),
                "max_in_flight": in_flight, "spans": spans}

    def timeline(self, t_forward: int = 1, t_backward: int = 2) -> str:
        """One line per rank, one column per time unit: the action starting there, ``-`` while it continues and
        ``.`` while the rank idles; then a summary line with the bubble."""
        if not (isinstance(t_forward, int) and isinstance(t_backward, int)):
            raise PipelineError(f"a timeline needs whole time units, got t_forward={t_forward}, "
                                f"t_backward={t_backward}")
        sim = self.simulate(t_forward, t_backward)
        width = max(len(a.label(self.chunks)) for acts in self.actions for a in acts)
        lines = []
        for r, spans in enumerate(sim["spans"]):
            cells = ["." * width] * int(sim["makespan"])
            for start, end, a in spans:
                cells[int(start)] = a.label(self.chunks).ljust(width)
                for t in range(int(start) + 1, int(end)):
                    cells[t] = "-" * width
            lines.append(f"rank {r} | " + " ".join(cells).rstrip())
        lines.append(f"{self.name}: pp={self.pp} n_micro={self.n_micro} chunks={self.chunks}, "
                     f"F={t_forward} B={t_backward} time units, makespan {sim['makespan']:g}, "
                     f"bubble {sim['bubble']:.1%}, max in flight {sim['max_in_flight']}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.timeline()


def _check_sizes(name: str, pp: int, n_micro: int, chunks: int) -> None:
    for what, n in (("pp", pp), ("n_micro", n_micro), ("chunks", chunks)):
        if not isinstance(n, int) or n < 1:
            raise PipelineError(f"{name}: {what} must be a positive integer, got {n!r}")


def _interleave(forwards: list[Action], backwards: list[Action], warmup: int) -> tuple[Action, ...]:
    """``warmup`` forwards, then one forward and one backward in turn, then the remaining backwards."""
    warmup = min(warmup, len(forwards))
    out = list(forwards[:warmup])
    for i in range(len(forwards) - warmup):
        out += [forwards[warmup + i], backwards[i]]
    return tuple(out + backwards[len(forwards) - warmup:])


def gpipe(pp: int, n_micro: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards, both in micro-batch order 0, 1, 2, ...

    Every rank holds all ``n_micro`` activations at the turn.
    """
    _check_sizes("gpipe", pp, n_micro, 1)
    per_rank = tuple(tuple([Action("F", m) for m in range(n_micro)] + [Action("B", m) for m in range(n_micro)])
                     for _ in range(pp))
    return Schedule("gpipe", pp, n_micro, 1, per_rank)


def one_f_one_b(pp: int, n_micro: int) -> Schedule:
    """1F1B: rank ``r`` warms up with ``pp - r - 1`` forwards, then alternates one forward and one backward, then
    drains the remaining backwards. Rank ``r`` holds at most ``min(pp - r, n_micro)`` activations."""
    _check_sizes("1f1b", pp, n_micro, 1)
    fwd = [Action("F", m) for m in range(n_micro)]
    bwd = [Action("B", m) for m in range(n_micro)]
    return Schedule("1f1b", pp, n_micro, 1, tuple(_interleave(fwd, bwd, pp - r - 1) for r in range(pp)))


def interleaved_1f1b(pp: int, n_micro: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B: each rank holds ``chunks`` virtual stages and works in rounds of ``pp`` micro-batches.

    Forwards go round by round, and within a round chunk 0 for its ``pp`` micro-batches, then chunk 1 for the same
    ones, and so on; backwards likewise with the chunks in reverse (the last chunk first). Rank ``r`` warms up with
    ``(chunks - 1) * pp + (pp - r - 1)`` forwards, by when the gradient of its first backward can have come down
    the pipeline, then alternates, then drains. Rank 0 so holds ``chunks * pp`` chunk activations at most, the
    layers' worth of 1F1B's ``pp`` micro-batches. (Megatron warms up ``pp - r - 1`` forwards more, to overlap
    communication; with no latency, as simulated here, that gives the same bubble for more memory.)
    Needs ``n_micro % pp == 0`` so that every round is full.
    """
    _check_sizes("interleaved", pp, n_micro, chunks)
    if chunks < 2:
        raise PipelineError(f"interleaved: chunks={chunks}, needs at least 2 virtual stages per rank "
                            "(chunks=1 is plain 1f1b)")
    if n_micro % pp:
        raise PipelineError(f"interleaved: n_micro={n_micro} is not a multiple of pp={pp} "
                            "(micro-batches go round in groups of pp)")

    def unit(k: int, backward: bool) -> Action:
        chunk = (k // pp) % chunks
        micro = (k // (pp * chunks)) * pp + k % pp
        return Action("B", micro, chunks - 1 - chunk) if backward else Action("F", micro, chunk)

    total = n_micro * chunks
    fwd = [unit(k, False) for k in range(total)]
    bwd = [unit(k, True) for k in range(total)]
    per_rank = tuple(_interleave(fwd, bwd, (chunks - 1) * pp + pp - r - 1) for r in range(pp))
    return Schedule("interleaved", pp, n_micro, chunks, per_rank)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def make_schedule(name: str, pp: int, n_micro: int, chunks: int = 1) -> Schedule:
    """The schedule called ``name`` ("gpipe", "1f1b" or "interleaved"); ``chunks`` only for "interleaved"."""
    if name not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_1f1b(pp, n_micro, chunks)
    if chunks != 1:
        raise PipelineError(f"{name} runs one chunk per rank, got chunks={chunks} (use 'interleaved')")
    return SCHEDULES[name](pp, n_micro)
