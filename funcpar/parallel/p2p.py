"""Point-to-point communication along a mesh axis (pipeline stages): the only other caller of torch.distributed
besides :mod:`funcpar.parallel.collectives`, whose bounded waits it shares.

Coordinates are positions along the axis (stage numbers for ``"pp"``). :func:`sendrecv` posts a set of sends and
receives at once and waits for all of them. The pipeline executor uses the asynchronous pair :func:`isend` /
:func:`irecv`: each message carries a *tag*, so a receive matches the one send meant for it whatever order the two
ranks post them in (a pipeline's forward activations and backward gradients cross between the same two ranks), and
a send is waited for only later (:meth:`Pending.wait`), so two neighbours sending to each other at once cannot
deadlock. Over an abstract mesh (planning) a send only counts its bytes and a receive leaves its buffer as it is.

The mesh's communication, by kind (``mesh.comm``, a class attribute of each): :class:`Wire` (a :class:`funcpar.Mesh`)
and :class:`Simulation` (an abstract mesh), the collectives' (:class:`funcpar.parallel.collectives.CollectiveWire`,
:class:`~funcpar.parallel.collectives.CollectiveSimulation`) with the messages added. The functions here and the
collectives call through it: they dispatch once, on the mesh's kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import os

import torch
import torch.distributed as dist

from funcpar.parallel import transport
from funcpar.parallel.collectives import CollectiveError, CollectiveSimulation, CollectiveWire, simulated_wire
from funcpar.parallel.transport import count as _count, wait as _wait

if TYPE_CHECKING:  # pragma: no cover
    from funcpar.parallel.mesh import Mesh

__all__ = ["send", "recv", "sendrecv", "isend", "irecv", "Pending", "gather_blocks_to", "describe", "described", "Wire",
           "Simulation", "WIRE", "SIMULATION"]


# a tensor's dtype and shape as a few int64s, so that a peer can allocate the buffer it will receive
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.int8, torch.int16]
MAX_DIMS = 8
# False: every isend/irecv goes under one tag, so gloo pairs messages by posting order between two ranks, as NCCL
# (which ignores tags) always does: the tests run the pipelines so (transport's note on NCCL's rules)
USE_TAGS = os.environ.get("FUNCPAR_P2P_TAGS", "1") != "0"


def describe(x: torch.Tensor) -> torch.Tensor:
    """``[dtype code, ndim, dims..., -1...]`` (``2 + MAX_DIMS`` int64s) of ``x``."""
    if x.dtype not in DTYPES or x.ndim > MAX_DIMS:
        raise CollectiveError(f"a {x.dtype} tensor of shape {tuple(x.shape)} cannot be described to a peer "
                              f"(dtypes {', '.join(map(str, DTYPES))}; at most {MAX_DIMS} dims)")
    out = torch.full((2 + MAX_DIMS,), -1, dtype=torch.int64)
    out[0], out[1] = DTYPES.index(x.dtype), x.ndim
    out[2 : 2 + x.ndim] = torch.tensor(x.shape, dtype=torch.int64)
    return out


def described(d: torch.Tensor | list) -> tuple[torch.dtype, tuple[int, ...]]:
    """The ``(dtype, shape)`` :func:`describe` wrote."""
    d = [int(v) for v in d]
    return DTYPES[d[0]], tuple(d[2 : 2 + d[1]])


class Pending:
    """An asynchronous send or receive; :meth:`wait` (bounded by the mesh's timeout) returns its tensor."""

    def __init__(self, work, tensor: torch.Tensor, mesh: "Mesh", axis: str, what: str):
        self.work, self.tensor, self.mesh, self.axis, self.what = work, tensor, mesh, axis, what

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            _wait(self.work, self.mesh, self.what, self.axis)
            self.work = None
        return self.tensor


CHANNELS = 4  # communicators a message may take between two pp ranks (isend's channel)


def _group(mesh: "Mesh", axis: str, channel: int):
    """The communicator of ``channel``: 0 the default group, 1 the axis's group, 2 and 3 its lanes 0 and 1."""
    if not 0 <= channel < CHANNELS:
        raise CollectiveError(f"p2p channel {channel} does not exist (0 .. {CHANNELS - 1})")
    return None if channel == 0 else mesh.group(axis) if channel == 1 else mesh.lane(axis, channel - 2)


def _ranks(mesh: "Mesh", axis: str, channel: int) -> tuple:
    """The recorded name of a message's communicator: its channel, then its ranks."""
    return (f"channel {channel}", *(mesh.group_ranks(axis) if channel else range(mesh.size)))


def _peer(mesh: "Mesh", axis: str, coord: int, what: str) -> int:
    n = mesh.axis_size(axis)
    if not 0 <= coord < n:
        raise CollectiveError(f"{what}: coordinate {coord} is outside mesh axis '{axis}' of size {n}")
    if coord == mesh.coord(axis):
        raise CollectiveError(f"{what}: rank {mesh.rank} cannot exchange with itself along '{axis}'")
    return mesh.group_ranks(axis)[coord]


def sendrecv(
    mesh: "Mesh",
    axis: str,
    sends: Sequence[tuple[torch.Tensor, int]] = (),
    recvs: Sequence[tuple[torch.Tensor, int]] = (),
) -> None:
    """Post every send ``(tensor, dst_coord)`` and receive ``(buffer, src_coord)`` along ``axis`` at once, then wait.

    Coordinates are positions along ``axis`` (pipeline stage numbers for ``"pp"``). Receives fill their buffers in
    place. Batching both directions in one call cannot deadlock the way blocking send-then-recv pairs can.
    """
    mesh.comm.sendrecv(mesh, axis, sends, recvs)


def send(x: torch.Tensor, mesh: "Mesh", axis: str, dst: int) -> None:
    """Send ``x`` to the rank at coordinate ``dst`` along ``axis``."""
    sendrecv(mesh, axis, sends=[(x, dst)])


def recv(buf: torch.Tensor, mesh: "Mesh", axis: str, src: int) -> torch.Tensor:
    """Receive into ``buf`` (shape and dtype must match what is sent) from coordinate ``src`` along ``axis``."""
    sendrecv(mesh, axis, recvs=[(buf, src)])
    return buf


def gather_blocks_to(
    block: torch.Tensor | None, mesh: "Mesh", sources: Sequence[int], dst: int
) -> list[torch.Tensor] | None:
    """World-rank gather of one block from each rank in ``sources`` onto rank ``dst`` (blocks of one shape).

    Used by :func:`funcpar.parallel.sharding.gather` with ``dst``: only the ranks owning distinct blocks send, so
    replicated copies never move. Returns the blocks in ``sources`` order on ``dst``, ``None`` elsewhere.
    """
    me = mesh.rank
    if me == dst:
        out: list[torch.Tensor] = []
        ops = []
        for r in sources:
            if r == me:
                out.append(block.contiguous())
            else:
                buf = torch.empty_like(block, memory_format=torch.contiguous_format)
                ops.append(dist.P2POp(dist.irecv, buf, r))
                out.append(buf)
        for work in dist.batch_isend_irecv(ops) if ops else []:
            _wait(work, mesh, f"gather to rank {dst}", "world")
        return out
    if me in sources:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, block.contiguous(), dst)]):
            _wait(work, mesh, f"gather to rank {dst}", "world")
    return None


def isend(x: torch.Tensor, mesh: "Mesh", axis: str, dst: int, tag: int, channel: int = 0) -> Pending:
    """Start sending ``x`` to coordinate ``dst`` along ``axis`` under ``tag``; ``x`` must not change until the
    returned :class:`Pending` has been waited for (it keeps a reference). ``channel`` 0 goes over the default
    group, 1 over the axis's own group, 2 and 3 over its lanes: separate communicators, so that each stream of
    messages between the same ranks keeps its own order where the backend matches by order rather than by tag
    (NCCL), and flows one way only (two ranks sending to each other on one NCCL communicator can wait on each
    other's receive forever)."""
    return mesh.comm.isend(x.detach().contiguous(), mesh, axis, dst, tag, channel)


def irecv(buf: torch.Tensor, mesh: "Mesh", axis: str, src: int, tag: int, channel: int = 0) -> Pending:
    """Start receiving into ``buf`` (the sender's shape and dtype) from coordinate ``src`` along ``axis`` under
    ``tag``, on ``channel`` (see :func:`isend`)."""
    return mesh.comm.irecv(buf, mesh, axis, src, tag, channel)


class Wire(CollectiveWire):
    """A :class:`funcpar.Mesh`'s communication: :class:`~funcpar.parallel.collectives.CollectiveWire`'s collectives
    and torch.distributed's messages, each posted (and recorded: :func:`funcpar.parallel.transport.recording`) on
    the communicator of its channel. The methods do what :func:`sendrecv`, :func:`isend` and :func:`irecv` say."""

    def sendrecv(self, mesh: "Mesh", axis: str, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        ops = [dist.P2POp(dist.isend, t.contiguous(), _peer(mesh, axis, c, "send")) for t, c in sends]
        ops += [dist.P2POp(dist.irecv, b, _peer(mesh, axis, c, "recv")) for b, c in recvs]
        for op in ops:
            transport.note_p2p(mesh, "send" if op.op is dist.isend else "recv", _ranks(mesh, axis, 0), op.peer, 0,
                               op.tensor.nbytes)
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            _wait(work, mesh, "send/recv", axis)

    def isend(self, x: torch.Tensor, mesh: "Mesh", axis: str, dst: int, tag: int, channel: int) -> Pending:
        peer, group = _peer(mesh, axis, dst, "send"), _group(mesh, axis, channel)
        tag = tag if USE_TAGS else 0
        transport.note_p2p(mesh, "send", _ranks(mesh, axis, channel), peer, tag, x.nbytes)
        return Pending(dist.isend(x, peer, group=group, tag=tag), x, mesh, axis, f"send to {axis}={dst} (tag {tag})")

    def irecv(self, buf: torch.Tensor, mesh: "Mesh", axis: str, src: int, tag: int, channel: int) -> Pending:
        peer, group = _peer(mesh, axis, src, "recv"), _group(mesh, axis, channel)
        tag = tag if USE_TAGS else 0
        transport.note_p2p(mesh, "recv", _ranks(mesh, axis, channel), peer, tag, buf.nbytes)
        return Pending(dist.irecv(buf, peer, group=group, tag=tag), buf, mesh, axis,
                       f"receive from {axis}={src} (tag {tag})")


@simulated_wire
class Simulation(CollectiveSimulation):
    """An abstract mesh's communication (planning): :class:`~funcpar.parallel.collectives.CollectiveSimulation`'s
    collectives, and messages that go nowhere: a send counts what it would send (as a ring counts twice its bytes:
    all of them at n=2), a receive leaves its buffer as it is (so a buffer prepared with what this rank would have
    been sent is what it receives: every rank is taken to hold this rank's values). Nothing waits."""

    def sendrecv(self, mesh: "Mesh", axis: str, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        for t, _ in sends:
            _count(mesh, axis, 2 * t.numel() * t.element_size())

    def isend(self, x: torch.Tensor, mesh: "Mesh", axis: str, dst: int, tag: int, channel: int) -> Pending:
        _count(mesh, axis, 2 * x.numel() * x.element_size())  # counts (n-1)/n of it: all of x, at n=2
        return Pending(None, x, mesh, axis, "send")

    def irecv(self, buf: torch.Tensor, mesh: "Mesh", axis: str, src: int, tag: int, channel: int) -> Pending:
        return Pending(None, buf, mesh, axis, "recv")


WIRE, SIMULATION = Wire(), Simulation()  # (stateless: one of each serves every mesh of its kind)
