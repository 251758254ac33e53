"""What every collective stands on: bounded waits, traffic counting, and the host rings.

:func:`wait` bounds each wait by the mesh's timeout and turns a dead or stuck peer into a :class:`CollectiveError`
naming the axis and the ranks; :func:`count` adds what a ring sends to ``mesh.traffic``.
:mod:`funcpar.parallel.collectives` and :mod:`funcpar.parallel.p2p` are the only other modules that call
torch.distributed.

The rings. gloo's own reduce-scatter and all-gather stage whole copies of their tensors and take several times the
time of its all-reduce of the same bytes. On host tensors (gloo) funcpar runs them as rings of send/recv pairs
instead (torch.distributed's ``batch_isend_irecv``, in messages of at most ``MESSAGE_BYTES``; figures in
docs/MEASUREMENTS.md): (n-1)/n of the bytes sent per rank as a ring's, the sums in one fixed order. CUDA tensors
(NCCL) keep the native collectives.

A reduce-scatter's input need not exist as one tensor: it is given as *segments*, ``[(offset, 1-D tensor)]`` placed
in a flat range of ``total`` elements (zeros between them). The train step hands its gradient leaves so, and the
ring sends and adds each block's pieces where they lie, with no bucket-sized copy of them (:func:`pieces`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from funcpar.tree import first_difference

if TYPE_CHECKING:  # pragma: no cover
    from funcpar.parallel.mesh import Mesh

_COUNTING = threading.Lock()
Segments = list[tuple[int, torch.Tensor]]  # (offset in the flat range, 1-D tensor), sorted, not overlapping
# The largest message a ring sends: gloo's transfers of a whole 32 MB block run slower than of the same bytes in 4 MB
# messages (2 ranks, the benchmark machine: ZeRO's gradient reduce-scatter 23.9 -> 21.3 ms, its all-gather 32.6 -> 20.2)
MESSAGE_BYTES = 4 << 20


class CollectiveError(RuntimeError):
    """A collective that cannot run: bad shape for the axis, or a peer that failed or timed out."""


def wait(work, mesh: "Mesh", what: str, axis: str) -> None:
    """Wait for ``work`` at most the mesh's timeout; a failure or the timeout raises, naming the axis and ranks."""
    where = (
        f"mesh axis '{axis}' of {mesh!r} (rank {mesh.rank}, group ranks {mesh.group_ranks(axis)})"
        if axis in mesh.axis_names
        else f"{mesh!r} (rank {mesh.rank})"
    )
    try:
        # On a CUDA mesh the wait is the stream's, not the host's: NCCL's work.wait(timeout=...) blocks the host
        # until the collective is done, so the host could not queue the next kernels meanwhile. The bound is then
        # the process group's own timeout (the mesh's, given at init_process_group and new_group): NCCL's watchdog
        # ends a collective stuck past it and the rank with it, and gloo's host work raises as below.
        ok = work.wait() if mesh.device.type == "cuda" else work.wait(timeout=mesh.timeout)
    except Exception as e:  # gloo/nccl raise on a dead peer or on the timeout
        raise CollectiveError(
            f"{what} over {where} failed: a peer rank has died or stopped responding "
            f"(timeout {mesh.timeout.total_seconds():g} s). Cause: {e}"
        ) from e
    if ok is False:
        raise CollectiveError(
            f"{what} over {where} did not complete within {mesh.timeout.total_seconds():g} s: "
            f"a peer rank has died or stopped responding"
        )


def count(mesh: "Mesh", axis: str, nbytes: float, op: str | None = None) -> int:
    """Add to ``mesh.traffic[axis]`` what a ring algorithm sends from this rank for a collective moving ``nbytes``
    ((n-1)/n of them); returns the group's size. Real and abstract meshes count alike, so a run's measured bytes
    per axis can be set beside the plan's and the analytic figure. Every collective posted on a wire is counted as
    it is posted, under its name ``op``, so this is also where :func:`recording` sees it; an abstract mesh's
    stand-ins name none (nothing posted, nothing recorded)."""
    n = mesh.size if axis == "world" else mesh.axis_size(axis)
    with _COUNTING:  # (a thread of the program's own may count too)
        mesh.traffic[axis] = mesh.traffic.get(axis, 0) + nbytes * (n - 1) / n
    if op is not None:
        note_collective(mesh, axis, op, nbytes)
    return n


# ------------------------------------------------------------------ NCCL's rules, recorded and checked on gloo
# NCCL matches a collective by its position in each communicator's sequence (every member must post the same ones
# in the same order) and a point-to-point message by its position among those between the same two ranks on the
# same communicator: it ignores tags. gloo matches messages by tag, so a schedule whose correctness leans on tags
# runs here and fails on GPUs. ``recording()`` logs what this process posts; :func:`check_sequences` holds every
# rank's log to NCCL's rules; ``USE_TAGS = False`` (or FUNCPAR_P2P_TAGS=0) posts every message of funcpar.parallel.p2p
# under one tag, so gloo too matches them in posting order, as NCCL does.
_RECORD: list | None = None


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Log what this process posts while inside: ``("collective", group ranks, op, bytes)`` and ``("p2p", "send" or
    "recv", group ranks, this rank, peer rank, tag, bytes)``, in posting order. Plain tuples: they pickle."""
    global _RECORD
    old, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = old


def _group_key(mesh: "Mesh", axis: str | None) -> tuple:
    return tuple(range(mesh.size)) if axis in (None, "world") else tuple(mesh.group_ranks(axis))


def note_collective(mesh: "Mesh", axis: str, op: str, nbytes: float) -> None:
    """Record a collective as it is posted (see :func:`recording`)."""
    if _RECORD is not None:
        with _COUNTING:
            _RECORD.append(("collective", _group_key(mesh, axis), op, int(nbytes)))


def note_p2p(mesh: "Mesh", kind: str, group_ranks: tuple, peer: int, tag: int, nbytes: int) -> None:
    """Record a point-to-point send or receive as it is posted (see :func:`recording`)."""
    if _RECORD is not None:
        with _COUNTING:
            _RECORD.append(("p2p", kind, tuple(group_ranks), mesh.rank, peer, tag, int(nbytes)))


def check_sequences(logs: list[list[tuple]]) -> None:
    """Raise :class:`CollectiveError` unless the ranks' logs (``logs[rank]``, from :func:`recording` over the same
    stretch of work) keep NCCL's rules: on every group, each member posted the same collectives (op and bytes) in
    the same order; between every two ranks on every group, the k-th message one sent is the k-th the other
    received, with the same tag and size (so matching by posting order pairs them as their tags do)."""
    colls: dict[tuple, dict[int, list]] = {}
    sends: dict[tuple, list] = {}
    recvs: dict[tuple, list] = {}
    for rank, log in enumerate(logs):
        for e in log:
            if e[0] == "collective":
                colls.setdefault(e[1], {}).setdefault(rank, []).append(e[2:])
            else:
                _, kind, group, me, peer, tag, nbytes = e
                pair = (group, me, peer) if kind == "send" else (group, peer, me)
                (sends if kind == "send" else recvs).setdefault(pair, []).append((tag, nbytes))
    for group, by_rank in colls.items():
        seqs = {r: by_rank.get(r, []) for r in group}
        first = group[0]
        for r, seq in seqs.items():
            if seq != seqs[first]:
                k = first_difference(seq, seqs[first])
                raise CollectiveError(
                    f"ranks {first} and {r} of group {list(group)} post different collectives: #{k} is "
                    f"{_entry(seqs[first], k)} on rank {first} and {_entry(seq, k)} on rank {r} (NCCL would hang "
                    f"or mix their data)")
    for pair in sorted(set(sends) | set(recvs)):
        s, r = sends.get(pair, []), recvs.get(pair, [])
        if s != r:
            k = first_difference(s, r)
            group, src, dst = pair
            raise CollectiveError(
                f"messages from rank {src} to rank {dst} (group {list(group)}): send #{k} is {_entry(s, k)} but "
                f"receive #{k} is {_entry(r, k)}: NCCL pairs them by posting order, not by tag")


def _entry(seq: list, k: int) -> str:
    return "(none)" if k >= len(seq) else " ".join(map(str, seq[k]))


def pieces(segs: Segments, lo: int, hi: int) -> Segments:
    """The parts of ``segs`` inside ``[lo, hi)``, as (offset from ``lo``, view) pairs."""
    out = []
    for start, t in segs:
        a, z = max(lo, start), min(hi, start + t.numel())
        if a < z:
            out.append((a - lo, t[a - start : z - start]))
    return out


def fill(out: torch.Tensor, part: Segments) -> torch.Tensor:
    """``out`` (1-D) = the pieces ``part`` at their offsets, zeros elsewhere."""
    if sum(t.numel() for _, t in part) < out.numel():
        out.zero_()
    for o, t in part:
        out[o : o + t.numel()].copy_(t)
    return out


def messages(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ts`` cut into messages of at most ``MESSAGE_BYTES`` (views, in order): the same cut on both ends of a pair."""
    return [m for t in ts for m in (t.split(MESSAGE_BYTES // t.element_size()) if t.nbytes > MESSAGE_BYTES else [t])]


def exchange(send: list[torch.Tensor], recv: list[torch.Tensor], mesh: "Mesh", axis: str, what: str) -> None:
    """Send the tensors ``send`` to the next rank of ``axis``'s ring and receive ``recv`` from the previous one,
    pairwise in order (both ranks cut their blocks alike), as messages of at most ``MESSAGE_BYTES``."""
    ranks, i = mesh.group_ranks(axis), mesh.coord(axis)
    n, group = len(ranks), mesh.group(axis)
    send, recv = messages(send), messages(recv)
    ops = [dist.P2POp(dist.isend, t, ranks[(i + 1) % n], group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, ranks[(i - 1) % n], group) for t in recv]
    for work in dist.batch_isend_irecv(ops) if ops else []:  # (a block of padding alone: nothing to send)
        wait(work, mesh, what, axis)


def ring_reduce_scatter(segs: Segments, total: int, out: torch.Tensor, mesh: "Mesh", axis: str) -> None:
    """``out`` (1-D) = the sum over ``axis`` of block ``coord(axis)`` of the flat range ``segs`` describe: at step s
    each rank passes on its running sum of block (i-1-s) mod n and adds its own term to the one it receives; the
    last lands in ``out``. Step 0 sends the block's pieces as they lie and receives them into their places."""
    n, i, k = mesh.axis_size(axis), mesh.coord(axis), out.numel()
    block = [pieces(segs, j * k, (j + 1) * k) for j in range(n)]
    spare = [torch.empty_like(out) for _ in range(min(n - 2, 2))]
    send = [t for _, t in block[(i - 1) % n]]
    for s in range(n - 1):
        recv, mine = out if s == n - 2 else spare[s % 2], block[(i - s - 2) % n]
        if s == 0:  # the previous rank's raw pieces of the block this rank adds to, into their places
            if sum(t.numel() for _, t in mine) < k:
                recv.zero_()  # (padding: no piece covers it)
            exchange(send, [recv[o : o + t.numel()] for o, t in mine], mesh, axis, "reduce_scatter")
        else:
            exchange(send, [recv], mesh, axis, "reduce_scatter")
        for o, t in mine:
            recv[o : o + t.numel()].add_(t)
        send = [recv]


def ring_all_gather(xm: torch.Tensor, out: torch.Tensor, mesh: "Mesh", axis: str) -> None:
    """Every rank's ``xm`` as block ``coord`` of ``out``: at step s each rank passes on block (i-s) mod n. ``xm``
    may be that block of ``out`` already (in place)."""
    n, i = mesh.axis_size(axis), mesh.coord(axis)
    blocks = out.chunk(n)
    if blocks[i].data_ptr() != xm.data_ptr():
        blocks[i].copy_(xm)
    for s in range(n - 1):
        exchange([blocks[(i - s) % n]], [blocks[(i - s - 1) % n]], mesh, axis, "all_gather")
