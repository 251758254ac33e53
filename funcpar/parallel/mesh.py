"""The named device mesh: ``Mesh(tp=4, dp=2)``, any axis names, over the ranks of a torch.distributed job.

Every mesh has the axes ``pp``, ``dp`` and ``tp`` (size 1 unless given) and any others a caller names
(``Mesh(dp=2, ep=2, tp=2)``). Axis order, outermost first: ``pp``, ``dp``, the other named axes in the order given,
``tp`` innermost, so a tp group is a run of consecutive ranks (one node's GPUs, where the traffic is heaviest). For
``Mesh(tp=4, dp=2)`` the tp groups are {0,1,2,3} {4,5,6,7} and the dp groups {0,4} {1,5} {2,6} {3,7}.

A mesh of size 1 (``Mesh()``) needs no torch.distributed at all: every collective over it is the identity, so the
same model code is the single-device program. A larger mesh joins the job it runs in and must cover the whole world;
it starts the job (:func:`init_distributed`: the process group from torchrun's environment, gloo on CPUs and NCCL on
CUDA; the exit hooks; the lifeline) unless the program already did.

A mesh is a value of one of two kinds, siblings under :class:`MeshBase` (the axes, coordinates, views and scope):
:class:`Mesh`, over the processes of a job, and :class:`AbstractMesh` (``Mesh.abstract(tp=4, dp=2)``), a mesh's
sizes without processes, for planning. Each kind carries its communication, ``mesh.comm``, which every collective and
message calls through (:mod:`funcpar.parallel.p2p`: ``Wire`` posts on torch.distributed's groups, ``Simulation``
counts what would be sent and fills buffers as if every rank held this rank's values).

The mesh in scope: ``with mesh:`` makes ``mesh`` the one :meth:`Mesh.current` returns (as JAX's ``with mesh:``);
outside any ``with``, it is the only multi-process mesh this process built, or ``Mesh()`` in a one-process program.
APIs that take ``mesh=None`` use it.
"""

from __future__ import annotations

import atexit
import copy
import faulthandler
import gc
import contextvars
import datetime
import importlib
import math
import os
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from funcpar.parallel import lifeline
from funcpar.parallel.p2p import SIMULATION, WIRE

__all__ = ["Mesh", "AbstractMesh", "MeshBase", "MeshError", "init_distributed", "STANDARD_AXES", "CONTEXT_LAYOUTS",
           "DEVICES", "default_timeout", "resolve_device"]

STANDARD_AXES = ("pp", "dp", "tp")  # present on every mesh; pp outermost, tp innermost
CONTEXT_LAYOUTS = ("zigzag", "contiguous")  # how a cp axis splits each sequence (Mesh.context_layout)
_SCOPE: contextvars.ContextVar[tuple] = contextvars.ContextVar("funcpar_mesh_scope", default=())
_BUILT: "weakref.WeakSet[Mesh]" = weakref.WeakSet()


class MeshError(RuntimeError):
    """A mesh that cannot be built in this process or world."""


def default_timeout() -> datetime.timedelta:
    """How long a collective may wait for a peer: ``$FUNCPAR_TIMEOUT`` seconds, else 600 s."""
    return datetime.timedelta(seconds=float(os.environ.get("FUNCPAR_TIMEOUT", "600")))


def _as_timedelta(t: float | datetime.timedelta | None) -> datetime.timedelta:
    if t is None:
        return default_timeout()
    if isinstance(t, datetime.timedelta):
        return t
    return datetime.timedelta(seconds=float(t))


DEVICES = ("auto", "cpu", "cuda")  # the choices of --device; Mesh(device=) also takes "cuda:N" or a torch.device


def _local_ranks() -> tuple[int, int]:
    """This process's rank on its node and the number of ranks there (torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE;
    one rank alone when they are unset)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return local_rank, max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), local_rank + 1)


def _default_backend(device: torch.device) -> str:
    """torch.distributed's backend for ranks on ``device``: NCCL for CUDA tensors (gloo beside it for host ones)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _too_few_gpus(local_world: int, gpus: int) -> str:
    n, seen = max(gpus, 1), os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"CUDA_VISIBLE_DEVICES={seen!r}" if seen is not None else "torch.cuda.device_count()"
    example = "1" if n == 1 else f"dp={n}"
    return (f"{local_world} ranks on this node but {gpus} GPU{'s' if gpus != 1 else ''} visible ({where}): run at "
            f"most {n} rank{'s' if n > 1 else ''} per node (a mesh of {n} here, e.g. --mesh {example}; "
            f"under torchrun --nproc-per-node {n}), or run the ranks on the CPU (--device cpu; "
            f"Mesh(device='cpu') in Python)")


def resolve_device(device: "str | torch.device | None" = None, *, local_rank: int | None = None,
                   local_world: int | None = None) -> tuple[torch.device, str | None]:
    """Where this rank's tensors live, and why it is not the GPU where ``auto`` chose the CPU beside a GPU.

    ``"cpu"``; ``"cuda"``: ``cuda:$LOCAL_RANK`` (the rank on its node, never the global rank: a two-node job's rank
    5 on 4-GPU nodes is ``cuda:1``), refused (:class:`MeshError`, both numbers and the ways out) when the node's
    ranks outnumber its visible GPUs, since NCCL refuses two ranks on one GPU; ``"cuda:N"`` as given; ``"auto"`` or
    ``None``: ``cuda`` when every rank of the node has a GPU of its own, else ``cpu`` (with the reason returned, for
    a warning). The same answer on every rank of a node: it reads only the node's environment."""
    lr, lw = _local_ranks()
    local_rank = lr if local_rank is None else local_rank
    local_world = lw if local_world is None else local_world
    choice = "auto" if device is None else device
    if isinstance(choice, str) and choice not in ("auto", "cuda"):
        try:
            choice = torch.device(choice)
        except RuntimeError:
            raise MeshError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}, 'cuda:N' or a "
                            f"torch.device") from None
    if isinstance(choice, torch.device) and choice.type != "cuda":
        return choice, None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "auto":
        if gpus and gpus >= local_world:
            return torch.device("cuda", local_rank), None
        why = _too_few_gpus(local_world, gpus) if gpus else None
        return torch.device("cpu"), why
    if not gpus:
        raise MeshError(f"device {str(device)!r} asked for, but no GPU is visible here (torch {torch.__version__}, "
                        f"CUDA {'built in' if torch.backends.cuda.is_built() else 'not built in'}): use "
                        f"device 'cpu' or 'auto', or a CUDA build of torch on a machine with a GPU")
    if choice == "cuda":
        if local_world > gpus:
            raise MeshError(_too_few_gpus(local_world, gpus))
        return torch.device("cuda", local_rank), None
    index = choice.index if choice.index is not None else local_rank
    if index >= gpus:
        raise MeshError(f"device 'cuda:{index}' asked for, but only {gpus} GPU{'s' if gpus != 1 else ''} visible: "
                        f"use cuda:0 .. cuda:{gpus - 1}, or device 'cuda' (cuda:$LOCAL_RANK)")
    return torch.device("cuda", index), None


def _destroy_process_groups() -> None:
    """At exit, tear down the process groups funcpar created while the interpreter is still whole: destroy them, drop
    the meshes' handles to them and collect, so that gloo's worker threads are joined here. Left to interpreter
    finalization (a handle outliving ``destroy_process_group`` keeps a group and its threads alive), those threads
    can still hold work whose tensors need the GIL, and the rank dies with SIGABRT ("terminate called without an
    active exception"; pytorch/pytorch#190489, #179291)."""
    lifeline.stop()  # first: the peers stop watching this rank
    for mesh in list(_BUILT):
        mesh._groups, mesh._lanes = {}, {}
    if dist.is_available() and dist.is_initialized():  # (the program's own world too: nothing runs after this)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; nothing to report to
            pass
    gc.collect()


def _cli_process() -> bool:
    """Whether this process is funcpar's own command line (``funcpar ...`` or ``python -m funcpar``, whose package is
    imported while ``sys.argv[0]`` is still ``-m``): its ranks start the world through :func:`_start_world`."""
    import sys

    first = sys.argv[0] if sys.argv else ""
    return first == "-m" or os.path.basename(first) == "funcpar"


def _before_any_group() -> None:
    """At import, before a program can start a process group of its own (``dist.init_process_group`` in a script
    that imports funcpar first, as torchtitan's and most scripts do): import torch._dynamo now, which the first
    ``torch.func.grad`` imports anyway and which, imported once a group exists, holds references to it that outlive
    ``destroy_process_group`` (its gloo threads then abort the rank at interpreter exit: issue 56, 1 run in 20 of
    an 8-rank job); and register the exit teardown first, so that it runs after the program's own exit handlers.
    funcpar's command line skips the import (1.7 s of its start-up): its ranks import it before their world."""
    atexit.register(_destroy_process_groups)
    if not _cli_process() and dist.is_available() and not dist.is_initialized():
        importlib.import_module("torch._dynamo")


def _report_fatal_signals() -> None:
    """A rank that dies of a signal (SIGABRT from a C++ ``terminate``, SIGSEGV, ...) prints the Python stack of each
    thread to stderr before it goes, so the launcher's "exitcode -6" comes with the line that was running. Left alone
    if the program (or ``python -X faulthandler``) set it up already."""
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(all_threads=True)
        except (ValueError, OSError, AttributeError, RuntimeError):  # no usable stderr (closed, None): nothing to do
            pass


_NOT_LAUNCHED = ("this process is not part of a torch.distributed job (RANK/WORLD_SIZE are unset): launch it with "
                 "torchrun --nproc-per-node {n} ..., or use Mesh() for a single process")


def _launched() -> bool:
    """Whether a launcher (torchrun) set this process's place in a job."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_distributed(
    *,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    heartbeat: float | None = None,
    device: str | torch.device | None = None,
) -> None:
    """Start this process's part of the torch.distributed job it was launched in: the one place that starts the world.

    Once per process: the default process group, from the launcher's environment (torchrun's ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``; after an elastic restart, under this attempt's prefix of the
    agent's store); the exit hook that tears the process groups down while the interpreter is whole; a Python stack
    on a fatal signal; and the lifeline (:mod:`funcpar.parallel.lifeline`: the worker ends with its launcher, a
    stuck peer is reported). A mesh of more than one process calls it (``Mesh(tp=4, dp=2)`` alone under torchrun
    starts the job); call it first to start the job apart from any mesh. A job the program started itself
    (``torch.distributed.init_process_group``) stays the program's: only the lifeline is added. Called again: nothing
    new, unless ``heartbeat`` differs from the running lifeline's (restarted at the new interval).

    Args:
        backend: torch.distributed's backend; default ``gloo`` on the CPU and ``cpu:gloo,cuda:nccl`` on CUDA.
        timeout: seconds (or a ``timedelta``) the default group's collectives may wait; default
            :func:`default_timeout`.
        heartbeat: the lifeline's interval in seconds (0: off); default the running lifeline's, else
            ``$FUNCPAR_HEARTBEAT`` or 60 s.
        device: this rank's device (:func:`resolve_device`; default ``"auto"``): a CUDA device is made current
            before the group starts, and chooses the default backend.

    Raises:
        MeshError: outside a launched job (``RANK``/``WORLD_SIZE`` unset), or a device that is unknown or not
            available here.
    """
    if not dist.is_initialized():
        if not _launched():
            raise MeshError("funcpar.init_distributed: " + _NOT_LAUNCHED.format(n="N"))
        where = resolve_device(device)[0]
        _start_world(backend or _default_backend(where), _as_timedelta(timeout), where)
    lifeline.start(dist.get_rank(), dist.get_world_size(), heartbeat)


def _start_world(backend: str, timeout: datetime.timedelta, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torch._dynamo (imported by the first torch.func.grad) keeps references to the default group when it is
    # imported after the group exists; they outlive destroy_process_group and keep gloo's threads running into
    # interpreter finalization, where they abort the rank (issue 16). Imported first, it holds none. (Not an
    # `import torch._dynamo` statement: that would make `torch` a local name of this whole function, unbound
    # at the set_device above: issue 40.)
    importlib.import_module("torch._dynamo")

    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    _report_fatal_signals()


def _axis_sizes(axes: dict[str, Any]) -> dict[str, int]:
    for name, n in axes.items():
        if not name.isidentifier():
            raise MeshError(f"mesh axis name {name!r} is not an identifier")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise MeshError(f"Mesh axis '{name}' must be a positive int, got {n!r}")
    others = [a for a in axes if a not in STANDARD_AXES]
    order = ["pp", "dp", *others, "tp"]
    return {a: axes.get(a, 1) for a in order}


class MeshBase:
    """What every mesh is, as an immutable value: named axes over ranks, this rank's coordinates along them, views
    (sequence parallelism, a cp layout, packed documents), the scope (``with mesh:``), the bytes sent by axis
    (``traffic``) and how its messages travel (``comm``). Two kinds derive from it, siblings: :class:`Mesh`, over the
    processes of a torch.distributed job, and :class:`AbstractMesh`, a mesh's sizes without processes (planning).
    Code that takes either kind takes this type.

    ``comm`` is where the kinds differ for the collectives (:mod:`funcpar.parallel.collectives`) and messages
    (:mod:`funcpar.parallel.p2p`), which call through it: a :class:`funcpar.parallel.p2p.Wire` over torch.distributed's
    process groups, or a :class:`funcpar.parallel.p2p.Simulation` that only counts. A mesh has no process group of its
    own unless it is a :class:`Mesh` of more than one process (:meth:`group`, :meth:`lane`: ``None``).
    """

    comm: Any  # the kind's communication: a class attribute of each kind
    simulated = False  # (AbstractMesh: a plan's tensors are meta, they hold no values)

    def __init__(self, **axes: int):
        self._sizes = _axis_sizes(axes)
        self.size = math.prod(self._sizes.values())
        # bytes this rank has sent by axis (ring count; funcpar.parallel.transport.count)
        self.traffic: dict[str, float] = {}

    # Megatron's sequence parallelism on the tp axis: between tp regions a model's hidden state is this rank's block
    # of the sequence (funcpar.nn.layers reads it: column_parallel gathers the sequence, row-parallel outputs are
    # reduce-scattered along it). Set on a view of the mesh: with_sequence_parallel.
    sequence_parallel = False

    def with_sequence_parallel(self, on: bool = True) -> "MeshBase":
        """This mesh with sequence parallelism on its ``tp`` axis (see ``sequence_parallel``): the same processes,
        groups and traffic counts, a different way for a model to lay out its activations."""
        view = copy.copy(self)
        view.sequence_parallel = bool(on)
        return view

    # How a cp axis lays out each sequence (funcpar.nn.layers.context_chunk reads it): "zigzag", the default, gives cp
    # rank c pieces c and 2cp-1-c of 2cp (every rank then attends over as many keys as every other: causal
    # attention's work per rank is balanced); "contiguous" gives it chunk c of cp (the last rank attends over all
    # the keys, the first over its own). Set on a view of the mesh: with_context_layout.
    context_layout = "zigzag"

    def with_context_layout(self, layout: str) -> "MeshBase":
        """This mesh with each sequence laid out over ``cp`` as ``layout`` (``"zigzag"`` or ``"contiguous"``; see
        ``context_layout``): the same processes and groups."""
        if layout not in CONTEXT_LAYOUTS:
            raise MeshError(f"context layout {layout!r} is not one of {', '.join(CONTEXT_LAYOUTS)}")
        view = copy.copy(self)
        view.context_layout = layout
        return view

    # The documents of the batch being computed (a funcpar.nn.documents.Documents), when its rows are packed samples
    # that each attend only to themselves; None: every row is one sequence. Set on a view: with_documents.
    documents = None

    def with_documents(self, documents) -> "MeshBase":
        """This mesh carrying a batch's packed ``documents`` (a :class:`funcpar.nn.documents.Documents`), for a
        model's layers: itself when None."""
        if documents is None:
            return self
        view = copy.copy(self)
        view.documents = documents
        return view

    # ------------------------------------------------------------------ scope
    def __enter__(self) -> "MeshBase":
        self._tokens = getattr(self, "_tokens", []) + [_SCOPE.set(_SCOPE.get() + (self,))]
        return self

    def __exit__(self, *exc) -> None:
        _SCOPE.reset(self._tokens.pop())

    @staticmethod
    def current() -> "MeshBase":
        """The mesh in scope: the innermost ``with mesh:``, else the only multi-process mesh built in this process,
        else ``Mesh()`` when this process is not part of a larger torch.distributed world."""
        scope = _SCOPE.get()
        if scope:
            return scope[-1]
        built = list(_BUILT)
        if len(built) == 1:
            return built[0]
        if len(built) > 1:
            raise MeshError(
                f"several meshes exist in this process ({', '.join(map(repr, built))}): say which one with "
                f"`with mesh:` or pass mesh="
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise MeshError(
                f"no mesh in scope in a {dist.get_world_size()}-process job: build one (e.g. Mesh(tp=2, dp=2)) "
                f"and use `with mesh:` or pass mesh="
            )
        return Mesh()

    # ------------------------------------------------------------------ queries
    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, outermost first (``pp``, ``dp``, others, ``tp``)."""
        return tuple(self._sizes)

    @property
    def shape(self) -> dict[str, int]:
        """Axis sizes by name, outermost first."""
        return dict(self._sizes)

    def _check_axis(self, axis: str) -> None:
        if axis not in self._sizes:
            raise MeshError(f"unknown mesh axis {axis!r}: the axes are {', '.join(self._sizes)}")

    def axis_size(self, axis: str) -> int:
        self._check_axis(axis)
        return self._sizes[axis]

    def coord(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        self._check_axis(axis)
        return self._coords[axis]

    @property
    def coords(self) -> dict[str, int]:
        return dict(self._coords)

    def group(self, axis: str):
        """This rank's ProcessGroup along ``axis``: ``None`` here (one process, or no processes at all)."""
        self._check_axis(axis)
        return None

    def lane(self, axis: str, k: int = 0):
        """The ``k``-th extra ProcessGroup over this rank's ``axis`` group (see :meth:`Mesh.lane`): ``None`` here."""
        self._check_axis(axis)
        return None

    def group_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``, in coordinate order."""
        self._check_axis(axis)
        return list(self._group_ranks[axis])

    def data_block(self, axes=("dp",)) -> tuple[int, int]:
        """``(blocks, this rank's block)`` of a batch split over the data ``axes`` of this mesh (a cp axis shares
        each row, so it splits none; axes the mesh lacks are left out): dp-major, as the axes are named."""
        blocks, index = 1, 0
        for a in self._splitting(axes):
            blocks, index = blocks * self._sizes[a], index * self._sizes[a] + self.coord(a)
        return blocks, index

    def data_text(self, axes=("dp",)) -> str:
        """The data axes that split a batch, as a message names them (``dp=2`` or ``dp=2 x ep=2``)."""
        return " x ".join(f"{a}={self._sizes[a]}" for a in self._splitting(axes)) or "dp=1"

    def _splitting(self, axes) -> list[str]:
        """Those of ``axes`` this mesh has that split a batch's rows (cp splits each row instead)."""
        return [a for a in axes if a != "cp" and a in self._sizes]

    def coords_of(self, rank: int) -> dict[str, int]:
        out = {}
        for axis in reversed(self.axis_names):
            rank, out[axis] = divmod(rank, self._sizes[axis])
        return {a: out[a] for a in self.axis_names}

    def rank_of(self, **coords: int) -> int:
        for a in coords:
            self._check_axis(a)
        rank = 0
        for axis in self.axis_names:
            rank = rank * self._sizes[axis] + coords.get(axis, 0)
        return rank

    def __repr__(self) -> str:
        extra = [a for a in self._sizes if a not in STANDARD_AXES]
        shown = ["pp", "dp", *extra, "tp"]
        sp = ", sequence_parallel" if self.sequence_parallel else ""
        if self.context_layout != "zigzag" and self._sizes.get("cp", 1) > 1:
            sp += f", context_layout={self.context_layout!r}"
        return "Mesh(" + ", ".join(f"{a}={self._sizes[a]}" for a in shown) + sp + ")"


class Mesh(MeshBase):
    """A named mesh over the processes of a torch.distributed job.

    Collectives, specs and the train step name axes of a mesh rather than process groups. A mesh of size 1 needs no
    torch.distributed; a larger one joins the job it runs in (starting it with :func:`init_distributed` if the
    program has not) and builds a process group for every group along each axis. Its ``comm`` is a
    :class:`funcpar.parallel.p2p.Wire`.

    Args:
        timeout: seconds (or a ``timedelta``) any collective of this mesh may wait for a peer before it raises
            instead of hanging; default ``$FUNCPAR_TIMEOUT`` or 600 s.
        device: where tensors live: ``"auto"`` (the default: ``cuda:$LOCAL_RANK`` when this node has a GPU for each
            of its ranks, else ``cpu`` with a warning), ``"cpu"``, ``"cuda"`` (refused when the node's ranks
            outnumber its GPUs), ``"cuda:N"`` or a ``torch.device`` (:func:`resolve_device`).
        heartbeat: on a mesh of more than one process, seconds without progress after which a peer reports a
            stopped or hung rank and ends the job (:mod:`funcpar.parallel.lifeline`); default the running
            lifeline's (:func:`init_distributed` called first), else ``$FUNCPAR_HEARTBEAT`` or 60 s; 0 turns it off.
        backend: torch.distributed's backend when this mesh starts the job (unused if it is already started);
            default ``gloo`` on the CPU and ``cpu:gloo,cuda:nccl`` on CUDA.
        **axes: axis sizes by name (identifiers, positive ints), e.g. ``tp=4, dp=2``; ``pp``, ``dp`` and ``tp``
            default to 1. Their product must equal the world size, unless it is 1. Order, outermost first: ``pp``,
            ``dp``, the other axes as given, ``tp``.

    Raises:
        MeshError: an axis name or size that is not valid; a mesh of more than one process outside a
            torch.distributed job (``RANK``/``WORLD_SIZE`` unset) or of another size than its world; a device
            that is unknown or not available here (:func:`resolve_device`).
    """

    comm = WIRE

    def __init__(
        self,
        *,
        timeout: float | datetime.timedelta | None = None,
        device: str | torch.device | None = None,
        heartbeat: float | None = None,
        backend: str | None = None,
        **axes: int,
    ):
        super().__init__(**axes)
        self.timeout = _as_timedelta(timeout)
        self.device, why_not_gpu = resolve_device(device, local_world=None if self.size > 1 else 1)
        if why_not_gpu:
            warnings.warn(f"funcpar: the ranks run on the CPU: {why_not_gpu}", stacklevel=2)
        self.backend = backend or _default_backend(self.device)
        self._groups: dict[str, Any] = {}
        self._lanes: dict[tuple, Any] = {}  # (axis, k) -> extra groups over an axis, built on first use (see lane)
        self._group_ranks: dict[str, list[int]] = {}

        if self.size == 1:
            # A process-local mesh: valid with or without a distributed world around it.
            self.rank = 0
            self._coords = {a: 0 for a in self._sizes}
            self._group_ranks = {a: [0] for a in self._sizes}
            return

        if not dist.is_initialized() and not _launched():
            raise MeshError(f"{self!r} needs {self.size} processes, but " + _NOT_LAUNCHED.format(n=self.size))
        # the job, the exit hooks and the lifeline (the process ends with its launcher; stuck peers reported)
        init_distributed(backend=self.backend, timeout=self.timeout, heartbeat=heartbeat, device=self.device)
        world = dist.get_world_size()
        if world != self.size:
            raise MeshError(
                f"{self!r} has {self.size} ranks but the torch.distributed world has {world} processes: "
                f"choose {'*'.join(self._sizes)} = {world} or launch with torchrun --nproc-per-node {self.size}"
            )
        self.rank = dist.get_rank()
        self._coords = self.coords_of(self.rank)
        self._build_groups()
        _BUILT.add(self)

    @staticmethod
    def abstract(device: str | torch.device | None = None, **axes: int) -> "AbstractMesh":
        """``AbstractMesh(device, **axes)``: a mesh's sizes without processes, for planning."""
        return AbstractMesh(device, **axes)

    # ------------------------------------------------------------------ process groups
    def _lines(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along ``axis`` (each in coordinate order), in one order on every rank."""
        ranks = torch.arange(self.size).reshape(*self._sizes.values())
        i = self.axis_names.index(axis)
        return ranks.movedim(i, -1).reshape(-1, self._sizes[axis]).tolist()

    def _build_groups(self) -> None:
        for axis in self.axis_names:
            # every rank takes part in creating every group of this axis, in the same order
            mine = None
            for line in self._lines(axis):
                g = dist.new_group(line, timeout=self.timeout)
                if self.rank in line:
                    mine, self._group_ranks[axis] = g, line
            self._groups[axis] = mine

    def group(self, axis: str):
        """This rank's ProcessGroup along ``axis`` (``None`` on a process-local mesh)."""
        self._check_axis(axis)
        return self._groups.get(axis)

    def lane(self, axis: str, k: int = 0):
        """The ``k``-th extra ProcessGroup over this rank's ``axis`` group: another communicator over the same
        ranks, for messages that must not share an order with the axis's own (the pipeline's wrap-around streams,
        :mod:`funcpar.parallel.p2p`'s channels). Built on first use, by every rank of the mesh, collectively: call it
        on all ranks at the same point of the program."""
        self._check_axis(axis)
        if (axis, k) not in self._lanes and self._groups:
            for j in range(k + 1):  # (lanes before k first, so every rank builds them in one order)
                if (axis, j) in self._lanes:
                    continue
                for line in self._lines(axis):
                    g = dist.new_group(line, timeout=self.timeout)
                    if self.rank in line:
                        self._lanes[(axis, j)] = g
        return self._lanes.get((axis, k))


def _attempt_store(timeout):
    """After torchrun restarted the workers (``TORCHELASTIC_RESTART_COUNT`` > 0, its agent hosting the store): the
    job's store under this attempt's prefix, else None (torch's own ``env://`` rendezvous). The agent keeps one
    store across restarts, and the previous attempt's ranks' addresses are still in it under the same keys: a
    restarted rank reading one before its peer overwrote it would connect to a dead port (gloo: "Connection
    refused"), so every restart failed the same way."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"funcpar/attempt_{attempt}", store)


class AbstractMesh(MeshBase):
    """A mesh's sizes without processes, seen from rank 0: for planning (``funcpar plan``). A sibling of
    :class:`Mesh`, not one: it joins no job and has no process group. Its ``comm`` is a
    :class:`funcpar.parallel.p2p.Simulation`: every collective and message runs as if every rank held rank 0's
    values, so shapes, dtypes and allocations are the real run's and the numbers are not (with ``device="meta"`` a
    whole train step runs on shapes alone; see :func:`funcpar.cli.planning.trace_step`). ``mesh.traffic`` counts the
    bytes each axis would send.

    Args:
        device: as :class:`Mesh` takes it, unchecked (``"cuda"`` is ``cuda:0``; a plan for a GPU needs none here
            unless the step makes real tensors on it); the default ``"auto"`` is what one rank here would get.
        **axes: axis sizes by name, as for :class:`Mesh`.
    """

    comm = SIMULATION
    simulated = True

    def __init__(self, device: str | torch.device | None = None, **axes: int):
        super().__init__(**axes)
        self.timeout = default_timeout()
        if device in (None, "auto"):
            self.device = resolve_device("auto", local_rank=0, local_world=1)[0]
        else:
            self.device = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
        self.backend = _default_backend(self.device)
        self.rank, self._coords = 0, {a: 0 for a in self._sizes}
        self._group_ranks = {a: [self.rank_of(**{a: i}) for i in range(n)] for a, n in self._sizes.items()}


_before_any_group()
