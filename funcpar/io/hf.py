"""Hugging Face checkpoints in and out.

``load`` reads ``config.json`` and ``model.safetensors`` (or a sharded ``model.safetensors.index.json``) into a
parameter tree already sharded for a mesh. Each rank reads **only the bytes of its own blocks**: the safetensors
header gives every tensor's offset, and the block is fetched with ``pread`` run by run (a row-block is one read,
a column-block one read per row), never the whole tensor. The check is strict: missing, unexpected and
mis-shaped tensors are reported in one line (how many of each, the first three by name and shape); a tensor in
another dtype than the checkpoint's is refused by name unless a ``dtype`` to convert to is given, and so is a
``config.json`` key of the wrong type (:mod:`funcpar.io.hf_folder`). Only JSON and raw tensor bytes are read;
nothing is unpickled.

``save`` gathers leaf by leaf onto rank 0 (each distinct block moves once) and writes sharded safetensors files
of at most ``max_shard_size`` bytes, the index and ``config.json`` into a temporary folder that is renamed into
place when complete, so a reader never sees a half-written export.

The mapping between HF names and pytree paths is data each model provides in its contract
(:class:`funcpar.model.HFNames`: name patterns with ``{i}`` for the layer index and ``{j}`` for a leaf stacked
from one tensor per index (Mixtral's experts), leaves stored transposed, leaves that are part ``k`` of ``n`` of a
fused HF tensor, padded vocab tables, ignorable tensors, and other layouts read but not written). A folder is read
in the layout its names fit; ``save`` writes the model's first. The model is found in the registry by the folder's
``model_type`` (:func:`funcpar.model.get_model`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import optree
import torch

from funcpar.io.hf_folder import HFError, Reader, check_dtypes, read_config, resolve_model
from funcpar.io.atomic import write_folder
from funcpar.parallel.mesh import Mesh
from funcpar.model import HFNames, ModelSpec, get_model
from funcpar.parallel.sharding import gathered_leaves
from funcpar.spec import P, broadcast_specs, local_slice
from funcpar.tree import leaves_with_path

__all__ = ["load", "save", "auto_specs", "HFError", "read_config"]


# ------------------------------------------------------------------------------------------- model tables


@dataclass(frozen=True)
class _Map:
    hf: str  # with {j} where the leaf is the stack, along its first dimension, of one tensor per index j
    transposed: bool
    split: tuple[int, int, int] | None
    vocab: int | None = None  # a vocab table padded beyond its real rows: the checkpoint holds this many
    parts: tuple[int, ...] | None = None  # a split leaf: the sizes of the fused tensor's n parts along its dim

    def split_dim(self, ndim: int) -> int:
        """The split's dim in a tensor of ``ndim`` dims; a negative one counts from the end, at least 0 (``-2``:
        a weight's output rows, a 1-D bias's only dim, an expert stack's rows)."""
        d = self.split[0]
        return max(0, ndim + d) if d < 0 else d

    @property
    def stacked(self) -> bool:
        return "{j}" in self.hf

    def names(self, leaf_shape: tuple[int, ...]) -> list[str]:
        """The HF tensors the leaf is read from: one, or one per index of a stacked leaf's first dimension."""
        return [self.hf.replace("{j}", str(j)) for j in range(leaf_shape[0])] if self.stacked else [self.hf]

    def hf_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the HF tensor (each one of a stacked leaf's)."""
        s = list(leaf_shape[1:] if self.stacked else leaf_shape)
        if self.vocab is not None:
            s[0] = self.vocab
        if self.transposed:
            s.reverse()
        if self.split:
            dim, n = self.split_dim(len(s)), self.split[2]
            s[dim] = sum(self.parts) if self.parts else s[dim] * n
        return tuple(s)

    def file_region(self, region: tuple[slice, ...], hf_shape: tuple[int, ...]) -> tuple[slice, ...]:
        r = list(region)
        if self.transposed:
            r.reverse()
        if self.split:
            dim, (_, k, n) = self.split_dim(len(hf_shape)), self.split
            off = sum(self.parts[:k]) if self.parts else k * (hf_shape[dim] // n)
            r[dim] = slice(r[dim].start + off, r[dim].stop + off)
        return tuple(r)


def name_plan(model: Any, paths: list[str], cfg: Any = None, names: HFNames | None = None) -> list[_Map]:
    """The HF tensor (and transform) of every leaf path, from the model's literal table (``names``: one of its
    layouts, default the one ``save`` writes). With ``cfg``, a fused tensor's parts are as large as their leaves
    (ChatGLM's q, k, v rows differ); without, taken to be equal."""
    model = get_model(model)
    if names is None:
        model.check_hf("mapping its leaves to HF tensor names", HFError)
        names = model.hf
    rules = []
    for pat, hf in names.table:
        rx = re.compile("^" + re.escape(pat).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{\*\}", r"(?P<rest>.+)")
                        + "$")
        rules.append((rx, pat, hf))
    transposed, splits = set(names.transposed), dict(names.splits)
    padded = getattr(cfg, "rows", 0) > getattr(cfg, "vocab_size", 0)
    vocab_leaves = set(names.vocab_padded) if padded else set()

    def one(p: str) -> _Map:
        for rx, pat, hf in rules:
            m = rx.match(p)
            if m:
                i, rest = m.groupdict().get("i"), m.groupdict().get("rest")
                name = hf.replace("{i}", i) if i is not None else hf
                name = name.replace("{*}", rest) if rest is not None else name
                return _Map(name, pat in transposed, splits.get(pat), cfg.vocab_size if pat in vocab_leaves else None)
        raise HFError(f"model '{model.name}' has no Hugging Face name for leaf '{p}' in its HFNames table")

    out = [one(p) for p in paths]
    if cfg is None or not any(mp.split for mp in out):
        return out
    shapes = dict(leaves_with_path(model.init(cfg, device="meta")))
    sizes: dict[str, dict[int, int]] = {}  # fused HF tensor -> {part k: its size along the split dim}
    for p, x in shapes.items():
        mp = one(p)
        if mp.split:  # the leaf's size along the split dim, in the checkpoint's layout
            s = x.shape[1:] if mp.stacked else x.shape
            d = mp.split_dim(len(s))
            sizes.setdefault(mp.hf, {})[mp.split[1]] = s[-1 - d if mp.transposed else d]
    for mp in out:
        if mp.split and sorted(sizes.get(mp.hf, ())) != list(range(mp.split[2])):
            raise HFError(f"model '{model.name}': its HFNames splits make '{mp.hf}' of {mp.split[2]} parts, but "
                          f"its leaves give parts {sorted(sizes.get(mp.hf, ()))}")
    return [dataclasses.replace(mp, parts=tuple(sizes[mp.hf][k] for k in range(mp.split[2]))) if mp.split else mp
            for mp in out]


@dataclass(frozen=True)
class _Layout:
    """One of a model's layouts held against a folder's tensors: its plan, and what it lacks or does not expect."""

    plan: list[_Map]
    expected: dict[str, tuple[int, ...]]  # HF name -> shape
    missing: list[str]
    unexpected: list[str]


def _layout(reader: Reader, model: ModelSpec, cfg, leaves, names: HFNames) -> _Layout:
    plan = name_plan(model, [p for p, _, _ in leaves], cfg, names)
    expected: dict[str, tuple[int, ...]] = {}
    for (_, _, meta), mp in zip(leaves, plan, strict=True):
        for name in mp.names(tuple(meta.shape)):
            expected.setdefault(name, mp.hf_shape(tuple(meta.shape)))
    present = set(reader.tensors)
    ignored = [re.compile(p) for p in names.ignored_for(cfg)]
    unexpected = sorted(n for n in present - set(expected) if not any(r.match(n) for r in ignored))
    return _Layout(plan, expected, sorted(set(expected) - present), unexpected)


def _choose_layout(reader: Reader, folder: Path, model: ModelSpec, cfg, leaves) -> list[_Map]:
    """The plan of the model's layout that the folder's names fit (the nearest of several, the first on a tie);
    an :class:`HFError` of one line where its tensors do not match it."""
    layouts = [_layout(reader, model, cfg, leaves, names) for names in model.hf.layouts()]
    best = min(layouts, key=lambda lay: len(lay.missing) + len(lay.unexpected))  # min keeps the first on a tie
    tensors = reader.tensors
    wrong = sorted(n for n in set(best.expected) & set(tensors) if tensors[n].shape != best.expected[n])
    if not (best.missing or best.unexpected or wrong):
        return best.plan
    parts = [
        _first(best.missing, "missing", lambda n: f"{n} {list(best.expected[n])}"),
        _first(best.unexpected, "unexpected", lambda n: f"{n} {list(tensors[n].shape)} in {tensors[n].file.name}"),
        _first(wrong, "wrong shape", lambda n: f"{n} is {list(tensors[n].shape)}, expected {list(best.expected[n])}"),
    ]
    others = [n for lay in layouts if lay is not best for n in sorted(set(lay.expected) - set(best.expected))[:1]]
    nearest = (f" (the nearest of the {len(layouts)} layouts it reads; the others name tensors such as "
               + ", ".join(f"'{n}'" for n in others) + ")" if others else "")
    raise HFError(f"checkpoint {folder} does not match model '{model.name}' built from its config.json{nearest}: "
                  + "; ".join(p for p in parts if p)
                  + ": check that config.json is the one saved with these weights (its sizes, layer count and "
                  "tie_word_embeddings decide the names and shapes expected)")


def _first(names: list[str], what: str, show) -> str:
    """``what (count): the first 3 names, shown, and how many more``, or ``""`` for none."""
    if not names:
        return ""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{what} ({len(names)}): " + ", ".join(show(n) for n in names[:3]) + more


# ------------------------------------------------------------------------------------------------- API


def load(
    path: str | os.PathLike,
    model: Any = None,
    mesh: Mesh | None = None,
    specs: Any = None,
    dtype: torch.dtype | None = None,
    stats: dict | None = None,
    keep: Any = None,
):
    """Load this rank's shards of the Hugging Face checkpoint in ``path``, as ``model`` lays them out for ``mesh``.

    Each rank reads only the bytes of its own blocks (never a whole tensor; of a stacked leaf, such as Mixtral's
    per-expert tensors, only its own experts'), and the check against the model is strict: missing, unexpected and
    mis-shaped tensors are reported in one line. Of the layouts the model reads (:class:`funcpar.HFNames`
    ``alternates``), the one the folder's names fit is used. Only JSON and raw tensor bytes are read; nothing is
    unpickled.

    Args:
        path: the checkpoint folder: ``config.json`` and ``model.safetensors`` (or a sharded
            ``model.safetensors.index.json``).
        model: a :class:`funcpar.ModelSpec`, a model module or a registered name; default the registered model of
            the folder's ``model_type``.
        mesh: the mesh to shard for; default ``Mesh()``, a one-process mesh (whole tensors), not the mesh in scope.
        specs: the parameters' specs; default ``model.specs(cfg, mesh)``.
        dtype: the dtype to convert each tensor to; default ``None``, the checkpoint's: every tensor read must then
            have the one ``config.json`` names (a tensor in another is refused by name).
        stats: a dict to receive ``bytes_read`` (tensor bytes this rank read).
        keep: ``keep(path) -> bool``; only the leaves it accepts are read, the others are ``None``: a pipeline
            stage's with ``keep=step.holds`` (see :meth:`funcpar.Step.holds`). Default ``None``: every leaf.

    Returns:
        ``(params, cfg)``: the parameter tree of this rank's shards, on ``mesh.device``, and the model's config read
        from ``config.json`` (its vocabulary padded where ``mesh``'s tp does not divide it).

    Raises:
        HFError: the folder is not a checkpoint this model can read (no ``config.json`` or weights, a
            ``model_type`` funcpar or ``model`` does not know, a ``model`` without an HF form, a config key of the
            wrong type or value), or its tensors do not match the model (missing, unexpected, wrong shape, wrong
            dtype).
        ModelError: ``model`` is not a model spec, a model module or a registered name.
    """
    folder = Path(path)
    raw = read_config(folder)
    model = resolve_model(model, raw, folder)
    mesh = mesh or Mesh()
    try:
        cfg = model.config(raw, mesh)  # pads a vocabulary that tp does not divide
    except (KeyError, ValueError) as e:
        raise HFError(f"{folder / 'config.json'}: {e}") from None
    shapes = model.init(cfg, device="meta")
    leaves = broadcast_specs(model.specs(cfg, mesh) if specs is None else specs, shapes)
    reader = Reader(folder)
    plan = _choose_layout(reader, folder, model, cfg, leaves)
    kept = [(n, meta.dtype) for (p, _, meta), mp in zip(leaves, plan, strict=True) if keep is None or keep(p)
            for n in mp.names(tuple(meta.shape))]
    _check_floats(reader, kept)
    if dtype is None:
        check_dtypes(reader, folder, raw, [n for n, _ in kept])
    _check_tied_copy(reader, folder, model, cfg, leaves, plan)
    out = [_read_leaf(reader, p, spec, meta, mp, mesh, dtype) if keep is None or keep(p) else None
           for (p, spec, meta), mp in zip(leaves, plan, strict=True)]
    if stats is not None:
        stats["bytes_read"] = reader.bytes_read
    return optree.tree_unflatten(optree.tree_structure(shapes), out), cfg


def _check_floats(reader: Reader, kept: list[tuple[str, torch.dtype]]) -> None:
    """A floating-point leaf is read from a floating-point tensor: integers (a quantized or mislabelled file)
    would be converted to numbers the model was never trained with, and train to an infinite loss."""
    for name, want in kept:
        t = reader.tensors[name]
        if want.is_floating_point and not t.dtype.is_floating_point:
            raise HFError(f"{t.file}: tensor '{name}' is {str(t.dtype).removeprefix('torch.')}, not a floating-point "
                          f"dtype: a model's weights are float32, bfloat16 or float16 (a quantized or converted "
                          f"file?); load the model's original weights")


def _check_tied_copy(reader: Reader, folder: Path, model: ModelSpec, cfg, leaves, plan: list[_Map]) -> None:
    """With ``tie_word_embeddings``, a stored copy of the head (the model's ``ignored_if_tied``) is not read: it is
    refused unless it equals the tensor it is tied to (the one stored tensor of its shape, the embedding), so that a
    config.json that ties them beside a separately trained head does not drop that head without a word."""
    if not getattr(cfg, "tie_word_embeddings", False) or not model.hf.ignored_if_tied:
        return
    tied = [re.compile(p) for p in model.hf.ignored_if_tied]
    whole = {mp.hf: p in model.hf.vocab_padded for (p, _, _), mp in zip(leaves, plan, strict=True)
             if not (mp.stacked or mp.split) and mp.hf in reader.tensors}  # HF name -> an embedding table's
    for copy in (n for n in reader.tensors if any(r.match(n) for r in tied) and n not in whole):
        same = [n for n in whole if reader.tensors[n].shape == reader.tensors[copy].shape]
        partner = same if len(same) == 1 else [n for n in same if whole[n]]
        if len(partner) == 1 and not _equal(reader, copy, partner[0]):
            raise HFError(f"{folder / 'config.json'} says tie_word_embeddings: true, so the head is "
                          f"'{partner[0]}', but the folder also stores a different '{copy}' "
                          f"({reader.tensors[copy].file.name}) that would be dropped: set tie_word_embeddings to "
                          f"false to train with that head, or remove the tensor to tie them")


def _equal(reader: Reader, a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` (the same shape) hold the same values, read a block of rows at a time."""
    shape = reader.tensors[a].shape
    rest = tuple(slice(0, n) for n in shape[1:])
    step = max(1, (1 << 24) // max(1, math.prod(shape[1:])))
    for lo in range(0, shape[0] if shape else 1, step):
        region = (slice(lo, min(lo + step, shape[0])), *rest) if shape else ()
        x, y = reader.read(a, region), reader.read(b, region)
        if not torch.equal(x, y.to(x.dtype)):
            return False
    return True


def _check_finite(t: torch.Tensor, name: str, reader: Reader, region: tuple[slice, ...]) -> None:
    """Refuse a NaN or infinite value in the block ``region`` of tensor ``name`` just read (``t``, checked a piece
    at a time), naming the tensor, the element and the file: a step would turn it into a NaN loss, and an export or
    ``funcpar convert`` would copy it on."""
    if not t.is_floating_point():
        return
    flat = t.reshape(-1)
    for lo in range(0, flat.numel(), 1 << 24):
        finite = torch.isfinite(flat[lo : lo + (1 << 24)])
        if not finite.all():
            k = lo + int((~finite).nonzero()[0, 0])
            at = torch.unravel_index(torch.tensor(k), t.shape) if t.ndim else ()
            where = [r.start + int(i) for r, i in zip(region, at, strict=True)]
            raise HFError(f"{reader.tensors[name].file}: tensor '{name}' holds {flat[k].item()} at {where}: a weight "
                          f"that is not finite would make every loss NaN; load the model's original weights")


def _read_leaf(reader: Reader, path: str, spec: P, meta, mp: _Map, mesh: Mesh, dtype) -> torch.Tensor:
    region = local_slice(spec, tuple(meta.shape), mesh, path=path)
    if mp.stacked:  # this rank's block of the stack: only its own tensors, and of each only its block
        js, names = region[0], mp.names(tuple(meta.shape))
        t = torch.stack([_read_tensor(reader, names[j], region[1:], mp) for j in range(js.start, js.stop)])
    else:
        t = _read_tensor(reader, mp.hf, region, mp)
    if dtype is not None:
        t = t.to(dtype)
    return t.to(mesh.device)


def _read_tensor(reader: Reader, name: str, region: tuple[slice, ...], mp: _Map) -> torch.Tensor:
    """The block ``region`` (in the leaf's layout) of HF tensor ``name``, in the leaf's layout."""
    want = region[0].stop - region[0].start if region else 0
    if mp.vocab is not None:  # padding rows are not in the file: read the real ones, zeros after
        region = (slice(min(region[0].start, mp.vocab), min(region[0].stop, mp.vocab)), *region[1:])
    file_region = mp.file_region(region, reader.tensors[name].shape)
    t = reader.read(name, file_region)
    _check_finite(t, name, reader, file_region)
    if mp.vocab is not None and t.shape[0] < want:
        t = torch.cat([t, t.new_zeros((want - t.shape[0], *t.shape[1:]))])
    if mp.transposed:
        t = t.t().contiguous()
    return t


def _parse_size(s: int | str) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", s, re.I)
    if not m:
        raise HFError(f"max_shard_size {s!r}: expected bytes or a size such as '500MB' or '5GB'")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * mult)


class _ShardWriter:
    def __init__(self, folder: Path, limit: int):
        from safetensors.torch import save_file

        self._save = save_file
        self.folder, self.limit = folder, limit
        self.current: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[list[str]] = []
        self.total = 0
        self.dtypes: set[torch.dtype] = set()

    def add(self, name: str, t: torch.Tensor) -> None:
        nb = t.numel() * t.element_size()
        if self.current and self.size + nb > self.limit:
            self.flush()
        self.current[name] = t
        self.dtypes.add(t.dtype)
        self.size += nb
        self.total += nb

    def flush(self) -> None:
        if self.current:
            name = str(self.folder / f"part-{len(self.files)}.safetensors")
            self._save(self.current, name, metadata={"format": "pt"})
            self.files.append(list(self.current))
            self.current, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self.files)
        if n == 1:
            os.rename(self.folder / "part-0.safetensors", self.folder / "model.safetensors")
            return
        weight_map = {}
        for k, names in enumerate(self.files):
            fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.folder / f"part-{k}.safetensors", self.folder / fname)
            weight_map.update({name: fname for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def save(path: str | os.PathLike, params: Any, model: Any, cfg: Any, mesh: Mesh | None = None, specs: Any = None,
         max_shard_size: int | str = "2GB", overwrite: bool = False, tokenizer: Any = None) -> None:
    """Write ``params`` (this rank's shards) as a transformers checkpoint folder; collective over the mesh.

    Every leaf is gathered onto rank 0 (each distinct block moves once), and rank 0 writes sharded safetensors
    files, their index and ``config.json``. The folder appears complete or not at all
    (:func:`funcpar.io.atomic.write_folder`): an existing one is replaced only once the new one is fully written, and
    only if funcpar wrote it or ``overwrite``.

    Args:
        path: the folder to write.
        params: this rank's shards of the parameters; on a pipeline mesh each rank passes its stage tree.
        model: a :class:`funcpar.ModelSpec`, a model module or a registered name. A model whose names are read only
            (``HFNames.export_as``: ChatGLM's) is written as the model it names (GLM).
        cfg: the model's config (as :func:`load` returns it); ``config.json`` is written from it, with the dtype
            the tensors are in where they share one.
        mesh: the mesh ``params`` are sharded over; default ``Mesh()``, a one-process mesh, not the mesh in scope.
        specs: the parameters' specs; default ``model.specs(cfg, mesh)``.
        max_shard_size: the largest safetensors file, in bytes or as a size such as ``"500MB"`` or ``"5GB"``
            (``KiB``, ``MiB``, ``GiB`` too); default ``"2GB"``. A tensor larger than that gets a file of its own; a
            checkpoint that fits one file is ``model.safetensors``, without an index.
        overwrite: replace an existing folder funcpar did not write (its contents are deleted); default False,
            refused naming the folder.
        tokenizer: a :mod:`funcpar.data` tokenizer; its files and a ``generation_config.json`` with its
            bos/eos/pad ids go in too, so ``transformers.pipeline("text-generation", path)`` works on the folder.
            Default ``None``: weights and ``config.json`` only.

    Raises:
        HFError: a model without an HF form (:meth:`funcpar.ModelSpec.check_hf`), a leaf that is not a parameter
            of ``model``, a ``max_shard_size`` that is not a size, an existing
            ``path`` funcpar may not replace, or a write that failed on another rank (nothing is written then,
            and what was at ``path`` is unchanged).
    """
    model = get_model(model)
    model.check_hf("fp.hf.save (a transformers folder)", HFError)
    model = get_model(model.hf.export_as) if model.hf.export_as else model  # a layout read, never written
    mesh = mesh or Mesh()
    cfg = cfg.with_mesh(mesh)
    limit = _parse_size(max_shard_size)
    specs = model.specs(cfg, mesh) if specs is None else specs
    paths = [p for p, _ in leaves_with_path(model.init(cfg, device="meta"))]
    plan = dict(zip(paths, name_plan(model, paths, cfg), strict=True))

    def write(tmp: Path) -> None:
        writer = _ShardWriter(tmp, limit) if mesh.rank == 0 else None
        error: BaseException | None = None
        pending: dict[str, dict[int, torch.Tensor]] = {}
        # collective, leaf by leaf: every rank takes part, even after an error
        for p, _spec, g in gathered_leaves(params, specs, mesh, dst=0):
            mp = plan.get(p)
            if mp is None and error is None:
                error = HFError(f"leaf '{p}' is not a parameter of model '{model.name}'")
            if writer is not None and error is None:
                try:
                    _add_leaf(writer, pending, g, mp)
                except BaseException as e:  # noqa: BLE001 - raised once every rank has finished gathering
                    error = e
        if error is not None:
            raise error
        if writer is not None:
            writer.finish()
            d, dtypes = cfg.to_hf(), {str(t).removeprefix("torch.") for t in writer.dtypes}
            if len(dtypes) == 1:  # the dtype the tensors are in (load checks it), not the one cfg was read with
                name = dtypes.pop()
                d.update({k: name for k in ("dtype", "torch_dtype") if k in d} or {"dtype": name})
            if tokenizer is not None:
                _add_tokenizer(tmp, d, tokenizer)
            (tmp / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")

    write_folder(path, mesh, write, error=HFError, overwrite=overwrite, kind="hf")


def _add_tokenizer(folder: Path, config: dict, tokenizer: Any) -> None:
    """The tokenizer's files, and its special ids in ``config`` and ``generation_config.json`` (generation stops at
    its eos, not at the model class's default)."""
    tokenizer.save_pretrained(folder)
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_id", None) for k in ("bos", "eos", "pad")}
    ids = {k: int(v) for k, v in ids.items() if v is not None}
    config.update(ids)
    (folder / "generation_config.json").write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")


def _add_leaf(writer: _ShardWriter, pending: dict, g: torch.Tensor, mp: _Map) -> None:
    """Add one gathered leaf in the checkpoint's layout (a stacked leaf as its tensors, one per index of its first
    dimension; pieces of a fused tensor wait for their siblings)."""
    g = g.detach().cpu()
    for name, x in zip(mp.names(tuple(g.shape)), g if mp.stacked else [g], strict=True):
        _add_tensor(writer, pending, name, x, mp)


def _add_tensor(writer: _ShardWriter, pending: dict, name: str, g: torch.Tensor, mp: _Map) -> None:
    if mp.vocab is not None:
        g = g[: mp.vocab]  # drop vocabulary padding
    if mp.transposed:
        g = g.t()
    if mp.split:
        dim, (_, k, n) = mp.split_dim(g.ndim), mp.split
        parts = pending.setdefault(name, {})
        parts[k] = g
        if len(parts) < n:
            return
        g = torch.cat([parts.pop(i) for i in range(n)], dim)
        del pending[name]
    writer.add(name, g.contiguous())


# ------------------------------------------------------------------------------------------- auto_specs

_FUSED = {"c_attn", "qkv_proj", "query_key_value", "W_pack", "gate_up_proj", "Wqkv"}
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc_in", "fc1", "w1", "w3", "query", "key",
           "value", "dense_h_to_4h", "c_fc", "wq", "wk", "wv"}
_ROW = {"o_proj", "out_proj", "down_proj", "fc_out", "fc2", "w2", "dense_4h_to_h", "dense", "c_proj", "wo"}
_VOCAB = {"embed_tokens", "wte", "word_embeddings", "embed_in", "lm_head", "embed_out", "tok_embeddings", "output"}
_CONV1D = {"c_fc", "c_proj", "c_attn"}  # GPT-2 style Conv1D: weights stored (in, out)


def auto_specs(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, P]:
    """A tensor-parallel plan from conventional Hugging Face names, like DeepSpeed's AutoTP parser.

    ``source`` is a checkpoint folder (only headers are read) or a mapping of names to tensors or shapes.
    Returns ``{hf_name: P}`` in the checkpoint's own layout: q/k/v/gate/up/fc_in -> column-parallel (output dim
    split, bias split), o/down/fc_out -> row-parallel (input dim split, bias replicated), embeddings and lm_head ->
    vocab-parallel (rows split), everything else (norms, positions, fused q/k/v, unknown names) replicated, which is
    always correct, merely not sharded. GPT-2 Conv1D layers (stored ``(in, out)``) get the transposed specs.
    """
    if isinstance(source, Mapping):
        shapes = {n: tuple(getattr(v, "shape", v)) for n, v in source.items()}
    else:
        shapes = {n: t.shape for n, t in Reader(Path(source)).tensors.items()}
    out = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        leaf, module = parts[-1], (parts[-2] if len(parts) > 1 else "")
        if len(shape) == 2 and leaf == "weight":
            conv = module in _CONV1D
            if module in _VOCAB:
                out[name] = P("tp", None)
            elif module in _FUSED:
                out[name] = P()
            elif module in _COLUMN:
                out[name] = P(None, "tp") if conv else P("tp", None)
            elif module in _ROW:
                out[name] = P("tp", None) if conv else P(None, "tp")
            else:
                out[name] = P()
        elif len(shape) == 1 and leaf == "bias" and module in _COLUMN and module not in _FUSED:
            out[name] = P("tp")
        else:
            out[name] = P()
    return out
