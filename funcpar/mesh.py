"""The named device mesh: ``Mesh(pp, dp, tp)`` over the ranks of a torch.distributed job.

Axis order is pp, dp, tp with tp innermost, so a tp group is a run of consecutive ranks (one node's GPUs, where the
traffic is heaviest): the rank at coordinates ``(p, d, t)`` is ``(p*dp + d)*tp + t``. For ``Mesh(tp=4, dp=2)`` the
tp groups are {0,1,2,3} {4,5,6,7} and the dp groups {0,4} {1,5} {2,6} {3,7}.

A mesh of size 1 (``Mesh()``) needs no torch.distributed at all: every collective over it is the identity, so the
same model code is the single-device program. A larger mesh joins the job it runs in (torchrun sets the
environment; gloo on CPUs, NCCL on CUDA) and must cover the whole world. It is passed explicitly everywhere;
funcpar keeps no global mesh.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Mesh", "MeshError", "AXES", "default_timeout"]

AXES = ("pp", "dp", "tp")


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


class Mesh:
    """A 3-axis (pp, dp, tp) named mesh over the processes of a torch.distributed job.

    Args:
        pp, dp, tp: axis sizes (positive ints); ``pp*dp*tp`` must equal the world size, unless it is 1.
        timeout: seconds (or a ``timedelta``) any collective of this mesh may wait for a peer before it raises
            instead of hanging; default ``$FUNCPAR_TIMEOUT`` or 600 s.
        device: where tensors live; default ``cuda:$LOCAL_RANK`` when CUDA is available, else ``cpu``.
    """

    axis_names = AXES

    def __init__(
        self,
        pp: int = 1,
        dp: int = 1,
        tp: int = 1,
        *,
        timeout: float | datetime.timedelta | None = None,
        device: str | torch.device | None = None,
    ):
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        for name, s in sizes.items():
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise MeshError(f"Mesh axis '{name}' must be a positive int, got {s!r}")
        self._sizes = sizes
        self.size = pp * dp * tp
        self.timeout = _as_timedelta(timeout)
        if device is None:
            device = (
                torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self._groups: dict[str, Any] = {}
        self._group_ranks: dict[str, list[int]] = {}
        self.device_mesh = None

        if self.size == 1:
            # A process-local mesh: valid with or without a distributed world around it.
            self.rank = 0
            self._coords = {a: 0 for a in AXES}
            self._group_ranks = {a: [0] for a in AXES}
            return

        self._join_world()
        world = dist.get_world_size()
        if world != self.size:
            raise MeshError(
                f"{self!r} has {self.size} ranks but the torch.distributed world has {world} processes: "
                f"choose pp*dp*tp = {world} or launch with torchrun --nproc-per-node {self.size}"
            )
        self.rank = dist.get_rank()
        self._coords = self.coords_of(self.rank)
        self._build_groups()

    @classmethod
    def abstract(cls, pp: int = 1, dp: int = 1, tp: int = 1) -> "Mesh":
        """A mesh's sizes without processes (coordinates of rank 0): for planning, e.g. ``funcpar plan``.
        Collectives over it are not possible."""
        m = cls()
        for name, s in {"pp": pp, "dp": dp, "tp": tp}.items():
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise MeshError(f"Mesh axis '{name}' must be a positive int, got {s!r}")
        m._sizes = {"pp": pp, "dp": dp, "tp": tp}
        m.size = pp * dp * tp
        return m

    # ------------------------------------------------------------------ set-up
    def _join_world(self) -> None:
        if dist.is_initialized():
            return
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            raise MeshError(
                f"{self!r} needs {self.size} processes, but this process is not part of a torch.distributed job "
                f"(RANK/WORLD_SIZE are unset): launch it with torchrun --nproc-per-node {self.size} ..., "
                f"or use Mesh() for a single process"
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend=backend, timeout=self.timeout)

    def _build_groups(self) -> None:
        ranks = torch.arange(self.size).reshape(self._sizes["pp"], self._sizes["dp"], self._sizes["tp"])
        groups = []
        for i, axis in enumerate(AXES):
            # every rank takes part in creating every group of this axis, in the same order
            lines = ranks.movedim(i, -1).reshape(-1, self._sizes[axis]).tolist()
            mine = None
            for line in lines:
                g = dist.new_group(line, timeout=self.timeout)
                if self.rank in line:
                    mine, self._group_ranks[axis] = g, line
            self._groups[axis] = mine
            groups.append(mine)
        try:
            from torch.distributed.device_mesh import DeviceMesh

            self.device_mesh = DeviceMesh.from_group(
                groups, self.device.type, mesh=ranks, mesh_dim_names=AXES
            )
        except Exception:  # pragma: no cover - DTensor interop is optional; funcpar itself never needs it
            self.device_mesh = None

    # ------------------------------------------------------------------ queries
    @property
    def shape(self) -> dict[str, int]:
        """Axis sizes, ``{'pp': ..., 'dp': ..., 'tp': ...}``."""
        return dict(self._sizes)

    def _check_axis(self, axis: str) -> None:
        if axis not in self._sizes:
            raise MeshError(f"unknown mesh axis {axis!r}: the axes are {', '.join(AXES)}")

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
        """This rank's ProcessGroup along ``axis`` (``None`` on a process-local mesh)."""
        self._check_axis(axis)
        return self._groups.get(axis)

    def group_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``, in coordinate order."""
        self._check_axis(axis)
        return list(self._group_ranks[axis])

    def coords_of(self, rank: int) -> dict[str, int]:
        t = self._sizes["tp"]
        d = self._sizes["dp"]
        return {"pp": rank // (d * t), "dp": (rank // t) % d, "tp": rank % t}

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self._sizes["dp"] + dp) * self._sizes["tp"] + tp

    @property
    def is_distributed(self) -> bool:
        return self.size > 1

    def __repr__(self) -> str:
        return f"Mesh(pp={self._sizes['pp']}, dp={self._sizes['dp']}, tp={self._sizes['tp']})"
