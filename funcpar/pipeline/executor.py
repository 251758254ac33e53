"""Running a pipeline: which leaves a ``pp`` rank holds, and the executor that walks its schedule.

A model's staged form (:class:`funcpar.Stages`: ``embed -> block ... -> head``) is cut into virtual stages
(:func:`funcpar.pipeline.schedule.assign_units`, by the units' weights or by ``parts``), a unit being a block or, where
the staged form has ``halves``, half of one (attention, MLP); rank ``r`` of the ``pp`` axis holds the units of its
chunks (each half's own leaves), the embedding if it holds virtual stage 0 and the head if it holds the last one.
Its *stage tree* is the model's parameter tree with ``None`` for every leaf another stage holds, so paths,
checkpoints and the optimizer state keep the global structure (``layers.5.wq`` is ``layers.5.wq`` at any ``pp``). A
tied embedding is held by the first and the last stage, and its gradient is summed over the two (as Megatron does).

:class:`Executor` runs one step's micro-batches through :attr:`StagePlan.schedule`: per action ``F(m, c)`` it
receives the input activation from the rank holding the previous virtual stage (or embeds micro-batch ``m``), runs
the chunk's blocks with autograd recording, keeps the input and the output, and sends the output on; per ``B(m, c)``
it receives the output's gradient (or starts from the weighted loss), runs the chunk's backward (each parameter's
``.grad`` accumulates over micro-batches; the saved activations are freed as they are used; a split ``B`` keeps them
until its ``W``), and sends the input's gradient back (virtual stage 0's blocks start from a detached copy of the
embedding's output, whose backward follows). Where ``W(m, c)`` follows, ``B`` forms only the input's gradient and
``W`` the weights' and the embedding's (:mod:`funcpar.pipeline.splitgrad`). Gradients are those of ``sum_m w_m
loss_m``, as the unpipelined step computes them. Sends are asynchronous and every message is tagged
(:mod:`funcpar.parallel.p2p`); a rank waits only where its next action needs data. Activations and gradients travel on
two channels (communicators): each stream is posted in the same order by sender and receiver (every rank walks the same
forward order and the same backward order), so a backend that matches messages by order (NCCL) pairs them as the tags
do on gloo. The executor measures the time it spends waiting (the *bubble*) and the most micro-batches it holds.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import optree
import torch

from funcpar.parallel import collectives as C
from funcpar.parallel import p2p
from funcpar.pipeline import splitgrad
from funcpar.pipeline.schedule import Schedule, assign_units
from funcpar.nn.documents import documents_of
from funcpar.nn.remat import remat
from funcpar.state import StepError

__all__ = ["StagePlan", "Executor"]



def _key(entry: Any) -> Any:
    return getattr(entry, "key", getattr(entry, "idx", entry))


class StagePlan:
    """Which virtual stages, layers and leaves this ``pp`` rank holds (the model's staged form over ``schedule``).

    ``stages``: the model's :class:`funcpar.Stages`; ``shapes``: its global parameter tree (on meta: a
    :class:`funcpar.Loss`'s ``shapes()``); ``cfg``: the config the stages' functions take; ``name``: what messages
    call the model (``None``: "the model")."""

    def __init__(self, stages, shapes: Any, cfg: Any, mesh, schedule: Schedule, parts: list[float] | None = None,
                 name: str | None = None):
        st = stages
        self.stages, self.cfg, self.mesh, self.schedule, self.shapes = st, cfg, mesh, schedule, shapes
        self.name = f"model '{name}'" if name else "the model"
        if not isinstance(shapes, dict) or st.layers not in shapes:
            raise StepError(f"{self.name}: its parameter tree has no '{st.layers}' (Stages.layers: the list of "
                            f"blocks the pipeline cuts), so pipeline stages cannot cut it")
        self.n_layers = len(self.shapes[st.layers])
        self.first = set(st.first_leaves(cfg)) if st.halves is not None else None
        # units: the layers, or their halves; ranges[v]: the units virtual stage v holds
        self.ranges = assign_units(self.n_layers, schedule.virtual_stages, self._costs(), parts, self.first is not None)
        self.rank, self.pp, self.V = mesh.coord("pp"), mesh.axis_size("pp"), schedule.virtual_stages
        self.virtual = [schedule.stage_of(self.rank, c) for c in range(schedule.chunks)]
        self.embed_names, self.head_names = set(st.embed_leaves(cfg)), set(st.head_leaves(cfg))
        self.tied = sorted(self.embed_names & self.head_names) if self.pp > 1 else []
        for name in self.shapes:
            if name != st.layers and name not in self.embed_names | self.head_names:
                raise StepError(f"{self.name}: its staged form does not say which stage holds leaf "
                                f"'{name}' (Stages.embed_leaves / head_leaves)")

    def holds(self, path: tuple) -> bool:
        """Whether this rank holds the leaf at ``path`` (a path of the model's parameter tree)."""
        top = _key(path[0])
        if top == self.stages.layers:
            units = self._units_of(_key(path[1]), _key(path[2]) if len(path) > 2 else None)
            return any(u in self.ranges[v] for v in self.virtual for u in units)
        return ((top in self.embed_names and 0 in self.virtual)
                or (top in self.head_names and self.V - 1 in self.virtual))

    def holds_path(self, path: str) -> bool:
        """:meth:`holds` for a dotted path string (``"layers.3.wq"``)."""
        parts = path.split(".")
        return self.holds(tuple(int(p) if p.isdigit() else p for p in parts))

    def select(self, tree: Any) -> Any:
        """``tree`` (shaped like the model's parameters, or a stage tree) with ``None`` for the leaves this rank does
        not hold; raises naming the first leaf it holds that ``tree`` lacks."""
        def pick(path, x):
            if not self.holds(path):
                return None
            if x is None:
                raise StepError(f"pipeline stage {self.rank}: the parameters lack leaf "
                                f"'{'.'.join(str(_key(k)) for k in path)}', which this stage holds")
            return x

        return optree.tree_map_with_path(pick, tree, none_is_leaf=True)

    def describe(self) -> str:
        """One line per rank: its virtual stages and their layers."""
        lines = []
        for r in range(self.pp):
            parts = []
            for c in range(self.schedule.chunks):
                v = self.schedule.stage_of(r, c)
                what = (["embed"] if v == 0 else []) + self._describe_units(self.ranges[v])
                what += ["head"] if v == self.V - 1 else []
                parts.append(f"stage {v}: " + " + ".join(what))
            lines.append(f"pp rank {r}: " + "; ".join(parts))
        return "\n".join(lines)

    def half_of(self, name: Any) -> int:
        """Which half of a layer its leaf ``name`` belongs to: 0 (``Stages.first_leaves``) or 1."""
        return 0 if name in self.first else 1

    def _units_of(self, i: int, name: Any) -> list[int]:
        """The units layer ``i``'s leaf ``name`` belongs to (both halves for ``None``: the whole layer)."""
        if self.first is None:
            return [i]
        return [2 * i, 2 * i + 1] if name is None else [2 * i + self.half_of(name)]

    def _costs(self) -> list[float]:
        """Each unit's weight for the default split: its leaves' element count (a matmul's work per token is twice
        its weight's), the last unit's including the head's leaves. The embedding is a lookup and counts nothing.
        Attention's sequence-length work and the element-wise ops are left out: measured on the small benchmark
        Llama (256 positions), an attention half takes 0.55 of an MLP half's time against 0.36 of its weight; cut by
        the measured times, the benchmark models' 1F1B stages would be the same (``parts`` overrides the cut)."""
        st, layers = self.stages, self.shapes[self.stages.layers]
        costs = [0.0] * (len(layers) * (1 if self.first is None else 2))
        for i, lp in enumerate(layers):
            for p, x in zip(optree.tree_paths(lp), optree.tree_leaves(lp), strict=True):
                costs[self._units_of(i, _key(p[0]))[0]] += x.numel()
        head = set(st.head_leaves(self.cfg))
        if costs:
            costs[-1] += float(sum(x.numel() for name, x in self.shapes.items() if name in head
                                   for x in optree.tree_leaves(x)))
        return costs

    def pieces(self, rg: range) -> list[tuple[int, int | None]]:
        """Units ``rg`` as ``(layer, half)`` in order: ``half`` 0 or 1 where only that half is in ``rg``, ``None``
        for a whole layer (run as one block)."""
        if self.first is None:
            return [(u, None) for u in rg]
        return [(u // 2, None if u % 2 == 0 and u + 1 in rg else u % 2) for u in rg if u % 2 == 0 or u - 1 not in rg]

    def _describe_units(self, rg: range) -> list[str]:
        """``["layers 0-1", "layer 2 attention"]`` for units ``rg``."""
        pieces = self.pieces(rg)
        out, whole = [], [i for i, half in pieces if half is None]
        for i, half in pieces:
            if half is not None:
                out.append(f"layer {i} {self.stages.half_names[half]}")
            elif i == whole[0]:
                out.append(f"layers {i}-{whole[-1]}" if len(whole) > 1 else f"layer {i}")
        return out


def _signature(mb: Any) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in optree.tree_leaves(mb) if isinstance(x, torch.Tensor))


class Executor:
    """Runs a :class:`StagePlan`'s schedule over one step's micro-batches on this rank (see the module docstring)."""

    def __init__(self, plan: StagePlan, remat_blocks: bool = False):
        self.plan, self.mesh, self.remat = plan, plan.mesh, remat_blocks
        # ZeRO-3 (set by the step once its layout exists): the executor is handed this stage's parts, one per unit,
        # instead of its stage tree, and gathers each unit as it runs it (funcpar.train.zero3.StageGather)
        self.zero3 = None
        self._shapes: dict[tuple, tuple[torch.dtype, tuple[int, ...]]] = {}  # (v, batch signature) -> input
        self.metrics: dict[str, float] = {}
        self._device: torch.device | None = None  # where this rank's carries live (meta in a plan), once it sent one
        if plan.V > plan.pp:  # wrap-around streams (see _channel): their communicators built now, on every rank
            self.mesh.lane("pp", 1)

    def _channel(self, kind: int, v: int) -> int:
        """The communicator of the message virtual stage ``v`` sends (``kind`` 0 and 1: activations, 2: gradients):
        activations to the next rank on 0, gradients to the previous on 1, and where an interleaved schedule wraps
        around (the last rank's activations to rank 0, rank 0's gradients to the last) on 2 and 3. So every stream
        of the schedule flows one way between two ranks on a communicator of its own, in one order on both ends:
        what NCCL, which ignores tags, needs (tests/test_nccl_rules.py; a tied leaf's exchange after the walk is
        one batched send/receive, p2p.sendrecv)."""
        pp = self.plan.pp
        if kind < 2:
            return 2 if v % pp == pp - 1 else 0
        return 3 if v % pp == 0 else 1

    # ------------------------------------------------------------------------------------------- chunk passes
    def _blocks(self, params: Any, x: torch.Tensor, v: int, mesh) -> torch.Tensor:
        plan, st, cfg = self.plan, self.plan.stages, self.plan.cfg
        for i, half in plan.pieces(plan.ranges[v]):
            fn = functools.partial(_block_call, st.block if half is None else st.halves[half], i, cfg, mesh)
            if self.zero3 is not None:  # gathered inside remat: the backward gathers the layer again
                x = remat(functools.partial(_gathered_call, self.zero3, fn, i, half, plan))(
                    params[self.zero3.unit(i)], x)
                continue
            lp = _half(params[st.layers][i], half, plan)
            x = remat(fn)(lp, x) if self.remat else fn(lp, x)
        return x

    def _ends(self, params: Any, which: str) -> Any:
        """What ``stages.embed`` / ``stages.head`` read: the stage tree, or under ZeRO-3 the units gathered."""
        return params if self.zero3 is None else self.zero3.ends(params, which)

    def _tag(self, kind: int, m: int, v: int) -> int:
        return 3 * (m * self.plan.V + v) + kind

    def _peer(self, v: int) -> int:
        return v % self.plan.pp

    def _recv_input(self, v: int, m: int, sig: tuple) -> torch.Tensor:
        """The activation virtual stage ``v - 1`` sent for micro-batch ``m`` (its shape sent once per batch shape)."""
        key = (v, sig)
        if key not in self._shapes:
            head = self._head_as((self.plan.virtual[0] + 1, sig))
            self._wait(p2p.irecv(head, self.mesh, "pp", self._peer(v - 1), self._tag(1, m, v - 1),
                                 self._channel(1, v - 1)))
            self._shapes[key] = p2p.described(head)
        dtype, shape = self._shapes[key]
        buf = torch.empty(shape, dtype=dtype, device=self._device or self.mesh.device)
        return self._wait(p2p.irecv(buf, self.mesh, "pp", self._peer(v - 1), self._tag(0, m, v - 1),
                                    self._channel(0, v - 1)))

    def _head_as(self, key: tuple) -> torch.Tensor:
        """A buffer for a carry's header that holds the header of the carry this rank sent under ``key``, if it sent
        it: a receive fills it in; over an abstract mesh (planning: no peer, a receive leaves its buffer as it is)
        the carry received is then shaped as this rank's own."""
        if key not in self._shapes:
            return torch.empty(2 + p2p.MAX_DIMS, dtype=torch.int64)
        dtype, shape = self._shapes[key]
        return p2p.describe(torch.empty(shape, dtype=dtype, device="meta"))

    def _send_output(self, y: torch.Tensor, v: int, m: int, sig: tuple) -> None:
        key, self._device = (v + 1, sig), y.device
        if key not in self._shapes:
            head = p2p.describe(y)
            self._sends.append(p2p.isend(head, self.mesh, "pp", self._peer(v + 1), self._tag(1, m, v),
                                         self._channel(1, v)))
            self._shapes[key] = (y.dtype, tuple(y.shape))
        self._sends.append(p2p.isend(y, self.mesh, "pp", self._peer(v + 1), self._tag(0, m, v), self._channel(0, v)))

    def _wait(self, pending: p2p.Pending) -> torch.Tensor:
        t0 = time.perf_counter()
        out = pending.wait()
        self._waited += time.perf_counter() - t0
        return out

    def _forward(self, params, mb, v: int, m: int, weight: torch.Tensor | None):
        st, cfg, last = self.plan.stages, self.plan.cfg, v == self.plan.V - 1
        mesh = documents_of(self.mesh, mb)  # (packed samples: each attends to itself)
        sig = _signature(mb)
        embedded = None
        if v == 0:  # the blocks start from a leaf, as on the other stages: the embedding's backward comes after
            embedded = st.embed(self._ends(params, "embed"), mb, cfg, mesh)
            x_in = embedded.detach().requires_grad_(True)
        else:
            x_in = self._recv_input(v, m, sig).requires_grad_(True)
        y = self._blocks(params, x_in, v, mesh)
        if not last:
            self._send_output(y.detach(), v, m, sig)
            return (x_in, embedded), y, None
        loss = st.head(self._ends(params, "head"), y, mb, cfg, mesh)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise StepError("the model's head must return a scalar loss")
        return (x_in, embedded), loss * weight if weight is not None else loss, loss.detach()

    def _backward(self, inputs: tuple, y, v: int, m: int, weights: list | None) -> Callable | None:
        """``B``: the chunk's backward, its input's gradient sent on (on virtual stage 0, into the embedding). With
        ``weights`` (a ``W`` follows) only the input's gradient; returns what computes the weights' gradients (and
        the embedding's)."""
        x_in, embedded = inputs
        if v == self.plan.V - 1:
            grad = None
        else:
            buf = torch.empty_like(y)
            grad = self._wait(p2p.irecv(buf, self.mesh, "pp", self._peer(v + 1), self._tag(2, m, v + 1),
                                        self._channel(2, v + 1)))
        later = None
        if y.requires_grad and weights is not None:
            rest = splitgrad.backward_input([y], [grad], [x_in], weights)
            later = rest and rest.run
        elif y.requires_grad:
            torch.autograd.backward(y, grad)
        g = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
        if embedded is None:
            self._sends.append(p2p.isend(g, self.mesh, "pp", self._peer(v - 1), self._tag(2, m, v),
                                         self._channel(2, v)))
        elif embedded.requires_grad:
            embed = functools.partial(torch.autograd.backward, embedded, g)
            if weights is None:
                embed()
            else:
                later = functools.partial(_in_turn, later, embed)
        return later

    # ------------------------------------------------------------------------------------------------ a step
    def run(self, params: Any, micro: list, shares: list[float], scale: torch.Tensor
            ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Gradients of ``scale * sum_m shares[m] * loss_m`` for this rank's leaves (in ``params``' leaf order, tied
        leaves summed over the first and last stage) and ``sum_m shares[m] * loss_m`` (on the last stage, else 0)."""
        plan = self.plan
        leaves, treedef = optree.tree_flatten(params)
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in leaves]
        tree = optree.tree_unflatten(treedef, leaves)
        self._sends, self._waited = [], 0.0
        held: dict[tuple[int, int], tuple] = {}
        deferred: dict[tuple[int, int], Callable | None] = {}  # a split backward's weight part, until its W
        split = {(m, c) for r, m, c in plan.schedule.split() if r == plan.rank}
        trainable = [x for x in leaves if x.requires_grad]
        peak, loss_sum = 0, torch.zeros((), dtype=torch.float64)
        t0 = time.perf_counter()
        with torch.enable_grad():
            for a in plan.schedule.actions[plan.rank]:
                v = plan.schedule.stage_of(plan.rank, a.chunk)
                if a.kind == "F":
                    weight = torch.tensor(shares[a.micro], dtype=torch.float32) * scale
                    inputs, y, loss = self._forward(tree, micro[a.micro], v, a.micro, weight)
                    held[(a.micro, a.chunk)] = (inputs, y)
                    peak = max(peak, len(held) + len(deferred))
                    if loss is not None:
                        loss_sum += loss.double().cpu() * shares[a.micro]
                elif a.kind == "B":
                    inputs, y = held.pop((a.micro, a.chunk))
                    later = self._backward(inputs, y, v, a.micro, trainable if (a.micro, a.chunk) in split else None)
                    if (a.micro, a.chunk) in split:
                        deferred[(a.micro, a.chunk)] = later
                    del inputs, y, later
                else:  # W: the weights' gradients of that backward
                    later = deferred.pop((a.micro, a.chunk))
                    if later is not None:
                        later()
                    del later
        for s in self._sends:
            self._wait(s)
        self._sends = []
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
        self._sum_tied(params, grads)
        self.metrics = {"bubble": self._bubble(time.perf_counter() - t0), "in_flight": peak}
        return grads, loss_sum

    def _bubble(self, total: float) -> float:
        """The share of the pipeline's rank-time spent idle: ``1 - sum(busy) / (pp * makespan)``, the makespan the
        longest rank's walk through its actions (a rank done early idles until then), busy what it did not wait."""
        longest = C.all_reduce(torch.tensor([total], dtype=torch.float64), self.mesh, "pp", "max").item()
        busy = C.all_reduce(torch.tensor([total - self._waited], dtype=torch.float64), self.mesh, "pp").item()
        return 1.0 - busy / (self.plan.pp * longest) if longest > 0 else 0.0

    def _sum_tied(self, params: Any, grads: list[torch.Tensor]) -> None:
        """A leaf held by the first and the last stage (a tied embedding): both get the sum of their gradients."""
        plan = self.plan
        if not plan.tied or plan.rank not in (0, plan.pp - 1):
            return
        other = plan.pp - 1 if plan.rank == 0 else 0
        if self.zero3 is not None:  # the tied unit: laid out alike on both stages, its parts' gradients add
            paths = ["tied" if i == self.zero3.tied else None for i in range(len(grads))]
        else:
            paths = [_key(p[0]) for p in optree.tree_paths(params)]
        for i, top in enumerate(paths):
            if top in plan.tied or top == "tied":
                theirs = torch.empty_like(grads[i])
                p2p.sendrecv(self.mesh, "pp", sends=[(grads[i], other)], recvs=[(theirs, other)])
                # a + b on one stage, b + a on the other: the same bits (float addition commutes)
                grads[i] = grads[i] + theirs

    def uncounted(self, params: Any) -> list[bool]:
        """Per leaf of ``params``: whether its gradient norm is counted elsewhere (a tied leaf's copy on the last
        stage, counted on the first)."""
        return [bool(self.plan.tied) and self.plan.rank == self.plan.pp - 1 and _key(p[0]) in self.plan.tied
                for p in optree.tree_paths(params)]

    def evaluate(self, params: Any, batch: Any) -> torch.Tensor:
        """The model's loss on ``batch`` (one micro-batch, forward only through every stage), on every pp rank."""
        plan = self.plan
        self._sends, self._waited = [], 0.0
        loss = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        with torch.no_grad():
            for v in plan.virtual:
                _, y, value = self._forward(params, batch, v, 0, None)
                if value is not None:
                    loss = value.float()
        for s in self._sends:
            s.wait()
        self._sends = []
        return C.all_reduce(loss, self.mesh, "pp")


def _in_turn(*calls: Callable | None) -> None:
    for call in calls:
        if call is not None:
            call()


def _block_call(block: Callable, index: int, cfg: Any, mesh, lp: Any, x: torch.Tensor) -> torch.Tensor:
    return block(lp, x, index, cfg, mesh)


def _half(lp: Any, half: int | None, plan: StagePlan) -> Any:
    """A layer's leaves, or only one half's (remat's backward would make zeros for the others)."""
    return lp if half is None else {k: x for k, x in lp.items() if plan.half_of(k) == half}


def _gathered_call(zero3, fn: Callable, index: int, half: int | None, plan: StagePlan, part: torch.Tensor,
                   x: torch.Tensor) -> torch.Tensor:
    return fn(_half(zero3.layer(index, part), half, plan), x)
