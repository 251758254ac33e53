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
gives each rank several thin chunks so the pipeline fills and drains in smaller steps and the bubble shrinks; zero
bubble (:func:`zero_bubble`) splits each backward into ``B``, the input's gradient, and a later ``W``, the weights'
(``W(m, v)`` needs only ``B(m, v)``, on its own rank), and runs the ``W`` s where a rank would wait.

This module only plans. :meth:`Schedule.validate` checks a plan is complete and well ordered,
:meth:`Schedule.simulate` runs it as a discrete-event simulation (zero communication latency) and reports the bubble
and the activation memory, and ``str(schedule)`` draws the timeline. The executor (:mod:`funcpar.pipeline.executor`)
walks ``schedule.actions[rank]`` in order: for ``F`` receive the input activation from the rank holding ``v-1`` (or take
the micro-batch), run chunk ``c``'s blocks, keep what the backward needs and send the output to the rank holding
``v+1``; for ``B`` receive the output gradient from ``v+1`` (or start from the loss), run the backward of chunk ``c``,
accumulate the parameter gradients and send the input gradient to ``v-1``.
Only the standard library (and :mod:`funcpar.pipeline.cut`, the stage cuts) is imported here.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from funcpar.pipeline.cut import PipelineError, plural, assign_layers, assign_units

__all__ = ["PipelineError", "Action", "Schedule", "assign_layers", "assign_units", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "zero_bubble", "make_schedule", "SCHEDULES"]


@dataclasses.dataclass(frozen=True)
class Action:
    """One pass of one micro-batch through one of a rank's chunks: ``kind`` is ``"F"`` (forward), ``"B"``
    (backward) or ``"W"`` (the weights' gradients of a backward split in two: its ``B`` then forms only the input's
    gradient, and ``W`` the rest later, see :func:`zero_bubble`)."""

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

    def _where(self, rank: int, i: int, a: Action) -> str:
        return (f"rank {rank}, action {i} ({a.label(self.chunks)}: micro-batch {a.micro}, "
                f"virtual stage {self.stage_of(rank, a.chunk)})")

    def validate(self) -> Schedule:
        """Check every (micro-batch, virtual stage) runs once forward and once backward, forward first, and at most
        once ``W``, after its ``B``.

        Returns the schedule; raises :class:`PipelineError` naming the rank and the action.
        """
        if len(self.actions) != self.pp:
            raise PipelineError(f"{self.name}: {plural(len(self.actions), 'action list')} for pp={self.pp}")
        for r, acts in enumerate(self.actions):
            seen: dict[tuple[str, int, int], int] = {}
            for i, a in enumerate(acts):
                if a.kind not in ("F", "B", "W") or not 0 <= a.micro < self.n_micro or not 0 <= a.chunk < self.chunks:
                    raise PipelineError(f"{self.name}: {self._where(r, i, a)} is not an action of this schedule "
                                        f"(kind F, B or W, micro-batch < {self.n_micro}, chunk < {self.chunks})")
                key = (a.kind, a.micro, a.chunk)
                if key in seen:
                    raise PipelineError(f"{self.name}: {self._where(r, i, a)} runs twice "
                                        f"(first as action {seen[key]})")
                before = {"B": "F", "W": "B"}.get(a.kind)
                if before and (before, a.micro, a.chunk) not in seen:
                    what = "forward" if before == "F" else "backward"
                    raise PipelineError(f"{self.name}: {self._where(r, i, a)} comes before its {what} "
                                        f"{Action(before, a.micro, a.chunk).label(self.chunks)}")
                seen[key] = i
            for m in range(self.n_micro):
                for c in range(self.chunks):
                    for kind in ("F", "B"):
                        if (kind, m, c) not in seen:
                            a = Action(kind, m, c)
                            raise PipelineError(f"{self.name}: rank {r} never runs {a.label(self.chunks)} "
                                                f"(micro-batch {m}, virtual stage {self.stage_of(r, c)})")
        return self

    def split(self) -> set[tuple[int, int, int]]:
        """(rank, micro, chunk) of every backward split in two (a ``W`` action follows its ``B``)."""
        return {(r, a.micro, a.chunk) for r, acts in enumerate(self.actions) for a in acts if a.kind == "W"}

    def _deps(self, rank: int, a: Action) -> list[tuple[str, int, int]]:
        """What ``a`` waits for, as (kind, micro, virtual stage) keys."""
        v = self.stage_of(rank, a.chunk)
        if a.kind == "F":
            return [("F", a.micro, v - 1)] if v > 0 else []
        if a.kind == "W":
            return [("B", a.micro, v)]
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
        split = self.split()
        weight = t_backward // 2 if isinstance(t_backward, int) else t_backward / 2  # a split B's second part
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
                    took = {"F": t_forward, "W": weight}.get(a.kind, t_backward)
                    free[r] = start + (took - weight if (r, a.micro, a.chunk) in split and a.kind == "B" else took)
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
        per-rank ``max_in_flight`` (most activations held: forwards run whose backward, or ``W`` where the backward
        is split, has not) and per-rank ``spans`` ((start, finish, action) in order). A split backward's ``W`` takes
        half of ``t_backward`` (rounded down) and its ``B`` the rest. Validates first; raises
        :class:`PipelineError` on a deadlock. The times are per action, i.e. per chunk: an interleaved chunk holds
        ``1 / chunks`` of a rank's layers, so scale them for comparable makespans (the bubble, a fraction, is the
        same at any scale).
        """
        spans = self._spans(t_forward, t_backward)
        makespan = max(s[-1][1] for s in spans if s)
        busy = [sum(end - start for start, end, _ in s) for s in spans]
        in_flight, split = [], self.split()
        for r, acts in enumerate(self.actions):
            held = peak = 0
            for a in acts:
                held += 1 if a.kind == "F" else 0 if a.kind == "B" and (r, a.micro, a.chunk) in split else -1
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
    communication; with no latency, as modelled here, that gives the same bubble for more memory.)
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


def zero_bubble(pp: int, n_micro: int, chunks: int = 1) -> Schedule:
    """Zero-bubble 1F1B (``chunks == 1``, ZB-H1 of Qi et al., 2023) or interleaved (``chunks >= 2``): every
    backward split into ``B``, the input's gradient, which the previous stage waits for, and ``W``, the weights'
    gradients, which nothing waits for and which fill the time a rank would otherwise idle.

    The forwards and the backwards come in the order of :func:`one_f_one_b` (or :func:`interleaved_1f1b`); where
    each goes is decided by running the pipeline with unit times for ``F``, ``B`` and ``W``: a free rank runs its
    next backward if its gradient has come, else its next forward if its input has come and it holds fewer chunk
    activations than the plain schedule's most plus one (held until ``W``), else its oldest ``W``. With unit times
    that gives 1F1B's bubble ``(pp - 1) (F + B + W)`` about a third: pp=2 with 4 micro-batches takes 13 units
    for 12 of work (1F1B 15; interleaved with 2 chunks 13.5, zero-bubble interleaved 12.5).
    """
    _check_sizes("zb", pp, n_micro, chunks)
    if chunks > 1 and n_micro % pp:
        raise PipelineError(f"zb: n_micro={n_micro} is not a multiple of pp={pp} (with chunks={chunks}, micro-batches "
                            "go round in groups of pp)")
    base = one_f_one_b(pp, n_micro) if chunks == 1 else interleaved_1f1b(pp, n_micro, chunks)
    V, limit = pp * chunks, [n + 1 for n in base.simulate()["max_in_flight"]]
    fwd = [deque(a for a in acts if a.kind == "F") for acts in base.actions]
    bwd = [deque(a for a in acts if a.kind == "B") for acts in base.actions]
    weights: list[deque] = [deque() for _ in range(pp)]
    held, out = [0] * pp, [[] for _ in range(pp)]
    done: dict[tuple[str, int, int], int] = {}
    t = 0
    while any(fwd) or any(bwd) or any(weights):
        ready = {k for k, at in done.items() if at <= t}  # what finished by time t (each action takes 1)
        for r in range(pp):
            if bwd[r] and set(base._deps(r, bwd[r][0])) <= ready:
                a = bwd[r].popleft()
                weights[r].append(Action("W", a.micro, a.chunk))
            elif fwd[r] and held[r] < limit[r] and set(base._deps(r, fwd[r][0])) <= ready:
                a = fwd[r].popleft()
                held[r] += 1
            elif weights[r]:
                a = weights[r].popleft()
                held[r] -= 1
            else:
                continue
            done[(a.kind, a.micro, a.chunk * pp + r)] = t + 1
            out[r].append(a)
        t += 1
        if t > 4 * V * n_micro * 3:  # cannot happen: the plain schedule's orders with more room never deadlock
            raise PipelineError(f"zb: no schedule found for pp={pp}, n_micro={n_micro}, chunks={chunks}")
    return Schedule("zb", pp, n_micro, chunks, tuple(tuple(acts) for acts in out))


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb": zero_bubble}


def make_schedule(name: str, pp: int, n_micro: int, chunks: int = 1) -> Schedule:
    """The schedule called ``name`` ("gpipe", "1f1b", "interleaved" or "zb"); ``chunks`` only for "interleaved"
    and "zb"."""
    if name not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if name in ("interleaved", "zb"):
        return SCHEDULES[name](pp, n_micro, chunks)
    if chunks != 1:
        raise PipelineError(f"{name} runs one chunk per rank, got chunks={chunks} (use 'interleaved' or 'zb')")
    return SCHEDULES[name](pp, n_micro)
