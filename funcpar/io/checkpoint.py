"""Checkpoints of the whole train state: atomic, resumable to the same bits, reshardable onto any mesh.

Layout of ``path/``:

- ``rank-00000.safetensors`` ... one file per rank, written in parallel, each holding only the pieces that rank
  owns and no other rank holds (one replica writes a replicated block), flattened to 1-D;
- ``meta.json``: format, step, the mesh it was saved on, every parameter's global shape, dtype and spec, the
  optimizer-state leaves and which parameter each one shadows, every piece (file, key, the global block it belongs
  to, the flat range of that block it covers, a CRC-32 of its bytes), the user's ``extra``, and
  ``"complete": true``; ``meta.json.sha256``: the SHA-256 of its bytes.

A piece is described in global coordinates, so a checkpoint loads onto any mesh: a rank reads only the pieces whose rows
overlap the block (or, for ZeRO-partitioned optimizer state, the flat part of the block) it now owns. Saving writes into
``.NAME.tmp`` and renames it to ``NAME`` only once every rank's file is complete
(:func:`funcpar.io.atomic.write_folder`), then points ``latest`` (a text file beside it) at it and applies ``keep``. A
crash mid-save leaves the previous checkpoint and ``latest`` as they were. Loading reads JSON and raw tensor bytes
only; nothing is unpickled or executed, and nothing is sized from the metadata before it has passed its schema and its
checksum (``funcpar.io.checkpoint_source``).

Why not ``torch.distributed.checkpoint``: its metadata file is a pickle (loading it would unpickle), and its
resharding works on DTensors, while funcpar's ZeRO state is flat parts of local shards; describing pieces in
global coordinates here costs a page of code and keeps the format plain JSON + safetensors.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import optree
import torch

from funcpar.io.checkpoint_source import FORMAT, CheckpointError, crc, Source, resolve, write_meta
from funcpar.io.atomic import open_own, write_folder
from funcpar.parallel.layout import ZeroLayout
from funcpar.parallel.mesh import Mesh
from funcpar.model import get_model
from funcpar.spec import P, broadcast_specs, global_shape, local_slice
from funcpar.state import Handoff, TrainState
from funcpar.tree import first_difference, leaves_with_path

__all__ = ["save", "load", "load_params", "export_hf", "metadata", "CheckpointError", "resolve"]



def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _opt_param_index(opt_state: Any, params: Any) -> list[int | None]:
    """For each optimizer-state leaf: the index of the parameter it shadows, i.e. its position in a subtree shaped
    like the params (``None`` where a masked optimizer keeps no state for a frozen leaf); ``None`` otherwise."""
    p_treedef = optree.tree_structure(params, none_is_leaf=True)
    # a pipeline stage's params hold None for the leaves other stages hold: positions -> layout leaf indices
    held = [i for i, x in enumerate(optree.tree_leaves(params, none_is_leaf=True)) if x is not None]
    index = {pos: k for k, pos in enumerate(held)}
    out: list[int | None] = []

    def walk(node):
        if optree.tree_structure(node, none_is_leaf=True) == p_treedef:
            vals = optree.tree_leaves(node, none_is_leaf=True)
            out.extend(index[i] for i, v in enumerate(vals) if v is not None)
        elif optree.treespec_is_leaf(optree.tree_structure(node)):
            out.append(None)
        else:
            for child in optree.tree_flatten_one_level(node)[0]:
                walk(child)

    walk(opt_state)
    return out


def _state_types(tree: Any) -> list[str]:
    """The NamedTuple state classes in an optimizer state, outermost first (e.g. ClipState, AdamWState)."""
    out: list[str] = []

    def walk(node):
        if hasattr(node, "_fields"):
            out.append(type(node).__name__)
        if not optree.treespec_is_leaf(optree.tree_structure(node)):
            for child in optree.tree_flatten_one_level(node)[0]:
                walk(child)

    walk(tree)
    return list(dict.fromkeys(out))


def _paths(tree: Any) -> list[str]:
    return [p for p, _ in leaves_with_path(tree)]


def _block(spec: P, gshape: list[int], mesh: Mesh) -> list[list[int]]:
    if not gshape:
        return []
    return [[s.start, s.stop] for s in local_slice(spec, tuple(gshape), mesh)]


def _owner(mesh: Mesh, axes: tuple[str, ...]) -> bool:
    return all(mesh.coord(a) == 0 for a in axes)


# ---------------------------------------------------------------------------------------------------- save


def save(path, state: TrainState, layout: ZeroLayout | None, *, run: str, extra: Any = None,
         uncounted: list[bool] | None = None, keep: int | None = None, overwrite: bool = False,
         latest: bool = True) -> None:
    """Write the whole train ``state`` to ``path``; collective over ``layout.mesh``. (``Step.save`` calls it.)

    Every rank writes the pieces it owns, in global coordinates, so the checkpoint loads onto any mesh; the torch
    RNG state of every rank goes in too. The folder is renamed into place only once every rank's file is complete
    (:func:`funcpar.io.atomic.write_folder`), then ``latest`` and ``keep`` apply: a crash mid-save leaves the previous
    checkpoint and ``latest`` as they were.

    Args:
        path: the checkpoint folder to write (e.g. ``ckpt/step-1000``); ``latest`` and the other checkpoints of
            the run are beside it.
        state: the :class:`funcpar.TrainState` to save: this rank's parameters, its optimizer state and the step.
        layout: the :class:`funcpar.ZeroLayout` of the step that made ``state``: which part of each leaf this
            rank's optimizer state covers (``None``: the step has not been initialised, refused).
        run: the id of the run the checkpoint belongs to (``keep`` prunes only that run's checkpoints).
        extra: anything JSON-serialisable (data position, config, ...), returned by :func:`load`; default ``None``.
        uncounted: per leaf of ``layout``, True where another pipeline stage holds and writes it (a tied leaf);
            default ``None``: this rank writes every leaf it owns.
        keep: after saving, delete all but the ``keep`` newest checkpoints (by step) of this run beside ``path``,
            never the one just written; default ``None``: delete none.
        overwrite: replace ``path`` even if funcpar did not write it (otherwise refused, naming the folder).
        latest: point ``latest`` beside ``path`` at it (off for a checkpoint saved alone, e.g. by convert); default
            True.

    Raises:
        CheckpointError: no ``layout``, an ``extra`` that is not JSON-serialisable, an existing ``path`` funcpar may
            not replace, or a write that failed on another rank (nothing is written then, and what was at ``path``
            is unchanged).
    """
    if layout is None:
        raise CheckpointError("save: the step has no layout yet; call step.init(params) first")
    try:
        json.dumps(extra)
    except TypeError as e:
        raise CheckpointError(f"save: extra must be JSON-serialisable: {e}") from None
    mesh = layout.mesh
    path, fname, params_meta = Path(path), f"rank-{mesh.rank:05d}.safetensors", []

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        # a pipeline's tied leaf is held by two stages: the first writes it
        params_meta.extend(_param_pieces(state, layout, mesh, fname, tensors, uncounted))
        opt_meta = _opt_pieces(state, layout, mesh, params_meta, fname, tensors, uncounted)
        rng, state_bytes = f"rng/torch/{mesh.rank}", torch.get_rng_state()
        n = state_bytes.numel()
        tensors[rng] = (state_bytes, [_piece(rng, fname, state_bytes, [[0, n]], [0, n])])
        save_file({k: t for k, (t, _) in tensors.items()}, str(tmp / fname), metadata={"format": FORMAT})
        pieces = [pc for _, pcs in tensors.values() for pc in pcs]
        (tmp / f"rank-{mesh.rank:05d}.json").write_text(json.dumps({"pieces": pieces, "opt": opt_meta,
                                                                     "params": params_meta}))

    def finalize(tmp: Path) -> None:
        all_pieces, opt_meta, params_meta = _merge_sides(tmp, mesh)
        write_meta(tmp, {  # with its checksum
            "format": FORMAT, "complete": True, "step": int(state.step), "run": run, "mesh": mesh.shape,
            "zero": layout.zero, "world": mesh.size, "params": params_meta, "opt": opt_meta,
            "optimizer": _state_types(state.opt_state), "pieces": all_pieces, "extra": extra,
        })

    write_folder(path, mesh, write, finalize=finalize, publish=lambda p: _publish(p, keep, run, latest),
                 error=CheckpointError, overwrite=overwrite, kind="checkpoint", owner=run)


def _merge_sides(tmp: Path, mesh: Mesh) -> tuple[list, list, list]:
    """Every rank's pieces and its view of the leaves (pipeline stages hold different ones), merged by path in rank
    (= stage) order; the per-rank side files are removed."""
    all_pieces, opt_meta, params_meta = [], {}, {}
    for r in range(mesh.size):
        side = tmp / f"rank-{r:05d}.json"
        got = json.loads(side.read_text())
        all_pieces += got["pieces"]
        opt_meta |= {o["path"]: o for o in got["opt"] if o["path"] not in opt_meta}
        params_meta |= {p["path"]: p for p in got["params"] if p["path"] not in params_meta}
        side.unlink()
    return all_pieces, list(opt_meta.values()), list(params_meta.values())


def _publish(path: Path, keep: int | None, run: str, latest: bool) -> None:
    """Point ``latest`` at the new checkpoint (written beside and renamed: atomic) and apply ``keep``."""
    if latest:
        latest_tmp = path.parent / ".latest.tmp"
        with open_own(latest_tmp) as fh:  # (a link planted there is replaced, not written through)
            fh.write(path.name + "\n")
        os.replace(latest_tmp, path.parent / "latest")
    if keep is not None:
        _apply_keep(path, keep, run)


def _piece(key: str, fname: str, t: torch.Tensor, block: list, flat: list[int]) -> dict:
    return {"tensor": key, "file": fname, "key": key, "block": block, "flat": flat, "crc": crc(t)}


def _param_pieces(state: TrainState, layout: ZeroLayout, mesh: Mesh, fname: str, tensors: dict,
                  elsewhere: list[bool] | None) -> list[dict]:
    """Each parameter's metadata; the blocks this rank owns (one replica writes a replicated block; at ``zero=3``
    each rank its part; ``elsewhere[i]``: another pipeline stage writes leaf ``i``) into ``tensors`` as
    ``key -> (flat tensor, [piece])``."""
    meta, parts = [], layout.leaf_parts()
    leaves = layout.treedef.flatten_up_to(state.params)
    for i, (p, x, spec) in enumerate(zip(layout.paths, leaves, layout.specs, strict=True)):
        gshape = list(global_shape(spec, layout.shapes[i], mesh))
        meta.append({"path": p, "shape": gshape, "dtype": _dtype_name(x.dtype), "spec": list(spec.dims)})
        a, z, copies = parts[i] if layout.holds_parts else (0, x.numel(), tuple(a for a in mesh.axis_names
                                                                              if a not in spec.axes + ("pp",)))
        if z > a and _owner(mesh, copies) and not (elsewhere and elsewhere[i]):
            key, t = f"param/{p}", x.detach().reshape(-1).contiguous().cpu()
            tensors[key] = (t, [_piece(key, fname, t, _block(spec, gshape, mesh), [a, z])])
    return meta


def _opt_pieces(state, layout: ZeroLayout, mesh: Mesh, params_meta: list[dict], fname: str, tensors: dict,
                elsewhere: list[bool] | None):
    """Each optimizer-state leaf's metadata; this rank's ZeRO parts (one replica of each) into ``tensors``."""
    meta, parts = [], layout.leaf_parts()
    index = _opt_param_index(state.opt_state, state.params)
    for x, op, i in zip(optree.tree_leaves(state.opt_state), _paths(state.opt_state), index, strict=True):
        key, t = f"opt/{op}", x.detach().reshape(-1).contiguous().cpu()
        if i is None:  # e.g. a step count: the same on every rank
            meta.append({"path": op, "param": None, "shape": list(x.shape), "dtype": _dtype_name(x.dtype)})
            if mesh.rank == 0:
                tensors[key] = (t, [_piece(key, fname, t, [[0, n] for n in x.shape], [0, x.numel()])])
            continue
        a, z, copies = parts[i]
        meta.append({"path": op, "param": layout.paths[i], "dtype": _dtype_name(x.dtype)})
        if z > a and _owner(mesh, copies) and not (elsewhere and elsewhere[i]):
            block = _block(layout.specs[i], params_meta[i]["shape"], mesh)
            tensors[key] = (t, [_piece(key, fname, t, block, [a, z])])
    return meta


def _apply_keep(current: Path, keep: int, run: str) -> None:
    """Delete all but the ``keep`` newest checkpoints of this run beside ``current`` (another run's are not ours; a
    folder whose metadata does not verify is not treated as anyone's checkpoint)."""
    found = []
    for d in current.parent.iterdir():
        if d.is_dir() and not d.name.startswith(".") and (d / "meta.json").exists():
            try:
                meta = Source(d).meta  # schema and checksum: an edited meta.json cannot claim a folder for the run
            except CheckpointError:
                continue
            if meta.get("run") == run:
                found.append((int(meta["step"]), d.name, d))
    found.sort()
    for _, _, d in found[: max(0, len(found) - max(keep, 1))]:
        if d != current:
            shutil.rmtree(d)


def metadata(path) -> dict:
    """A checkpoint's ``meta.json`` (``path`` or the one its ``latest`` names), verified against its schema and
    checksum: ``step``, ``mesh``, ``extra`` (the model config ``funcpar train`` records) and the rest."""
    return Source(path).meta


# ---------------------------------------------------------------------------------------------------- load


def _check_params(src: Source, paths: list[str], gshapes: list[list[int]], known: list[str] | None = None) -> dict:
    """The saved parameters' metadata by path, checked against the leaves to load (``paths`` of ``gshapes``) and
    the model's whole set of leaves (``known``, default ``paths``: a pipeline stage loads some of them)."""
    saved = {p["path"]: p for p in src.meta["params"]}
    for p, g in zip(paths, gshapes, strict=True):
        if p not in saved:
            raise CheckpointError(
                f"checkpoint {src.folder} is from another model: it has no leaf '{p}' "
                f"(it holds {len(saved)} leaves, e.g. {', '.join(list(saved)[:3])})"
            )
        if list(saved[p]["shape"]) != list(g):
            raise CheckpointError(
                f"checkpoint {src.folder} is from another model: leaf '{p}' has shape {saved[p]['shape']} there, "
                f"the model expects {list(g)}"
            )
    extra = [p for p in saved if p not in set(known or paths)]
    if extra:
        raise CheckpointError(f"checkpoint {src.folder} is from another model: it has leaf '{extra[0]}', which the "
                              f"model lacks")
    return saved


def load_params(path, like: Any, specs: Any, mesh: Mesh | None = None) -> Any:
    """Only the parameters, as this rank's shards for ``specs`` on ``mesh``; ``like`` gives the tree structure and
    global shapes (meta tensors will do, e.g. ``model.init(cfg, device="meta")``)."""
    mesh = mesh or Mesh()
    src = Source(path)
    matched = broadcast_specs(specs, like)
    paths = [p for p, _, _ in matched]
    saved = _check_params(src, paths, [list(x.shape) for _, _, x in matched])
    out = []
    for p, spec, x in matched:
        dtype = getattr(torch, saved[p]["dtype"])
        region = _block(spec, list(x.shape), mesh)
        n = math.prod(e - s for s, e in region)
        t = src.assemble(f"param/{p}", region, 0, n, dtype).view([e - s for s, e in region])
        out.append(t.to(mesh.device))
    return optree.tree_unflatten(optree.tree_structure(like), out)


def load(path, layout: ZeroLayout | None, init: Callable[[Any], TrainState], *, known: list[str] | None = None,
         restore_rng: bool = True, stats: dict | None = None) -> tuple[TrainState, Any, str | None]:
    """Load the checkpoint in ``path`` onto ``layout``'s mesh and ZeRO parts, which may differ from the ones it was
    saved on: pieces are resharded. (``Step.load`` calls it.)

    Parameters and optimizer state are read for this rank's blocks and ZeRO parts only. The metadata is checked
    against its schema and checksum and every piece against its CRC-32 before it is used; nothing is unpickled.

    Args:
        path: a checkpoint folder, or the folder holding ``latest`` (the checkpoint it names is loaded).
        layout: the :class:`funcpar.ZeroLayout` of the initialised step to resume (``None``: refused).
        init: the step's ``init``: turns the loaded parameters (whole local leaves, in a :class:`funcpar.Handoff`,
            which ``Step.init`` takes) into a fresh state of the step.
        known: on a pipeline stage, the paths of the whole model's leaves (the checkpoint holds every stage's);
            default ``None``: the checkpoint must hold exactly ``layout``'s leaves.
        restore_rng: restore the torch RNG state this rank (or, on a larger mesh, rank 0) had at save time; default
            True.
        stats: a dict to receive ``bytes_read``.

    Returns:
        ``(state, extra, run)``: the state, the ``extra`` given to :func:`save`, and the run id to save on with.
        A checkpoint of parameters only (``funcpar convert``) loads with a fresh optimizer state.

    Raises:
        CheckpointError: no ``layout``; ``path`` is not a checkpoint (no ``meta.json``, nor a ``latest`` naming a
            complete one); metadata or a piece that fails its checks; a checkpoint of another model (a leaf
            missing, extra or of another shape) or saved with another optimizer's state.
    """
    if layout is None:
        raise CheckpointError("load: call step.init(params) first (params of the right shapes; values are replaced)")
    mesh, lay, src = layout.mesh, layout, Source(path)
    gshapes = [list(global_shape(spec, s, mesh)) for s, spec in zip(lay.shapes, lay.specs, strict=True)]
    saved = _check_params(src, list(lay.paths), gshapes, known)
    leaves = []
    for p, spec, g, s in zip(lay.paths, lay.specs, gshapes, lay.shapes, strict=True):
        leaves.append(src.assemble(f"param/{p}", _block(spec, g, mesh), 0, math.prod(s),
                                   getattr(torch, saved[p]["dtype"])).view(s).to(mesh.device))
    handed = Handoff(lay.unflatten(leaves))  # (the step frees them once copied: funcpar.state.Handoff)
    del leaves
    fresh = init(handed)
    if not src.meta["opt"]:  # parameters only (e.g. from `funcpar convert`): a fresh optimizer
        opt_state = fresh.opt_state
    else:
        opt_state = _load_opt(src, lay, fresh, gshapes, mesh, known is not None)
    if restore_rng:
        _restore_rng(src, mesh)
    if stats is not None:
        stats["bytes_read"] = src.bytes_read
    # the params as the step's buffers hold them (fresh.params): the state is live for the step, nothing copied again
    return TrainState(fresh.params, opt_state, int(src.meta["step"])), src.meta.get("extra"), src.meta.get("run")


def _load_opt(src: Source, lay: ZeroLayout, fresh: TrainState, gshapes: list, mesh: Mesh, staged: bool) -> Any:
    """This rank's ZeRO parts of the saved optimizer state, in the structure of ``fresh.opt_state``."""
    o_paths = _paths(fresh.opt_state)
    saved_opt = [o["path"] for o in src.meta["opt"]]
    # the same optimizer's state leaves (a pipeline stage loads its own leaves' state; saved across stages, the
    # list is in stage order)
    fits = set(o_paths) <= set(saved_opt) if staged else set(o_paths) == set(saved_opt)
    if not fits:
        first = first_difference(saved_opt, o_paths)
        have = saved_opt[first] if first < len(saved_opt) else "(absent)"
        want = o_paths[first] if first < len(o_paths) else "(absent)"
        raise CheckpointError(
            f"checkpoint {src.folder} was saved with optimizer state {', '.join(src.meta.get('optimizer', []))}; "
            f"this step's is {', '.join(_state_types(fresh.opt_state))} (first difference: '{have}' there, "
            f"'{want}' here): resume with the optimizer it was saved with"
        )
    parts, new = lay.leaf_parts(), []
    index = _opt_param_index(fresh.opt_state, fresh.params)
    for x, op, i in zip(optree.tree_leaves(fresh.opt_state), o_paths, index, strict=True):
        if i is None:
            t = src.assemble(f"opt/{op}", [[0, n] for n in x.shape], 0, x.numel(), x.dtype).view(x.shape)
        else:
            a, z, _ = parts[i]
            t = src.assemble(f"opt/{op}", _block(lay.specs[i], gshapes[i], mesh), a, z, x.dtype)
        new.append(t.to(x.device))
    return optree.tree_unflatten(optree.tree_structure(fresh.opt_state), new)


def _restore_rng(src: Source, mesh: Mesh) -> None:
    r = mesh.rank if mesh.rank < src.meta["world"] else 0
    for pc in src.pieces.get(f"rng/torch/{r}", []):
        torch.set_rng_state(src._read(pc))


def export_hf(path, out, model, cfg, mesh: Mesh | None = None, **kwargs) -> None:
    """Write a checkpoint's parameters as a transformers folder (see :func:`funcpar.io.hf.save`), from any mesh."""
    from funcpar.io import hf

    model = get_model(model)
    model.check_hf("export_hf", CheckpointError)
    mesh = mesh or Mesh()
    cfg = cfg.with_mesh(mesh)
    specs = model.specs(cfg, mesh)
    params = load_params(path, model.init(cfg, device="meta"), specs, mesh)
    hf.save(out, params, model, cfg, mesh, specs=specs, **kwargs)
