"""Data: local datasets (plain text, JSONL pretraining, and the supervised formats of DeepSpeed pipeline
fine-tuning repos), tokenizers, packing/padding to a sequence length, and dp-sharded, resumable batches.

Sample formats, one JSON object per line (``.jsonl``/``.json``), or plain text (``.txt``, documents separated
by blank lines):

- ``{"type": "pretrain", "text": ...}`` (also a bare ``{"text": ...}``): loss on every token;
- ``{"type": "instruct", "instruct": ..., "input": ... (optional), "output": ...}``: loss on the output only;
- ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}`` (TRL's, axolotl's, torchtune's) or
  ``{"type": "conversation", "rounds": [["ask"|"user", ...], ["ans"|"assistant", ...], ...]}``: loss on the
  assistant turns only, through the tokenizer's chat template when it has one (``System:``/``User:``/``Assistant:``
  lines otherwise);
- ``{"type": "ref_qa", "reference": ..., "rounds": [...]}``: a reference text, then a conversation.

A sample becomes token ids and a loss mask; ids end with EOS. Batches are ``{"input_ids", "labels"}`` with
``labels = -100`` where the mask is 0. Every rank computes the same global batch from the same seed and takes its
dp block, so tp and pp peers receive identical batches by construction and dp ranks disjoint ones. The loader's
position is a small dict that goes into the checkpoint, so a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from .mesh import Mesh

__all__ = ["ByteTokenizer", "HFTokenizer", "load_samples", "encode", "Dataset", "Loader", "batches", "DataError",
           "render"]


class DataError(ValueError):
    """A malformed sample or data file (the message names the file and line)."""


def _byte_chars() -> dict[int, str]:
    """The byte-level alphabet of GPT-2's tokenizers: each byte as a printable character (how ``tokenizers``'
    ``ByteLevel`` pre-tokenizer spells bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(rest)}}


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus PAD=256, BOS=257, EOS=258. Needs no files; exports as an HF tokenizer
    (:meth:`save_pretrained`) that encodes every text to the same ids (bar the special tokens' own spellings, which
    an HF tokenizer reads as those tokens)."""

    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 259
    _SPECIAL = {"<pad>": 256, "<s>": 257, "</s>": 258}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """``tokenizer.json`` (a byte-level BPE without merges: one token per byte, ids as here) and its config, so
        ``transformers.AutoTokenizer`` and ``pipeline`` read the export."""
        folder = Path(folder)
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                  "special": True} for t, i in self._SPECIAL.items()]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                 "vocab": {c: b for b, c in sorted(_byte_chars().items())}, "merges": []}
        spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level, "model": model}
        (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=1) + "\n")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>",
                  "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False,
                  "clean_up_tokenization_spaces": False}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model")  # (or *.model)


class HFTokenizer:
    """A local Hugging Face tokenizer folder (``tokenizer.json`` etc.), loaded with ``transformers``.

    ``chat_template``: render conversation and ref_qa samples with the tokenizer's own ``chat_template`` when it has
    one (:meth:`chat_segments`), instead of funcpar's ``User:``/``Assistant:`` template."""

    def __init__(self, path: str | os.PathLike, chat_template: bool = True):
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise DataError(f"--tokenizer {path}: no such folder (give a folder with an HF tokenizer's files, or "
                            f"'byte')")
        files = sorted(p.name for p in Path(path).iterdir() if p.is_file())
        empty = DataError(f"--tokenizer {path} holds no tokenizer: it would encode every text to nothing (the folder "
                          f"has {', '.join(files[:8]) or 'no files'}{' ...' if len(files) > 8 else ''}; a tokenizer "
                          f"is tokenizer.json, or tokenizer.model or vocab files, beside tokenizer_config.json). Give "
                          f"the folder the tokenizer was saved to")
        if not any(f in _TOKENIZER_FILES or f.endswith((".tiktoken", ".model")) for f in files):
            raise empty
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path))
        except (ValueError, OSError) as e:  # (a missing converter package, a broken file)
            raise DataError(f"--tokenizer {path}: transformers cannot load it: {str(e).splitlines()[0]}") from None
        if len(self.tok) == 0 or not self.tok.encode("Hello, world", add_special_tokens=False):
            raise empty
        self.chat = chat_template and bool(getattr(self.tok, "chat_template", None))
        self.eos_id = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0
        self.bos_id = self.tok.bos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        self.tok.save_pretrained(str(folder))

    def chat_segments(self, messages: list[dict], where: str) -> list[tuple[str, bool]]:
        """``messages`` through the chat template as ``(text, trained_on)`` segments: each assistant reply (with
        the template's end-of-turn text) trained on, everything before it not."""
        out, done = [], ""
        for k, m in enumerate(messages + [None]):
            if m is not None and m["role"] != "assistant":
                continue
            prompt = self.tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=m is not None)
            full = prompt if m is None else self.tok.apply_chat_template(messages[: k + 1], tokenize=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError(f"{where}: the tokenizer's chat_template does not render a conversation as a prefix "
                                "of its continuation, so answers cannot be told apart: use --chat-template builtin")
            out += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
        return [(t, train) for t, train in out if t]


# --------------------------------------------------------------------------------------------------- samples


def _need(sample: dict, key: str, where: str, kind: type = str):
    if key not in sample:
        raise DataError(f"{where}: a '{sample.get('type', 'pretrain')}' sample needs field '{key}'")
    if not isinstance(sample[key], kind):
        raise DataError(f"{where}: field '{key}' must be a {kind.__name__}, got {type(sample[key]).__name__}")
    return sample[key]


ROLES = {"ask": "user", "user": "user", "ans": "assistant", "assistant": "assistant", "system": "system"}


def _chat(sample: dict, where: str) -> list[dict]:
    """The turns of a chat sample as ``[{"role": "system"|"user"|"assistant", "content": text}, ...]``: its
    ``messages`` (TRL's, axolotl's and torchtune's format: a list of ``{"role", "content"}`` objects) or its
    ``rounds`` (``[role, text]`` pairs, role ``ask``/``user``, ``ans``/``assistant`` or ``system``); at least one
    assistant turn."""
    if "messages" in sample:
        turns = _need(sample, "messages", where, list)
        for k, m in enumerate(turns):
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: message {k} must be {{\"role\": \"system\"|\"user\"|\"assistant\", "
                                f"\"content\": text}}, got {json.dumps(m)[:80]}")
        msgs = [{"role": ROLES[m["role"]], "content": m["content"]} for m in turns]
    else:
        msgs = []
        for k, r in enumerate(_need(sample, "rounds", where, list)):
            if not (isinstance(r, (list, tuple)) and len(r) == 2 and r[0] in ROLES and isinstance(r[1], str)):
                raise DataError(f"{where}: round {k} must be [role, text] with role user, assistant or system (or "
                                f"ask, ans), got {json.dumps(r)[:80]}")
            msgs.append({"role": ROLES[r[0]], "content": r[1]})
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: a conversation with no assistant turn has nothing to train on")
    return msgs


def _builtin_chat(msgs: list[dict]) -> list[tuple[str | None, bool]]:
    """funcpar's template: ``System: ...``, ``User: ...`` lines, each reply ``Assistant: `` then the text and EOS,
    trained on."""
    out: list[tuple[str | None, bool]] = []
    for m in msgs:
        if m["role"] == "assistant":
            out += [("Assistant: ", False), (m["content"], True), (None, True)]  # None = EOS, trained on
        else:
            out.append((f"{m['role'].capitalize()}: {m['content']}\n", False))
    return out


def _kind(sample: dict) -> str:
    return sample.get("type", "conversation" if "messages" in sample else "pretrain")


def render(sample: dict, where: str = "sample") -> list[tuple[str | None, bool]]:
    """A sample as ``[(text or None for EOS, trained_on), ...]``: the prompt template of each format."""
    if not isinstance(sample, dict):
        raise DataError(f"{where}: a sample must be a JSON object, got {type(sample).__name__}")
    kind = _kind(sample)
    if kind == "pretrain":
        return [(_need(sample, "text", where), True), (None, True)]
    if kind == "instruct":
        instruct = _need(sample, "instruct", where)
        inp = sample.get("input")
        if inp is not None and not isinstance(inp, str):
            raise DataError(f"{where}: field 'input' must be a str, got {type(inp).__name__}")
        prompt = f"{instruct}\n{inp}\n" if inp else f"{instruct}\n"
        return [(prompt, False), (_need(sample, "output", where), True), (None, True)]
    if kind == "conversation":
        return _builtin_chat(_chat(sample, where))
    if kind == "ref_qa":
        return [(f"Reference: {_need(sample, 'reference', where)}\n", False)] + _builtin_chat(_chat(sample, where))
    raise DataError(f"{where}: unknown sample type '{kind}' (known: pretrain, instruct, conversation, ref_qa)")


def _messages(sample: dict, where: str) -> list[dict]:
    """A conversation or ref_qa sample as chat messages (the reference as a system message)."""
    msgs = _chat(sample, where)
    if _kind(sample) == "ref_qa":
        msgs.insert(0, {"role": "system", "content": f"Reference: {_need(sample, 'reference', where)}"})
    return msgs


def encode(sample: dict, tok, where: str = "sample") -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of one sample."""
    ids: list[int] = []
    mask: list[int] = []
    chat = getattr(tok, "chat", False) and isinstance(sample, dict) and _kind(sample) in ("conversation", "ref_qa")
    for text, train in (tok.chat_segments(_messages(sample, where), where) if chat else render(sample, where)):
        piece = [tok.eos_id] if text is None else tok.encode(text)
        ids += piece
        mask += [int(train)] * len(piece)
    return ids, mask


def load_samples(path: str | os.PathLike) -> list[tuple[dict, str]]:
    """``[(sample, "file:line"), ...]`` from a ``.jsonl``/``.json`` file, a ``.txt`` file, or a folder of them."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".txt"))
        if not files:
            raise DataError(f"{path}: no .jsonl, .json or .txt files")
        return [s for f in files for s in load_samples(f)]
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    out = []
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:  # name the line and column, not just a byte offset
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {col}); save the file "
                        f"as UTF-8") from None
    if path.suffix == ".txt":
        text = raw.decode("utf-8")
        line = 1
        for doc in text.split("\n\n"):
            if doc.strip():
                out.append(({"type": "pretrain", "text": doc.strip("\n")}, f"{path}:{line}"))
            line += doc.count("\n") + 2
        return out
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append((json.loads(line), f"{path}:{n}"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    return out


# --------------------------------------------------------------------------------------------------- dataset


@dataclass
class Dataset:
    """Tokenized rows of ``seq_len`` tokens: ``ids`` (N, T) and ``mask`` (N, T) tensors, and statistics."""

    ids: torch.Tensor
    mask: torch.Tensor
    samples: int
    truncated: int
    tokens: int
    stats: dict = field(default_factory=dict)

    @classmethod
    def from_samples(cls, samples: list[tuple[dict, str]], tok, seq_len: int, pack: bool = True) -> "Dataset":
        rows_ids: list[list[int]] = []
        rows_mask: list[list[int]] = []
        truncated = tokens = 0
        if pack:  # one stream, cut into rows; a sample longer than a row continues into the next row
            stream_ids: list[int] = []
            stream_mask: list[int] = []
            for sample, where in samples:
                ids, mask = encode(sample, tok, where)
                stream_ids += ids
                stream_mask += mask
                tokens += len(ids)
            for k in range(0, len(stream_ids) - seq_len + 1, seq_len):
                rows_ids.append(stream_ids[k : k + seq_len])
                rows_mask.append(stream_mask[k : k + seq_len])
        else:  # one sample per row: truncated to seq_len (counted) or padded (pad positions not trained on)
            for sample, where in samples:
                ids, mask = encode(sample, tok, where)
                tokens += len(ids)
                if len(ids) > seq_len:
                    truncated += 1
                    ids, mask = ids[:seq_len], mask[:seq_len]
                pad = seq_len - len(ids)
                rows_ids.append(ids + [tok.pad_id] * pad)
                rows_mask.append(mask + [0] * pad)
        if not rows_ids:
            raise DataError(f"the data holds {tokens} tokens, not enough for one row of seq_len={seq_len}")
        return cls(torch.tensor(rows_ids), torch.tensor(rows_mask, dtype=torch.bool), len(samples), truncated, tokens)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def split(self, eval_fraction: float, seed: int = 0) -> tuple["Dataset", "Dataset"]:
        """A deterministic (train, held-out) split of the rows."""
        n_eval = max(1, int(len(self) * eval_fraction)) if eval_fraction > 0 else 0
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        ev, tr = perm[:n_eval], perm[n_eval:]
        return (Dataset(self.ids[tr], self.mask[tr], self.samples, self.truncated, self.tokens),
                Dataset(self.ids[ev], self.mask[ev], self.samples, self.truncated, self.tokens))


class Loader:
    """Endless, reshuffled-per-epoch global batches; each rank yields its dp block.

    ``state_dict()`` / ``load_state_dict()`` carry the position (batches served), so a resumed run continues the
    exact order. The order depends only on ``seed`` and the global batch size, not on the mesh.
    """

    def __init__(self, data: Dataset, mesh: Mesh, global_batch: int, seed: int = 0, shuffle: bool = True):
        dp = mesh.axis_size("dp")
        if global_batch % dp:
            raise DataError(f"global_batch={global_batch} is not divisible by dp={dp}")
        if len(data) < global_batch:
            raise DataError(f"the data has {len(data)} rows, fewer than one global batch of {global_batch}")
        self.data, self.mesh, self.global_batch, self.seed, self.shuffle = data, mesh, global_batch, seed, shuffle
        self.position = 0

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.data))
        return torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))

    def global_batch_at(self, position: int) -> dict[str, torch.Tensor]:
        per_epoch = len(self.data) // self.global_batch
        epoch, k = divmod(position, per_epoch)
        rows = self._order(epoch)[k * self.global_batch : (k + 1) * self.global_batch]
        ids, mask = self.data.ids[rows], self.data.mask[rows]
        return {"input_ids": ids, "labels": ids.masked_fill(~mask, -100)}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        b = self.global_batch_at(self.position)
        self.position += 1
        dp, c = self.mesh.axis_size("dp"), self.mesh.coord("dp")
        return {k: v.chunk(dp)[c].to(self.mesh.device) for k, v in b.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = state.get("position") if isinstance(state, dict) else None
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise DataError(f"cannot resume data order: the saved loader state {state!r} has no position (a "
                            f"non-negative integer: the batches served)")
        same = state.get("global_batch", self.global_batch) == self.global_batch
        if not same or state.get("seed", self.seed) != self.seed:
            raise DataError(
                f"cannot resume data order: saved with global_batch={state.get('global_batch')} "
                f"seed={state.get('seed')}, "
                f"now global_batch={self.global_batch} seed={self.seed}"
            )
        self.position = position


def batches(dataset: Dataset, mesh: Mesh, global_batch: int, seed: int = 0) -> Loader:
    """This rank's batches of ``dataset`` (see :class:`Loader`)."""
    return Loader(dataset, mesh, global_batch, seed)
