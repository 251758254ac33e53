"""Reading a Hugging Face model folder as files that are not trusted: ``config.json`` (a JSON object whose keys have
their types, naming the model) and the tensors' headers (a folder's one dtype, or the caller's explicit one).

Private to :mod:`funcpar.io.hf`, which re-exports ``HFError``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from funcpar.io.safetensors_header import DTYPES, TensorEntry, read_block, read_header, within
from funcpar.model import ModelSpec, generic_types, json_kind, get_model, known_models

_FLOATS = {str(d).removeprefix("torch."): d for d in DTYPES.values() if d.is_floating_point}


class HFError(ValueError):
    """A checkpoint folder that cannot be loaded as asked (named file, tensors and shapes in the message)."""


class Reader:
    """The tensors of a checkpoint folder (headers only), and block reads that count their bytes."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.bytes_read = 0
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        self.tensors: dict[str, TensorEntry] = {}
        if index.exists():
            weight_map = _weight_map(index)
            files = sorted(set(map(str, weight_map.values())), key=str)
            for f in weight_map.values():
                within(folder, f, f"index {index}", HFError)
            headers = {f: read_header(folder / f, HFError) for f in files}
            for name, f in weight_map.items():
                if name not in headers[f]:
                    raise HFError(f"index {index} puts tensor '{name}' in {f}, but that file has no such tensor")
                self.tensors[name] = headers[f][name]
            for h in headers.values():
                for name in h:
                    self.tensors.setdefault(name, h[name])
        elif single.exists():
            self.tensors = read_header(single, HFError)
        else:
            raise HFError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")

    def read(self, name: str, region: tuple[slice, ...]) -> torch.Tensor:
        """The block ``region`` of tensor ``name``; only its bytes are read, and counted."""
        out = read_block(self.tensors[name], region, HFError)
        self.bytes_read += out.numel() * out.element_size()
        return out


def _weight_map(index: Path) -> dict[str, Any]:
    """The ``weight_map`` of a sharded folder's index: an object of tensor names to file names, else an error naming
    the index (a hand-made or truncated one would otherwise fail as a traceback deep in the load)."""
    try:
        raw = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"corrupt index {index}: not valid JSON ({e})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        what = (f"holds {json_kind(raw)}" if not isinstance(raw, dict) else "has no 'weight_map'"
                if "weight_map" not in raw else f"has a 'weight_map' that is {json_kind(weight_map)}")
        raise HFError(f"corrupt index {index}: it {what}, expected an object whose 'weight_map' maps each tensor "
                      f"name to its .safetensors file: restore the file from the model's source")
    return weight_map  # (a value that is not a file name inside the folder: refused as the files are opened)


def read_config(folder: Path) -> dict[str, Any]:
    """``config.json`` as a dict: valid JSON, and an object (its keys' types are the model's check)."""
    f = folder / "config.json"
    try:
        raw = json.loads(f.read_text())
    except FileNotFoundError:
        raise HFError(f"{folder} has no config.json: is it a Hugging Face model folder?") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise HFError(f"{f} holds {json_kind(raw)}, not an object of config keys: is it a model's config.json?")
    return raw


def resolve_model(model: Any, cfg: dict, folder: Path) -> ModelSpec:
    mt = cfg.get("model_type")
    if model is None:
        known = known_models()
        if isinstance(mt, str) and mt not in known and generic_types(mt):
            return get_model(mt)  # transformers' own module, split by its tp plan
        if not isinstance(mt, str) or mt not in known:
            raise HFError(f"{folder / 'config.json'} has model_type '{mt}', which funcpar does not know; it knows: "
                          f"{', '.join(sorted(known))} (register a model with funcpar.register_model)")
        return known[mt]
    spec = get_model(model)
    spec.check_hf(f"reading {folder}", HFError)
    if mt is not None and mt not in spec.model_types:
        raise HFError(
            f"{folder / 'config.json'} has model_type '{mt}', which model '{spec.name}' does not implement "
            f"({', '.join(spec.model_types)}); funcpar knows: {', '.join(sorted(known_models()))}"
        )
    return spec


def check_dtypes(reader: Reader, folder: Path, raw: dict, names: list[str]) -> None:
    """With no ``dtype`` asked for, the tensors ``names`` load as they are stored, so they must agree: with the
    dtype ``config.json`` names (``dtype``, or ``torch_dtype`` before transformers 5), else with one another. A
    float16 tensor among float32 ones would otherwise load as it is and fail in the step, far from its file."""
    key = next((k for k in ("dtype", "torch_dtype") if raw.get(k) is not None), None)
    if key is not None and raw[key] not in _FLOATS:
        raise HFError(f"{folder / 'config.json'}: config key '{key}' is {raw[key]!r}, expected a float dtype name "
                      f"({', '.join(_FLOATS)}), or pass dtype= to fp.hf.load")
    found = {n: reader.tensors[n].dtype for n in dict.fromkeys(names)}
    want, n = Counter(found.values()).most_common(1)[0] if found else (None, 0)
    why = f"the checkpoint's other {n} tensors are" if n > 1 else "the checkpoint's other tensor is"
    if key is not None:
        want, why = _FLOATS[raw[key]], f"config.json's '{key}' is"
    odd = [n for n, d in found.items() if d != want]
    if odd:
        t, name = reader.tensors[odd[0]], str(want).removeprefix("torch.")
        more = f" (and {len(odd) - 1} more tensors)" if len(odd) > 1 else ""
        raise HFError(f"{t.file}: tensor '{odd[0]}' is {str(t.dtype).removeprefix('torch.')}{more}, but {why} "
                      f"{name}: pass dtype=torch.{name} (or the dtype you want) to fp.hf.load to convert every "
                      f"tensor explicitly")
