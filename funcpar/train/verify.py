"""``fp.verify``: a user's model, specs and mesh checked against one process, in the same job.

A model that computes with its shards and a spec per leaf can be wrong in ways that train: a row-parallel output
never summed, a replicated input to sharded work without ``copy_to_region`` (its gradient stays partial), a leaf
split on a dimension the model does not expect. :func:`verify` trains a few steps twice from the same global
parameters and batches, once on the user's mesh and once on a one-process mesh with the same axis names (every
rank computes that reference itself), and compares the losses, each leaf's gradient (this rank's block of it
against the same block of the reference) and the updated parameters. Where they differ it names the leaf that
differs most, with its spec, the size of the difference and the pattern it shows (:func:`diagnose`).

The run on the mesh takes ``compile_step``'s options (``zero=3``, ``accum_steps``, a pipeline schedule on a ``pp``
mesh), the reference the same at ``zero=0``: the gradients the optimizer receives (parts, at ZeRO 1-3) are gathered
into whole local leaves, and a pipeline stage's (which holds some leaves only) into every leaf's block on every rank,
so every mode is compared alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import optree
import torch

from funcpar.parallel import collectives as C
from funcpar.parallel.mesh import Mesh
from funcpar.model import Loss
from funcpar.optim import GradientTransformation, InPlaceTransformation, adamw, schedule_of, update_with
from funcpar.parallel.sharding import gather, shard
from funcpar.spec import P, broadcast_specs
from funcpar.train.step import compile_step
from funcpar.train.zero3 import gather_params

__all__ = ["verify", "Verification", "LeafReport"]


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """One leaf's gradient on the mesh against the reference. ``error``: the largest difference over every rank's
    block, relative to the reference's largest element (or 1% of the model's largest, if that is more); ``scale``:
    the factor ``g ~ scale * g_ref`` that fits best (1 when they agree); ``spread``: the replicated axis over which
    this leaf's copies got different gradients, if any."""

    path: str
    spec: P
    error: float
    scale: float
    spread: str | None  # the replicated axis over which this rank's copy differs from the others', or None

    def __str__(self) -> str:
        return f"leaf '{self.path}' {self.spec}: gradient off by {self.error:.3g} of its size (x{self.scale:.3g})"


@dataclasses.dataclass(frozen=True)
class Verification:
    """What :func:`verify` found. ``ok``: losses, gradients and updated parameters agree within the tolerance.
    ``losses``: ``(mesh, reference)`` per step; ``leaves``: every leaf's gradient report, worst first; ``first``:
    the worst leaf, if any differs; ``hint``: what kind of mistake the pattern suggests; ``params_error``: the
    largest difference of the trained parameters, relative to how far the reference moved them; ``error``: the
    exception the mesh run raised, if it did."""

    ok: bool
    mesh: str
    losses: list[tuple[float, float]]
    leaves: list[LeafReport]
    params_error: float
    hint: str
    error: str | None = None

    @property
    def first(self) -> LeafReport | None:
        return self.leaves[0] if self.leaves and not self.ok else None

    def __str__(self) -> str:
        if self.ok:
            return (f"{self.mesh} agrees with one process: {len(self.losses)} step(s), losses "
                    f"{', '.join(f'{a:.6g}' for a, _ in self.losses)}, {len(self.leaves)} leaves")
        lines = [f"{self.mesh} differs from one process: {self.hint}"]
        lines += [f"  step {i + 1}: loss {a:.6g} here, {b:.6g} on one process" for i, (a, b) in enumerate(self.losses)]
        lines += [f"  {leaf}" + (f", its copies differ over '{leaf.spread}'" if leaf.spread else "")
                  for leaf in self.leaves[:5] if leaf.error > 0]
        return "\n".join(lines)


def verify(loss_for: Callable[[Mesh], Callable], specs: Any, params: Any, batches: list, mesh: Mesh | None = None,
           *, optimizer: GradientTransformation | None = None, data_axes: tuple[str, ...] = ("dp",),
           rtol: float = 1e-4, **options: Any) -> Verification:
    """Check a model on ``mesh`` against one process: the same losses, gradients and updates.

    Collective: every rank calls it with the same arguments. The reference runs on every rank, so keep the model
    and batches small (a config with the real one's structure: the same layers and splits, fewer and narrower).

    Args:
        loss_for: ``loss_for(mesh) -> loss_fn``, the loss for a mesh, e.g. ``lambda m: model.loss_fn(cfg, m)``;
            called once for ``mesh`` and once for the one-process reference.
        specs: the :class:`funcpar.P` specs of ``params`` on ``mesh``.
        params: the global parameters (whole leaves, the same values on every rank; e.g. ``model.init(cfg)``).
        batches: global batches, one per step (each rank's data share is cut from them along ``data_axes``).
        mesh: default the mesh in scope.
        optimizer: default ``adamw(1e-3)``; its updates are compared after the last step.
        data_axes: the mesh axes the batch is split over, as ``compile_step`` takes them.
        rtol: the largest difference allowed, relative to the reference (a loss, a leaf's largest gradient element,
            the distance the reference moved the parameters); float32 sums in another order differ by ~1e-6.
        **options: ``compile_step``'s options for the run on ``mesh`` (``zero=3``, ``accum_steps=2``,
            ``pipeline="interleaved"``, ...); the reference runs them at ``zero=0`` (default ``zero=0`` for both).

    Returns:
        A :class:`Verification`: ``ok``, and where it is not, the leaf that differs most and a hint; print it.
    """
    mesh = mesh if mesh is not None else Mesh.current()
    one = Mesh(**{a: 1 for a in mesh.axis_names})
    opt = optimizer if optimizer is not None else adamw(1e-3)
    ref = _run(loss_for(one), specs, params, batches, one, opt, data_axes, {**options, "zero": 0})
    try:
        ours = _run(loss_for(mesh), specs, params, batches, mesh, opt, data_axes, options)
    except Exception as e:  # (a shape a leaf's spec gives that the model cannot use, most often)
        return Verification(False, repr(mesh), [], [], math.inf, f"the run on {mesh!r} raised: {type(e).__name__}: "
                            f"{e} -- check the specs of the leaves that code uses: a leaf split on a dimension the "
                            f"model does not expect gives it shards of the wrong shape", repr(e))
    leaves = _compare(ours, ref, specs, params, mesh)
    losses = list(zip(ours["losses"], ref["losses"], strict=True))
    loss_ok = all(abs(a - b) <= rtol * max(abs(b), 1e-12) for a, b in losses)
    moved = _reduce_max(mesh, _distance(shard(ref["params"], specs, mesh), shard(params, specs, mesh)))
    params_error = _reduce_max(mesh, _distance(ours["params"], shard(ref["params"], specs, mesh))) / max(moved, 1e-30)
    ok = loss_ok and all(leaf.error <= rtol for leaf in leaves) and params_error <= max(rtol, 1e-3)
    hint = "" if ok else diagnose(leaves, losses, rtol, mesh, data_axes)
    data = math.prod(mesh.axis_size(a) for a in data_axes)
    if not ok and data > 1 and Loss.of(loss_for(mesh)).batch_weight is None:
        hint += (f"; note: the loss carries no batch_weight, so the {data} data ranks' losses are weighted by rows, "
                 f"not tokens: give fp.Loss(fn=..., batch_weight=fp.layers.count_targets) for a token mean")
    return Verification(ok, repr(mesh), losses, leaves, params_error, hint)


def _run(loss_fn, specs, params, batches, mesh: Mesh, opt, data_axes, options: dict) -> dict:
    """Train ``len(batches)`` steps on ``mesh`` with ``options``, recording the first step's gradients as the
    optimizer receives them (summed over the data axes), gathered into whole local leaves, and the trained ones; on
    a pipeline mesh every leaf's block on every rank (not only the stage's)."""
    seen: list = []

    def update(grads, state, params=None, **extra):
        if not seen:
            seen.append(optree.tree_map(lambda g: g.detach().clone(), grads))
        return update_with(opt, grads, state, params, **extra)

    recording = InPlaceTransformation(opt.init, update, schedule=schedule_of(opt))
    step = compile_step(loss_fn, specs, mesh=mesh, optimizer=recording, data_axes=data_axes,
                        **{"zero": 0, "donate": False, "compile": False, **options})
    local = shard(params, specs, mesh)
    state = step.init(local)
    losses = []
    for b in batches:
        state, metrics = step(state, _data_share(b, mesh, data_axes))
        losses.append(metrics["loss"])
    lay = step.layout  # (the optimizer's leaves are this rank's parts of them: gathered whole)
    grads = gather_params(lay, lay.slices_of(lay.treedef.flatten_up_to(seen[0])))
    trained = step.gather_params(state)
    if mesh.axis_size("pp") > 1:  # a stage tree: the whole model's, then every leaf's block on this rank
        grads, trained = (shard(gather(t, specs, mesh), specs, mesh) for t in (grads, trained))
    return {"losses": losses, "grads": grads, "params": trained}


def _data_share(batch: dict, mesh: Mesh, data_axes) -> dict:
    """This rank's rows of a global batch: its block along the data axes, outermost first."""
    k, n = 0, 1
    for a in data_axes:
        k, n = k * mesh.axis_size(a) + mesh.coord(a), n * mesh.axis_size(a)
    return {name: x.chunk(n)[k] for name, x in batch.items()}


def _compare(ours: dict, ref: dict, specs, params, mesh: Mesh) -> list[LeafReport]:
    """Each leaf's gradient here against this rank's block of the reference's, reduced over the whole mesh."""
    matched = broadcast_specs(specs, params)
    mine = [g.reshape(-1) for g in optree.tree_leaves(ours["grads"])]
    # (the reference's whole leaves, in the parameters' shapes, cut to this rank's blocks)
    whole = optree.tree_map(lambda g, p: g.reshape(p.shape), ref["grads"], params)
    theirs = [g.reshape(-1) for g in optree.tree_leaves(shard(whole, specs, mesh))]
    stats = []
    for g, r in zip(mine, theirs, strict=True):
        g, r = g.double(), r.double().to(g.device)
        stats.append([(g - r).abs().max().item() if g.numel() else 0.0, r.abs().max().item() if r.numel() else 0.0,
                      (g * r).sum().item(), (r * r).sum().item()])
    t = torch.tensor(stats, dtype=torch.float64).reshape(len(stats), 4)
    worst = C.all_reduce(t[:, :2].clone().to(mesh.device), mesh, mesh.axis_names, "max").cpu()
    dots = C.all_reduce(t[:, 2:].clone().to(mesh.device), mesh, mesh.axis_names).cpu()
    reports = []
    # a gradient that is zero but for round-off (a key bias's: softmax ignores a shift shared by every key) is
    # measured against 1% of the model's largest gradient element, not against its own noise
    floor = 1e-2 * worst[:, 1].max().item() if len(stats) else 0.0
    for i, (path, spec, _) in enumerate(matched):
        err = worst[i, 0].item() / max(worst[i, 1].item(), floor, 1e-30)
        scale = dots[i, 0].item() / dots[i, 1].item() if dots[i, 1].item() > 0 else 1.0
        reports.append(LeafReport(path, spec, err, scale, _spread(mesh, spec, t[i, 0].item(), err)))
    return sorted(reports, key=lambda r: -r.error)


def _spread(mesh: Mesh, spec: P, mine: float, err: float) -> str | None:
    """A model axis the leaf is replicated over whose ranks see different gradient errors (their copies drift)."""
    out = None
    for a in mesh.axis_names:
        if a == "pp" or a in spec.axes or mesh.axis_size(a) == 1:
            continue
        v = torch.tensor([mine, -mine], dtype=torch.float64, device=mesh.device)
        hi, neg_lo = C.all_reduce(v, mesh, a, "max").tolist()
        if out is None and err > 0 and hi - (-neg_lo) > 1e-6 * max(abs(hi), 1e-30):
            out = a
    return out


def diagnose(leaves: list[LeafReport], losses: list[tuple[float, float]], rtol: float, mesh: Mesh,
             data_axes: tuple[str, ...] = ("dp",)) -> str:
    """What the pattern of differences suggests, in a sentence naming the leaf and the axis (a model axis before a
    data axis of the same size: the step sums over the data axes itself, a model's code over the model axes)."""
    bad = [leaf for leaf in leaves if leaf.error > rtol]
    forward = bool(losses) and abs(losses[0][0] - losses[0][1]) > rtol * max(abs(losses[0][1]), 1e-12)
    first = bad[0] if bad else None
    order = [a for a in mesh.axis_names if a not in data_axes] + [a for a in mesh.axis_names if a in data_axes]
    sizes = {a: mesh.axis_size(a) for a in order if mesh.axis_size(a) > 1 and a != "pp"}
    if forward:
        return (f"the first step's loss already differs ({losses[0][0]:.6g} against {losses[0][1]:.6g}), so the "
                f"forward does: a partial result is not summed (a row-parallel output without reduce_from_region), "
                f"a value is summed twice, or a leaf's spec does not split it where the model does"
                + (f"; the gradient that differs most is {first}" if first else ""))
    if first is None:
        return "the gradients agree but the updated parameters do not: the optimizer state or update differs"
    # a wrong gradient flows on into everything before it, compounded: the leaf showing a clean pattern is the one
    # to look at, so the patterns are tried on every leaf that differs, worst first
    drifting = next((leaf for leaf in bad if leaf.spread), None)
    if drifting is not None:
        a = drifting.spread
        return (f"{drifting} and its copies over '{a}' get different gradients: it is replicated over '{a}' but "
                f"used as a shard, or feeds sharded work without copy_to_region (whose backward sums the partial "
                f"gradients), so the copies drift apart; split it over '{a}' in its spec if the model uses it as a "
                f"shard, else put copy_to_region before the sharded work")
    for leaf in bad:
        for a, n in sizes.items():
            if abs(leaf.scale - n) <= 0.02 * n:
                return (f"{leaf}: {n} times the reference, the size of '{a}': a gradient summed over '{a}' that was "
                        f"already complete (a collective applied twice, or a leaf the model uses whole split over "
                        f"it)")
            if abs(leaf.scale - 1 / n) <= 0.02 / n:
                return (f"{leaf}: 1/{n} of the reference, '{a}' has {n} ranks: a sum over '{a}' is missing in the "
                        f"backward (copy_to_region before the sharded work that uses it)")
    return f"{first}: check its spec and the collectives around the code that uses it"


def _distance(a: Any, b: Any) -> float:
    return math.sqrt(sum((x.double() - y.double().to(x.device)).pow(2).sum().item()
                         for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True)))


def _reduce_max(mesh: Mesh, v: float) -> float:
    return C.all_reduce(torch.tensor([v], dtype=torch.float64, device=mesh.device), mesh, mesh.axis_names, "max").item()
