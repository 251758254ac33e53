"""Checkpoints of the whole train state: atomic, resumable to the same bits, reshardable onto any mesh.

Layout of ``path/``:

- ``rank-00000.safetensors`` ... one file per rank, written in parallel, each holding only the pieces that rank
  owns and no other rank holds (one replica writes a replicated block), flattened to 1-D;
- ``meta.json``: format, step, the mesh it was saved on, every parameter's global shape, dtype and spec, the
  optimizer-state leaves and which parameter each one shadows, every piece (file, key, the global block it belongs
  to, the flat range of that block it covers, a CRC-32 of its bytes), the user's ``extra``, and
  ``"complete": true``.

A piece is described in global coordinates, so a checkpoint loads onto any mesh: a rank reads only the pieces
whose rows overlap the block (or, for ZeRO-partitioned optimizer state, the flat part of the block) it now owns.
Saving writes into ``.NAME.tmp`` and renames it to ``NAME`` only once every rank's file is complete, then points
``latest`` (a text file beside it) at it and applies ``keep``. A crash mid-save leaves the previous checkpoint and
``latest`` as they were. Loading reads JSON and raw tensor bytes only; nothing is unpickled or executed.

Why not ``torch.distributed.checkpoint``: its metadata file is a pickle (loading it would unpickle), and its
resharding works on DTensors, while funcpar's ZeRO state is flat parts of local shards; describing pieces in
global coordinates here costs a page of code and keeps the format plain JSON + safetensors.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import optree
import torch

from . import collectives as C
from ._safetensors import read_block, read_header, swap_into_place
from .mesh import Mesh
from .spec import P, broadcast_specs, global_shape, local_slice

__all__ = ["save", "load", "load_params", "export_hf", "CheckpointError", "resolve"]

FORMAT = "funcpar-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked (the message names the file, leaf or piece)."""


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy()) if t.numel() else 0


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _opt_param_index(opt_state: Any, params: Any) -> list[int | None]:
    """For each optimizer-state leaf: the index of the parameter it shadows, i.e. its position in a subtree shaped
    like the params (``None`` where a masked optimizer keeps no state for a frozen leaf); ``None`` otherwise."""
    p_treedef = optree.tree_structure(params, none_is_leaf=True)
    out: list[int | None] = []

    def walk(node):
        if optree.tree_structure(node, none_is_leaf=True) == p_treedef:
            vals = optree.tree_leaves(node, none_is_leaf=True)
            out.extend(i for i, v in enumerate(vals) if v is not None)
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
    from .tree import leaves_with_path

    return [p for p, _ in leaves_with_path(tree)]


def _block(spec: P, gshape: list[int], mesh: Mesh) -> list[list[int]]:
    if not gshape:
        return []
    return [[s.start, s.stop] for s in local_slice(spec, tuple(gshape), mesh)]


def _owner(mesh: Mesh, axes: tuple[str, ...]) -> bool:
    return all(mesh.coord(a) == 0 for a in axes)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint folder: ``path`` itself, or the one its ``latest`` file names."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    latest = path / "latest"
    if latest.exists():
        target = path / latest.read_text().strip()
        if (target / "meta.json").exists():
            return target
        raise CheckpointError(f"{latest} names {target.name}, which is not a complete checkpoint")
    raise CheckpointError(f"{path} is not a checkpoint (no meta.json) and has no 'latest' file")


# ---------------------------------------------------------------------------------------------------- save


def save(path, state, mesh: Mesh, extra: Any = None, *, step, keep: int | None = None) -> None:
    """Write the whole train state of ``step`` (a :class:`funcpar.Step`) to ``path``; collective over the mesh.

    ``extra``: anything JSON-serialisable (data position, config, ...), returned by :func:`load`.
    ``keep``: after saving, delete all but the ``keep`` newest checkpoints beside ``path``.
    """
    if step._layout is None:
        raise CheckpointError("save: the step has no layout yet; call step.init(params) first")
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    treedef, shapes, _, paths = step._layout
    p_leaves = treedef.flatten_up_to(state.params)
    specs = [s for _, s, _ in broadcast_specs(step.specs, state.params)]
    parts = step._leaf_parts()
    rank = mesh.rank
    error: BaseException | None = None
    try:
        json.dumps(extra)
    except TypeError as e:
        raise CheckpointError(f"save: extra must be JSON-serialisable: {e}") from None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    C.barrier(mesh)
    fname = f"rank-{rank:05d}.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    pieces: list[dict] = []
    params_meta, opt_meta = [], []
    try:
        for i, (p, x, spec) in enumerate(zip(paths, p_leaves, specs)):
            gshape = list(global_shape(spec, tuple(x.shape), mesh))
            params_meta.append({"path": p, "shape": gshape, "dtype": _dtype_name(x.dtype), "spec": list(spec.dims)})
            if _owner(mesh, tuple(a for a in ("pp", "dp", "tp") if a not in spec.axes)):
                key = f"param/{p}"
                tensors[key] = x.detach().reshape(-1).contiguous().cpu()
                pieces.append({"tensor": key, "file": fname, "key": key, "block": _block(spec, gshape, mesh),
                               "flat": [0, x.numel()], "crc": _crc(tensors[key])})
        o_leaves = optree.tree_leaves(state.opt_state)
        o_paths = _paths(state.opt_state)
        index = _opt_param_index(state.opt_state, state.params)
        for x, op, i in zip(o_leaves, o_paths, index):
            key = f"opt/{op}"
            if i is None:  # e.g. a step count: the same on every rank
                opt_meta.append({"path": op, "param": None, "shape": list(x.shape), "dtype": _dtype_name(x.dtype)})
                if rank == 0:
                    tensors[key] = x.detach().reshape(-1).contiguous().cpu()
                    pieces.append({"tensor": key, "file": fname, "key": key, "block": [[0, n] for n in x.shape],
                                   "flat": [0, x.numel()], "crc": _crc(tensors[key])})
                continue
            a, z, copies = parts[i]
            opt_meta.append({"path": op, "param": paths[i], "dtype": _dtype_name(x.dtype)})
            if z > a and _owner(mesh, copies + ("pp",)):
                tensors[key] = x.detach().reshape(-1).contiguous().cpu()
                gshape = params_meta[i]["shape"]
                pieces.append({"tensor": key, "file": fname, "key": key, "block": _block(specs[i], gshape, mesh),
                               "flat": [a, z], "crc": _crc(tensors[key])})
        rng = f"rng/torch/{rank}"
        tensors[rng] = torch.get_rng_state()
        pieces.append({"tensor": rng, "file": fname, "key": rng, "block": [[0, tensors[rng].numel()]],
                       "flat": [0, tensors[rng].numel()], "crc": _crc(tensors[rng])})
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / fname), metadata={"format": FORMAT})
        (tmp / f"rank-{rank:05d}.json").write_text(json.dumps({"pieces": pieces}))
    except BaseException as e:  # noqa: BLE001 - every rank must learn of it
        error = e
    failed = C.all_reduce(torch.tensor([0.0 if error is None else 1.0], device=mesh.device), mesh, ("pp", "dp", "tp"), "max")
    if rank == 0 and error is None and not failed.item():
        try:
            all_pieces = []
            for r in range(mesh.size):
                side = tmp / f"rank-{r:05d}.json"
                all_pieces += json.loads(side.read_text())["pieces"]
                side.unlink()
            meta = {
                "format": FORMAT, "complete": True, "step": int(state.step), "mesh": mesh.shape, "zero": step.zero,
                "world": mesh.size, "params": params_meta, "opt": opt_meta,
                "optimizer": _state_types(state.opt_state), "pieces": all_pieces, "extra": extra,
            }
            (tmp / "meta.json").write_text(json.dumps(meta))
            swap_into_place(tmp, path)
            latest_tmp = path.parent / ".latest.tmp"
            latest_tmp.write_text(path.name + "\n")
            os.replace(latest_tmp, path.parent / "latest")
            if keep is not None:
                _apply_keep(path, keep)
        except BaseException as e:  # noqa: BLE001
            error = e
    done = C.all_reduce(torch.tensor([0.0 if error is None else 1.0], device=mesh.device), mesh, ("pp", "dp", "tp"), "max")
    if error is not None or failed.item() or done.item():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise CheckpointError(f"saving {path} failed on another rank; nothing was written, 'latest' is unchanged")


def _apply_keep(current: Path, keep: int) -> None:
    found = []
    for d in current.parent.iterdir():
        if d.is_dir() and not d.name.startswith(".") and (d / "meta.json").exists():
            try:
                found.append((json.loads((d / "meta.json").read_text())["step"], d.name, d))
            except (ValueError, KeyError):
                continue
    found.sort()
    for _, _, d in found[: max(0, len(found) - max(keep, 1))]:
        if d != current:
            shutil.rmtree(d)


# ---------------------------------------------------------------------------------------------------- load


class _Source:
    """A checkpoint's metadata and its pieces, read on demand (headers cached, CRC checked)."""

    def __init__(self, path):
        self.folder = resolve(path)
        try:
            self.meta = json.loads((self.folder / "meta.json").read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.folder / 'meta.json'} is not valid JSON: {e}") from None
        if self.meta.get("format") != FORMAT or not self.meta.get("complete"):
            raise CheckpointError(f"{self.folder} is not a complete {FORMAT} checkpoint")
        self.pieces: dict[str, list[dict]] = {}
        for pc in self.meta["pieces"]:
            self.pieces.setdefault(pc["tensor"], []).append(pc)
        self._headers: dict[str, dict] = {}
        self.bytes_read = 0

    def _read(self, pc: dict) -> torch.Tensor:
        f = pc["file"]
        if f not in self._headers:
            file = self.folder / f
            if not file.exists():
                raise CheckpointError(f"checkpoint {self.folder} is missing {f} (a rank's file)")
            self._headers[f] = read_header(file, CheckpointError)
        h = self._headers[f]
        if pc["key"] not in h:
            raise CheckpointError(f"{self.folder / f} has no tensor '{pc['key']}'")
        t = read_block(h[pc["key"]], (), CheckpointError)
        self.bytes_read += t.numel() * t.element_size()
        if _crc(t) != pc["crc"]:
            raise CheckpointError(f"corrupt checkpoint file {self.folder / f}: tensor '{pc['key']}' fails its CRC check")
        return t

    def assemble(self, tensor: str, region: list[list[int]], a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[a, b)`` of the row-major flattening of the global block ``region`` of ``tensor``."""
        if b <= a:
            return torch.empty(0, dtype=dtype)
        shape = [e - s for s, e in region] or [1]
        region = region or [[0, 1]]
        inner = math.prod(shape[1:])
        r0, r1 = a // inner, (b - 1) // inner + 1
        want = [[region[0][0] + r0, region[0][0] + r1]] + region[1:]
        wshape = [e - s for s, e in want]
        buf = torch.empty(wshape, dtype=dtype)
        filled = torch.zeros(wshape, dtype=torch.bool)
        for pc in self.pieces.get(tensor, []):
            blk = pc["block"] or [[0, 1]]
            pa, pb = pc["flat"]
            pinner = math.prod(e - s for s, e in blk[1:])
            q0, q1 = pa // pinner, (pb - 1) // pinner + 1
            box = [[blk[0][0] + q0, blk[0][0] + q1]] + blk[1:]
            inter = [[max(x[0], y[0]), min(x[1], y[1])] for x, y in zip(box, want)]
            if any(s >= e for s, e in inter):
                continue  # this piece holds nothing this rank needs: not read
            data = self._read(pc).to(dtype)
            rows = torch.empty((q1 - q0) * pinner, dtype=dtype)
            valid = torch.zeros((q1 - q0) * pinner, dtype=torch.bool)
            rows[pa - q0 * pinner : pb - q0 * pinner] = data
            valid[pa - q0 * pinner : pb - q0 * pinner] = True
            bshape = [q1 - q0] + [e - s for s, e in blk[1:]]
            src = tuple(slice(s - x[0], e - x[0]) for (s, e), x in zip(inter, box))
            dst = tuple(slice(s - y[0], e - y[0]) for (s, e), y in zip(inter, want))
            v = valid.view(bshape)[src]
            buf[dst] = torch.where(v, rows.view(bshape)[src], buf[dst])
            filled[dst] |= v
        off = a - r0 * inner
        if not bool(filled.reshape(-1)[off : off + b - a].all()):
            raise CheckpointError(
                f"checkpoint {self.folder} has no data for part of '{tensor}' (global block {region}): "
                f"a rank's file or piece is missing"
            )
        return buf.reshape(-1)[off : off + b - a].clone()


def _check_params(src: _Source, paths: list[str], gshapes: list[list[int]]) -> dict:
    saved = {p["path"]: p for p in src.meta["params"]}
    for p, g in zip(paths, gshapes):
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
    extra = [p for p in saved if p not in set(paths)]
    if extra:
        raise CheckpointError(f"checkpoint {src.folder} is from another model: it has leaf '{extra[0]}', which the model lacks")
    return saved


def load_params(path, like: Any, specs: Any, mesh: Mesh | None = None) -> Any:
    """Only the parameters, as this rank's shards for ``specs`` on ``mesh``; ``like`` gives the tree structure and
    global shapes (meta tensors will do, e.g. ``model.init(cfg, device="meta")``)."""
    mesh = mesh or Mesh()
    src = _Source(path)
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


def load(path, template, mesh: Mesh | None = None, restore_rng: bool = True, stats: dict | None = None):
    """``(state, extra)`` for ``template``, a :class:`funcpar.Step` whose ``init`` has been called (its mesh may
    differ from the one the checkpoint was saved on: pieces are resharded). Parameters and optimizer state are
    read for this rank's new blocks and ZeRO parts only. ``restore_rng`` restores the torch RNG state this rank
    (or, on a larger mesh, rank 0) had at save time. Pass a dict as ``stats`` to get ``bytes_read``. A checkpoint
    of parameters only (``funcpar convert``) loads with a fresh optimizer state.
    """
    from .step import Step, TrainState

    if not isinstance(template, Step):
        raise CheckpointError("load: pass the Step to resume (or use load_params for parameters alone)")
    step = template
    mesh = mesh or step.mesh
    if step._layout is None:
        raise CheckpointError("load: call step.init(params) first (params of the right shapes; values are replaced)")
    src = _Source(path)
    treedef, shapes, _, paths = step._layout
    like = optree.tree_unflatten(treedef, [torch.empty(s, device="meta") for s in shapes])
    specs = [s for _, s, _ in broadcast_specs(step.specs, like)]
    gshapes = [list(global_shape(spec, s, mesh)) for s, spec in zip(shapes, specs)]
    saved = _check_params(src, paths, gshapes)
    leaves = []
    for p, spec, g, s in zip(paths, specs, gshapes, shapes):
        region = _block(spec, g, mesh)
        t = src.assemble(f"param/{p}", region, 0, math.prod(s), getattr(torch, saved[p]["dtype"]))
        leaves.append(t.view(s).to(mesh.device))
    params = optree.tree_unflatten(treedef, leaves)
    fresh = step.init(params)
    o_leaves = optree.tree_leaves(fresh.opt_state)
    o_paths = _paths(fresh.opt_state)
    index = _opt_param_index(fresh.opt_state, params)
    saved_opt = [o["path"] for o in src.meta["opt"]]
    if not saved_opt:  # parameters only (e.g. from `funcpar convert`): a fresh optimizer
        if restore_rng:
            _restore_rng(src, mesh)
        return TrainState(params, fresh.opt_state, int(src.meta["step"])), src.meta.get("extra")
    if saved_opt != o_paths:
        first = next((i for i, (x, y) in enumerate(zip(saved_opt, o_paths)) if x != y), min(len(saved_opt), len(o_paths)))
        have = saved_opt[first] if first < len(saved_opt) else "(absent)"
        want = o_paths[first] if first < len(o_paths) else "(absent)"
        raise CheckpointError(
            f"checkpoint {src.folder} was saved with optimizer state {', '.join(src.meta.get('optimizer', []))}; "
            f"this step's is {', '.join(_state_types(fresh.opt_state))} (first difference: '{have}' there, "
            f"'{want}' here): resume with the optimizer it was saved with"
        )
    parts = step._leaf_parts()
    new = []
    for x, op, i in zip(o_leaves, o_paths, index):
        key = f"opt/{op}"
        if i is None:
            t = src.assemble(key, [[0, n] for n in x.shape], 0, x.numel(), x.dtype).view(x.shape)
        else:
            a, z, _ = parts[i]
            t = src.assemble(key, _block(specs[i], gshapes[i], mesh), a, z, x.dtype)
        new.append(t.to(x.device))
    if restore_rng:
        _restore_rng(src, mesh)
    if stats is not None:
        stats["bytes_read"] = src.bytes_read
    opt_state = optree.tree_unflatten(optree.tree_structure(fresh.opt_state), new)
    return TrainState(params, opt_state, int(src.meta["step"])), src.meta.get("extra")


def _restore_rng(src: _Source, mesh: Mesh) -> None:
    r = mesh.rank if mesh.rank < src.meta["world"] else 0
    for pc in src.pieces.get(f"rng/torch/{r}", []):
        torch.set_rng_state(src._read(pc))


def export_hf(path, out, model, cfg, mesh: Mesh | None = None, **kwargs) -> None:
    """Write a checkpoint's parameters as a transformers folder (see :func:`funcpar.hf.save`), from any mesh."""
    from . import hf

    mesh = mesh or Mesh()
    if hasattr(cfg, "with_mesh"):
        cfg = cfg.with_mesh(mesh)
    specs = model.specs(cfg, mesh)
    params = load_params(path, model.init(cfg, device="meta"), specs, mesh)
    hf.save(out, params, model, cfg, mesh, specs=specs, **kwargs)
