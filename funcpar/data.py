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
- ``{"type": "ref_qa", "reference": ..., "rounds": [...]}``: a reference text, then a conversation;
- ``{"prompt": ..., "completion": ...}`` (TRL's prompt-completion): loss on the completion only; text, or lists of
  messages (the conversational form, through the chat template as above).

A file's malformed lines are reported together, in one error.

A sample becomes token ids and a loss mask; ids end with EOS. Batches are ``{"input_ids", "labels"}`` with
``labels = -100`` where the mask is 0. Every rank computes the same global batch from the same seed and takes its
dp block, so tp and pp peers receive identical batches by construction and dp ranks disjoint ones. The loader's
position is a small dict that goes into the checkpoint, so a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .mesh import Mesh

__all__ = ["ByteTokenizer", "HFTokenizer", "load_samples", "iter_samples", "data_files", "encode", "tokenize",
           "Stream", "Dataset", "Mixture", "Loader", "batches", "permute", "DataError", "render",
           "has_tokenizer"]


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

    def encode_many(self, texts: list[str]) -> list:
        """``encode`` of each text, as numpy arrays (no list of ints: tokenizing a large corpus in bulk)."""
        import numpy as np

        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    @property
    def fingerprint(self) -> str:
        """What identifies this tokenizer's encoding (a token cache's key)."""
        return "byte-v1"

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


def _tokenizer_file(name: str) -> bool:
    """Whether a file of a folder is part of a tokenizer (its vocabulary, merges, special tokens, config, chat
    template), not of a model's weights or config."""
    return (name in _TOKENIZER_FILES or name.startswith(("tokenizer", "special_tokens", "added_tokens", "vocab",
                                                         "chat_template")) or name.endswith((".model", ".tiktoken")))


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a tokenizer's vocabulary (``tokenizer.json``, vocab/merges files, a SentencePiece or
    tiktoken model): a model folder saved with its tokenizer, which its fine-tuning should then use."""
    path = Path(folder)
    return path.is_dir() and any(p.is_file() and (p.name in _TOKENIZER_FILES or p.name.endswith((".tiktoken",
                                                                                                 ".model")))
                                 for p in path.iterdir())


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
        self.path = Path(path)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the folder's tokenizer files (not its weights: a model folder can be the tokenizer folder) and
        of the chat-template choice: what a token cache's key needs (a file edited, or another template, is
        another encoding)."""
        import hashlib

        h = hashlib.sha256(f"hf-v1 chat={self.chat}".encode())
        for f in sorted(p for p in self.path.iterdir() if p.is_file() and _tokenizer_file(p.name)):
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        return h.hexdigest()[:32]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text in one call (a fast tokenizer encodes a batch in its own threads)."""
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        self.tok.save_pretrained(str(folder))

    def chat_segments(self, messages: list[dict], where: str, first: int = 0,
                      answer: bool = False) -> list[tuple[str, bool]]:
        """``messages`` through the chat template as ``(text, trained_on)`` segments: each assistant reply from
        message ``first`` on (with the template's end-of-turn text) trained on, everything before it not.
        ``answer``: end with the template's generation prompt (where the next reply would start)."""
        out, done = [], ""
        for k, m in enumerate(messages + [None]):
            if m is not None and m["role"] != "assistant":
                continue
            prompt = self.tok.apply_chat_template(messages[:k], tokenize=False,
                                                  add_generation_prompt=m is not None or answer)
            full = prompt if m is None else self.tok.apply_chat_template(messages[: k + 1], tokenize=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError(f"{where}: the tokenizer's chat_template does not render a conversation as a prefix "
                                "of its continuation, so answers cannot be told apart: use --chat-template builtin")
            out += [(prompt[len(done):], False), (full[len(prompt):], k >= first)]
            done = full
        return [(t, train) for t, train in out if t]


# --------------------------------------------------------------------------------------------------- samples


FORMATS = ('{"text"}', '{"messages"}', '{"prompt", "completion"}', '{"type": "instruct", "instruct", "output"}',
           '{"type": "conversation", "rounds"}', '{"type": "ref_qa", "reference", "rounds"}')  # (what errors name)


def _need(sample: dict, key: str, where: str, kind: type = str):
    if key not in sample:
        fmt = _kind(sample)
        what = "a prompt-completion" if fmt == "prompt_completion" else f"a '{fmt}'"
        raise DataError(f"{where}: {what} sample needs field '{key}'")
    if not isinstance(sample[key], kind):
        raise DataError(f"{where}: field '{key}' must be a {kind.__name__}, got {type(sample[key]).__name__}")
    return sample[key]


ROLES = {"ask": "user", "user": "user", "ans": "assistant", "assistant": "assistant", "system": "system"}


def _turns(turns: list, where: str, what: str = "message") -> list[dict]:
    """A list of ``{"role", "content"}`` objects (TRL's, axolotl's and torchtune's messages) checked, roles
    normalized."""
    for k, m in enumerate(turns):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {what} {k} must be {{\"role\": \"system\"|\"user\"|\"assistant\", "
                            f"\"content\": text}}, got {json.dumps(m)[:80]}")
    return [{"role": ROLES[m["role"]], "content": m["content"]} for m in turns]


def _chat(sample: dict, where: str) -> list[dict]:
    """The turns of a chat sample as ``[{"role": "system"|"user"|"assistant", "content": text}, ...]``: its
    ``messages`` (:func:`_turns`) or its ``rounds`` (``[role, text]`` pairs, role ``ask``/``user``,
    ``ans``/``assistant`` or ``system``); at least one assistant turn."""
    if "messages" in sample:
        msgs = _turns(_need(sample, "messages", where, list), where)
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


def _prompt_completion(sample: dict, where: str) -> tuple[list[dict], int]:
    """A conversational prompt-completion sample (TRL's: ``{"prompt": [messages], "completion": [messages]}``) as
    one conversation and the index of its first completion message (the completion holds an assistant reply)."""
    prompt = _turns(_need(sample, "prompt", where, list), where, "prompt message")
    completion = _turns(_need(sample, "completion", where, list), where, "completion message")
    if not any(m["role"] == "assistant" for m in completion):
        raise DataError(f"{where}: a completion with no assistant message has nothing to train on")
    return prompt + completion, len(prompt)


def _builtin_chat(msgs: list[dict], first: int = 0) -> list[tuple[str | None, bool]]:
    """funcpar's template: ``System: ...``, ``User: ...`` lines, each reply ``Assistant: `` then the text and EOS,
    trained on from message ``first`` on."""
    out: list[tuple[str | None, bool]] = []
    for k, m in enumerate(msgs):
        if m["role"] == "assistant":
            out += [("Assistant: ", False), (m["content"], k >= first), (None, k >= first)]  # None = EOS
        else:
            out.append((f"{m['role'].capitalize()}: {m['content']}\n", False))
    return out


def _kind(sample: dict) -> str | None:
    """A sample's format: its ``type``, else the one its fields say (None: no format has them)."""
    if sample.get("type") is not None:  # (a datasets row has every column: None where a row has no type)
        return sample["type"]
    for key, kind in (("messages", "conversation"), ("text", "pretrain"), ("prompt", "prompt_completion")):
        if key in sample:
            return kind
    return None


def _templated(sample: dict) -> bool:
    """Whether a sample is a conversation (what a tokenizer's chat template renders)."""
    kind = _kind(sample)
    return kind in ("conversation", "ref_qa") or kind == "prompt_completion" and isinstance(sample.get("prompt"), list)


def render(sample: dict, where: str = "sample") -> list[tuple[str | None, bool]]:
    """A sample as ``[(text or None for EOS, trained_on), ...]``: the prompt template of each format."""
    if not isinstance(sample, dict):
        raise DataError(f"{where}: a sample must be a JSON object, got {type(sample).__name__}")
    kind = _kind(sample)
    if kind is None:
        fields = ", ".join(f"'{k}'" for k in list(sample)[:8]) or "none"
        raise DataError(f"{where}: not a sample format funcpar knows (its fields: {fields}); expected one of: "
                        f"{', '.join(FORMATS)}")
    if kind == "pretrain":
        return [(_need(sample, "text", where), True), (None, True)]
    if kind == "prompt_completion" and isinstance(sample.get("prompt"), list):
        return _builtin_chat(*_prompt_completion(sample, where))
    if kind == "prompt_completion":
        return [(_need(sample, "prompt", where), False), (_need(sample, "completion", where), True), (None, True)]
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


def _messages(sample: dict, where: str) -> tuple[list[dict], int]:
    """A conversation, ref_qa or conversational prompt-completion sample as chat messages (the reference as a
    system message), and the index of the first message whose assistant replies are trained on."""
    if _kind(sample) == "prompt_completion":
        return _prompt_completion(sample, where)
    msgs = _chat(sample, where)
    if _kind(sample) == "ref_qa":
        msgs.insert(0, {"role": "system", "content": f"Reference: {_need(sample, 'reference', where)}"})
    return msgs, 0


def encode(sample: dict, tok, where: str = "sample") -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of one sample."""
    ids: list[int] = []
    mask: list[int] = []
    if getattr(tok, "chat", False) and isinstance(sample, dict) and _templated(sample):
        msgs, first = _messages(sample, where)
        segments = tok.chat_segments(msgs, where, first)
    else:
        segments = render(sample, where)
    for text, train in segments:
        piece = [tok.eos_id] if text is None else tok.encode(text)
        ids += piece
        mask += [int(train)] * len(piece)
    return ids, mask


PROMPTS = '{"prompt": text}, {"prompt": [messages]} or {"messages": [messages]}'  # (what prompt_text reads)


def prompt_text(row: dict, tok=None, where: str = "prompt") -> str:
    """The text a model reads before it answers a prompt ``row``: ``{"prompt": text}`` as it is; a conversation so
    far (``{"messages": [...]}``, or TRL's conversational ``{"prompt": [...]}``) through the template training
    renders it with (``tok``'s chat template where :func:`encode` uses it, funcpar's builtin one otherwise, also
    without ``tok``), up to where the assistant's reply starts. An earlier reply's EOS is ``tok``'s EOS token's
    text (none for the byte tokenizer, whose EOS no text encodes to)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a prompt must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        msgs = _turns(_need(row, "messages", where, list), where)
    elif isinstance(row.get("prompt"), list):
        msgs = _turns(row["prompt"], where, "prompt message")
    elif "prompt" in row:
        return _need(row, "prompt", where)
    else:
        fields = ", ".join(f"'{k}'" for k in list(row)[:8]) or "none"
        raise DataError(f"{where}: not a prompt (its fields: {fields}); expected {PROMPTS}")
    if not msgs:
        raise DataError(f"{where}: a conversation with no messages: nothing to prompt with")
    if getattr(tok, "chat", False):
        return "".join(t for t, _ in tok.chat_segments(msgs, where, answer=True))
    eos = tok.decode([tok.eos_id]) if tok is not None else ""
    return "".join(eos if t is None else t for t, _ in _builtin_chat(msgs) + [("Assistant: ", False)])


def is_hf_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder the ``datasets`` package saved (``save_to_disk``: Arrow files beside
    ``dataset_info.json`` and ``state.json``, or a ``DatasetDict``'s ``dataset_dict.json`` and one folder a split)."""
    return path.is_dir() and ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def data_files(path: str | os.PathLike) -> list[Path]:
    """The files a data path names: the file itself, a folder's ``.jsonl``/``.json``/``.txt`` files (sorted,
    recursively), or every file of a ``datasets`` folder."""
    path = Path(path)
    if is_hf_dataset(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".txt") and p.is_file())
        if not files:
            raise DataError(f"{path}: no .jsonl, .json or .txt files")
        return files
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    return [path]


def _text_lines(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """``(line number, line, None)`` of a UTF-8 file, read a line at a time; ``(line number, "", why)`` of a line
    that is not UTF-8 (its first bad byte named by column)."""
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                yield n, raw.decode("utf-8"), None
            except UnicodeDecodeError as e:
                yield n, "", (f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                              f"save the file as UTF-8")


def _file_rows(f: Path) -> Iterator[tuple[Any, str, str | None]]:
    """``(sample, "file:line", None)`` of each sample of a ``.txt`` or JSONL file, ``(None, "file:line", why)`` of
    each line that cannot be one (not UTF-8, not JSON)."""
    if f.suffix == ".txt":
        doc: list[str] = []
        first = 0
        for n, line, why in itertools.chain(_text_lines(f), [(0, "", None)]):  # (a blank line after the last doc)
            if why:
                yield None, f"{f}:{n}", why
            elif line.strip("\r\n"):
                first = first or n
                doc.append(line)
            elif doc:
                yield {"type": "pretrain", "text": "".join(doc).strip("\n")}, f"{f}:{first}", None
                doc, first = [], 0
        return
    for n, line, why in _text_lines(f):
        if why:
            yield None, f"{f}:{n}", why
        elif line.strip():
            try:
                sample = json.loads(line)
            except json.JSONDecodeError as e:
                yield None, f"{f}:{n}", f"{f}:{n}: not valid JSON ({e.msg} at column {e.colno})"
                continue
            yield sample, f"{f}:{n}", None


SHOWN_ERRORS = 20  # malformed samples a data error lists (then how many more)


def _malformed(bad: list[str], count: int) -> DataError:
    """The error for ``count`` malformed samples, of which ``bad`` are the first (each "file:line: why")."""
    if count == 1:
        return DataError(bad[0])
    more = f"\nand {count - len(bad)} more" if count > len(bad) else ""
    return DataError(f"{count} malformed samples (fix them all, then run again):\n" + "\n".join(bad) + more)


def iter_samples(path: str | os.PathLike) -> Iterator[tuple[dict, str]]:
    """``(sample, "file:line")`` of a ``.jsonl``/``.json`` file (a JSON object per line), a ``.txt`` file
    (documents separated by blank lines, each a ``pretrain`` sample) or a folder of them, read a line at a time so
    that a corpus larger than memory streams through; or the rows of a ``datasets`` folder (``"folder[row]"``), read
    with that package (where it is installed) as it streams them from its Arrow files.

    Each sample is checked (:func:`render`). Once one is malformed none is yielded any more, the rest are only
    checked, and at the end one :class:`DataError` lists the first :data:`SHOWN_ERRORS` and counts the others."""
    if is_hf_dataset(Path(path)):
        rows: Iterator[tuple[Any, str, str | None]] = _hf_dataset_rows(Path(path))
    else:
        rows = (row for f in data_files(path) for row in _file_rows(f))
    bad: list[str] = []
    count = 0
    for sample, where, why in rows:
        if why is None:
            try:
                render(sample, where)
            except DataError as e:
                why = str(e)
        if why is not None:
            count += 1
            if len(bad) < SHOWN_ERRORS:
                bad.append(why)
        elif not count:
            yield sample, where
    if count:
        raise _malformed(bad, count)


def _hf_dataset_rows(path: Path) -> Iterator[tuple[dict, str, None]]:
    """The rows of a ``datasets`` folder as samples: a ``Dataset``'s, or a ``DatasetDict``'s ``train`` split."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a folder the datasets package saved: reading it needs that package (pip install "
                        f"datasets), or export it to JSONL (ds.to_json('data.jsonl'))") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, dict):  # a DatasetDict (a dict of split -> Dataset)
        if "train" not in ds:
            raise DataError(f"{path} holds the splits {', '.join(sorted(ds))} and no 'train': give the folder of the "
                            f"split to train on ({path}/<split>)")
        ds, path = ds["train"], path / "train"
    for k, row in enumerate(ds):
        yield row, f"{path}[{k}]", None


def load_samples(path: str | os.PathLike) -> list[tuple[dict, str]]:
    """``[(sample, "file:line"), ...]`` of a data file or folder (:func:`iter_samples`), all in memory."""
    return list(iter_samples(path))


# --------------------------------------------------------------------------------------------------- streams


@dataclass
class Stream:
    """A data source tokenized: every sample's ids end to end (``ids``, a 1-D numpy array in memory, or a token
    cache's file read on demand: :class:`funcpar.tokencache.FileArray`), their loss mask (``mask``, uint8; None when
    every token is trained on), and where each sample starts (``starts``: samples + 1 offsets). Rows are cut from it
    on demand, so a stream on disk is never read whole."""

    ids: Any
    mask: Any
    starts: Any
    max_id: int

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def samples(self) -> int:
        return int(self.starts.shape[0]) - 1


class StreamWriter:
    """Builds a :class:`Stream` a sample at a time, in chunks of about :attr:`CHUNK` tokens: ``sink(name, array)``
    receives each chunk of ``ids`` and ``mask`` and at the end the ``starts`` (a token cache's files); without a
    sink the chunks stay in memory. Memory is a chunk whatever the corpus."""

    CHUNK = 1 << 22

    def __init__(self, dtype, sink=None):
        import numpy as np

        self.np, self.dtype, self.sink = np, dtype, sink
        self.parts: dict[str, list] = {"ids": [], "mask": []}
        self.done: dict[str, list] = {"ids": [], "mask": []}
        self.buffered = self.tokens = self.max_id = 0
        self.starts = [0]
        self.all_trained = True

    def add(self, ids, mask) -> None:
        """One sample: its ids and loss mask (lists or arrays)."""
        np = self.np
        ids, mask = np.asarray(ids), np.asarray(mask, dtype=np.uint8)
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
        self.all_trained = self.all_trained and bool(mask.all())
        self.parts["ids"].append(ids.astype(self.dtype, copy=False))
        self.parts["mask"].append(mask)
        self.tokens += len(ids)
        self.buffered += len(ids)
        self.starts.append(self.tokens)
        if self.buffered >= self.CHUNK:
            self._flush()

    def _flush(self) -> None:
        for name, parts in self.parts.items():
            if not parts:
                continue
            chunk = self.np.concatenate(parts)
            if self.sink:
                self.sink(name, chunk)
            elif name == "ids" or not self.all_trained:  # (in memory: no mask while every token is trained on)
                if name == "mask" and not self.done["mask"]:
                    held = sum(len(c) for c in self.done["ids"]) - (len(chunk) if self.parts["ids"] else 0)
                    self.done["mask"].append(self.np.ones(held, dtype=self.np.uint8))
                self.done[name].append(chunk)
        self.parts, self.buffered = {"ids": [], "mask": []}, 0

    def finish(self) -> Stream | dict:
        """The stream (in memory); with a sink, once the last chunks and the starts went to it, what its files hold
        (``tokens``, ``samples``, ``max_id``, ``all_trained``, ``dtype``)."""
        np = self.np
        self._flush()
        starts = np.asarray(self.starts, dtype=np.int64)
        if self.sink:
            self.sink("starts", starts)
            return {"tokens": self.tokens, "samples": len(starts) - 1, "max_id": self.max_id,
                    "all_trained": self.all_trained, "dtype": np.dtype(self.dtype).name}
        ids = np.concatenate(self.done["ids"]) if self.done["ids"] else np.zeros(0, self.dtype)
        mask = None if self.all_trained else np.concatenate(self.done["mask"])
        return Stream(ids, mask, starts, self.max_id)


def id_dtype(vocab_size: int):
    """The narrowest integer type that holds every id of a ``vocab_size`` vocabulary (uint16 for most)."""
    import numpy as np

    return np.uint16 if vocab_size <= 1 << 16 else np.int32


BULK = 1024  # plain-text samples encoded in one call of a tokenizer's encode_many


def tokenize(samples, tok, sink=None) -> Stream | dict:
    """``samples`` (``(sample, where)`` pairs; an iterator streams) as a :class:`Stream` (``sink``: see
    :class:`StreamWriter`). Plain-text samples go to a tokenizer's ``encode_many`` :data:`BULK` at a time where it
    has one (the byte tokenizer without a list of ints, an HF fast tokenizer in its own threads); the rest one by
    one, in order."""
    import numpy as np

    w = StreamWriter(id_dtype(tok.vocab_size), sink)
    many = getattr(tok, "encode_many", None)
    texts: list[str] = []

    def flush():
        for ids in many(texts):
            ids = np.append(np.asarray(ids, dtype=np.int64), tok.eos_id)
            w.add(ids, np.ones(len(ids), dtype=np.uint8))
        texts.clear()

    for sample, where in samples:
        if many is not None and isinstance(sample, dict) and _kind(sample) == "pretrain":
            texts.append(_need(sample, "text", where))
            if len(texts) >= BULK:
                flush()
            continue
        if texts:
            flush()
        w.add(*encode(sample, tok, where))
    if texts:
        flush()
    return w.finish()


# --------------------------------------------------------------------------------------------------- order


def _mix(*xs: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): the keys of :func:`permute`."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & (1 << 64) - 1)) * 0xBF58476D1CE4E5B9 & (1 << 64) - 1
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & (1 << 64) - 1
    return h ^ (h >> 29)


def permute(i: torch.Tensor, n: int, key: int) -> torch.Tensor:
    """Where positions ``i`` go in a pseudo-random ordering of ``range(n)`` chosen by ``key``: a keyed bijection
    (a four-round Feistel network on the next even power of two, walked back into range), so an epoch's order over
    any number of rows costs memory only for the positions asked."""
    x = i.to(torch.int64).clone()
    if n <= 1:
        return x
    half = ((n - 1).bit_length() + 1) // 2
    low = (1 << half) - 1
    keys = [_mix(key, r) & low for r in range(4)]
    out = torch.ones_like(x, dtype=torch.bool)
    while bool(out.any()):  # cycle walking: a value beyond n goes round again; every cycle holds one below n
        y = x[out]
        left, right = y >> half, y & low
        for k in keys:
            f = (right ^ k) * 0x45D9F3B & 0xFFFFFFFF
            f = (f ^ (f >> 16)) * 0x45D9F3B & 0xFFFFFFFF
            left, right = right, left ^ ((f ^ (f >> 16)) & low)
        x[out] = left << half | right
        out = x >= n
    return x


# --------------------------------------------------------------------------------------------------- dataset


HELD_OUT_MAX = 2000  # held-out rows per data source at most: an evaluation of a large corpus stays seconds


class Dataset:
    """Rows of ``seq_len`` tokens cut from a :class:`Stream`: packed (the stream cut into consecutive rows; a
    sample longer than a row continues into the next) or one sample per row (truncated, or padded with positions not
    trained on). ``part`` ``(lo, hi, key)`` keeps positions ``lo..hi`` of the rows' ordering under ``key`` (a
    train or held-out split) without holding an index. :meth:`take` reads the rows asked for and nothing else."""

    def __init__(self, stream: Stream, seq_len: int, pack: bool = True, pad_id: int = 0, part=None,
                 documents: bool = False):
        self.stream, self.seq_len, self.pack, self.pad_id, self.part = stream, seq_len, pack, pad_id, part
        self.documents = documents and pack  # (one sample per row is one document already)
        self.rows = stream.tokens // seq_len if pack else stream.samples
        if not self.rows:
            raise DataError(f"the data holds {stream.tokens} tokens, not enough for one row of seq_len={seq_len}")
        self.samples, self.tokens, self.max_id = stream.samples, stream.tokens, stream.max_id

    @classmethod
    def from_samples(cls, samples, tok, seq_len: int, pack: bool = True, documents: bool = False) -> "Dataset":
        """The rows of ``samples`` (``(sample, where)`` pairs) tokenized in memory (``documents``: see
        :meth:`positions`)."""
        return cls(tokenize(samples, tok), seq_len, pack, tok.pad_id, documents=documents)

    @classmethod
    def from_rows(cls, ids: torch.Tensor, mask: torch.Tensor | None = None) -> "Dataset":
        """A dataset whose rows are ``ids`` (N, T) (and ``mask``, all trained on if None) as given."""
        import numpy as np

        n, t = ids.shape
        m = None if mask is None else mask.reshape(-1).numpy().astype(np.uint8)
        stream = Stream(ids.reshape(-1).numpy().copy(), m, np.arange(0, n * t + 1, t), int(ids.max()) if n else 0)
        return cls(stream, t, pack=True)

    def __len__(self) -> int:
        return self.part[1] - self.part[0] if self.part else self.rows

    @functools.cached_property
    def truncated(self) -> int:
        """Samples longer than a row (cut short when rows are one sample each; continued when packed)."""
        import numpy as np

        if self.pack:
            return 0
        s, n = self.stream.starts, 0
        for a in range(0, len(s) - 1, 1 << 20):  # (in chunks: the starts may be a long file)
            block = np.asarray(s[a : a + (1 << 20) + 1])
            n += int((np.diff(block) > self.seq_len).sum())
        return n

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, mask)`` (k, seq_len) of rows ``index`` (positions in this dataset, 0..len-1)."""
        import numpy as np

        rows, t, st = self._stream_rows(index), self.seq_len, self.stream
        if self.pack:  # (a row a read: from a token cache's file, only those bytes)
            ids = np.stack([st.ids[r * t : (r + 1) * t] for r in rows]) if len(rows) else np.zeros((0, t), np.int64)
            mask = (np.ones(ids.shape, np.bool_) if st.mask is None or not len(rows) else
                    np.stack([st.mask[r * t : (r + 1) * t] for r in rows]))
        else:
            ids = np.full((len(rows), t), self.pad_id, dtype=np.int64)
            mask = np.zeros((len(rows), t), dtype=np.bool_)
            for k, r in enumerate(rows):
                a = int(st.starts[r])
                b = min(int(st.starts[r + 1]), a + t)
                ids[k, : b - a] = st.ids[a:b]
                mask[k, : b - a] = True if st.mask is None else st.mask[a:b]
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.bool_))

    def _stream_rows(self, index: torch.Tensor):
        """The stream's rows (numpy) of positions ``index`` in this dataset (a split's are keyed positions)."""
        index = index.to(torch.int64)
        if self.part:
            index = permute(index + self.part[0], self.rows, self.part[2])
        return index.numpy()

    def positions(self, index: torch.Tensor) -> torch.Tensor | None:
        """With ``documents`` (packed rows only), each token's position in its own sample, (k, seq_len): 0 where a
        sample starts and at the row's start (a sample continued from the row before starts again there), so
        that each sample attends only to itself (:mod:`funcpar.documents`); None otherwise. Only the rows'
        sample starts are read (a binary search of ``starts``)."""
        import bisect

        import numpy as np

        if not self.documents:
            return None
        rows, t, starts = self._stream_rows(index), self.seq_len, self.stream.starts
        out = np.empty((len(rows), t), dtype=np.int64)
        col = np.arange(t)
        for k, r in enumerate(rows):
            lo = int(r) * t
            begin = np.zeros(t, dtype=np.int64)
            i = bisect.bisect_right(starts, lo)  # the first sample starting after the row's first token
            while i < len(starts) and int(starts[i]) < lo + t:
                begin[int(starts[i]) - lo] = int(starts[i]) - lo
                i += 1
            out[k] = col - np.maximum.accumulate(begin)
        return torch.from_numpy(out)

    @property
    def ids(self) -> torch.Tensor:
        """Every row's ids (N, seq_len), read whole: for small data (tests, examples)."""
        return self.take(torch.arange(len(self)))[0]

    @property
    def mask(self) -> torch.Tensor:
        """Every row's loss mask (N, seq_len), read whole."""
        return self.take(torch.arange(len(self)))[1]

    def split(self, eval_fraction: float, seed: int = 0) -> tuple["Dataset", "Dataset"]:
        """A deterministic ``(train, held-out)`` split of the rows: ``eval_fraction`` of them (at least one, at most
        :data:`HELD_OUT_MAX`) held out, chosen by ``seed``."""
        if self.part:
            raise DataError("a split of a split: split the whole dataset once")
        n_eval = min(max(1, int(self.rows * eval_fraction)), HELD_OUT_MAX, self.rows - 1) if eval_fraction > 0 else 0
        key = _mix(seed, 0x5EED)
        part = functools.partial(Dataset, self.stream, self.seq_len, self.pack, self.pad_id, documents=self.documents)
        return part((n_eval, self.rows, key)), part((0, n_eval, key))


def as_batch(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Rows and their loss mask as a batch: ``labels`` are the ids, ``-100`` where not trained on. With
    ``positions`` (packed documents) also ``position_ids``, and a sample's first token is no target (nothing before
    it in its sample predicts it, as when the sample runs alone)."""
    if positions is None:
        return {"input_ids": ids, "labels": ids.masked_fill(~mask, -100)}
    return {"input_ids": ids, "labels": ids.masked_fill(~mask | (positions == 0), -100), "position_ids": positions}


class Mixture:
    """Data sources trained on together: each global batch draws from source ``s`` its share ``weights[s]`` of the
    rows (exactly, over the batches so far), each source in its own per-epoch order. One source is the plain case;
    none, an empty held-out set."""

    def __init__(self, parts: list[Dataset], weights: list[float] | None = None, names: list[str] | None = None):
        from fractions import Fraction

        weights = [1.0] * len(parts) if weights is None else weights
        if len(weights) != len(parts) or any(not (isinstance(w, (int, float)) and 0 < w < math.inf) for w in weights):
            raise DataError(f"data weights {weights}: one positive, finite weight per source")
        raw = [Fraction(str(w)) for w in weights]
        self.parts, self.names = parts, names or [f"source {k}" for k in range(len(parts))]
        empty = [n for n, p in zip(self.names, parts, strict=True) if not len(p)]
        if empty:
            raise DataError(f"data source {empty[0]} leaves no rows to train on (too little data for one row of "
                            f"--seq-len beside its held-out rows): give it more data, or a shorter --seq-len")
        if len({p.documents for p in parts}) > 1:
            raise DataError("data sources mixed with and without packed documents (position_ids): build every "
                            "source's Dataset with the same documents=")
        self.shares = [w / sum(raw) for w in raw]
        self.weights = [float(w) for w in self.shares]
        self.main = max(range(len(parts)), key=lambda s: self.shares[s], default=0)  # takes what rounding leaves

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def samples(self) -> int:
        return sum(p.samples for p in self.parts)

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.parts)

    @property
    def truncated(self) -> int:
        return sum(p.truncated for p in self.parts)

    @property
    def max_id(self) -> int:
        return max((p.max_id for p in self.parts), default=0)

    def take_range(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Rows ``lo..hi`` of the sources one after another, as a batch (an evaluation's pass, in order)."""
        got, start = [], 0
        for p in self.parts:
            a, b = max(lo - start, 0), min(hi - start, len(p))
            if a < b:
                got.append((*p.take(torch.arange(a, b)), p.positions(torch.arange(a, b))))
            start += len(p)
        pos = [g[2] for g in got]
        return as_batch(torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got]),
                        torch.cat(pos) if pos and pos[0] is not None else None)

    def taken(self, s: int, rows: int) -> int:
        """How many of the first ``rows`` rows drawn come from source ``s`` (floor of its share; the main source
        takes the rest)."""
        if s != self.main:
            share = self.shares[s]
            return rows * share.numerator // share.denominator
        return rows - sum(self.taken(o, rows) for o in range(len(self.parts)) if o != self.main)

    def check_batch(self, global_batch: int) -> None:
        """Every source's rows per batch never negative: the main source's share of a batch covers the others'
        rounding up."""
        def fits(g: int) -> bool:
            return sum(-(-g * w.numerator // w.denominator) for s, w in enumerate(self.shares) if s != self.main) <= g

        if not fits(global_batch):
            least = next(g for g in range(global_batch, 1 << 20) if fits(g))
            raise DataError(f"--global-batch {global_batch} is too small to mix {len(self.parts)} sources with "
                            f"weights {', '.join(f'{w:g}' for w in self.weights)}: use {least} or more")


class Loader:
    """Endless global batches of a :class:`Dataset` or :class:`Mixture`; each rank yields its dp block.

    Row ``i`` drawn from a source of ``n`` rows is row ``permute(i % n, n, key(seed, source, i // n))``: a new
    order every epoch, batches running on across epochs, nothing held in memory but the batch. ``state_dict()`` /
    ``load_state_dict()`` carry the position (batches served), so a resumed run continues the exact order, which
    depends only on ``seed``, the global batch and the weights, not on the mesh.
    """

    def __init__(self, data, mesh: Mesh, global_batch: int, seed: int = 0, shuffle: bool = True):
        dp = mesh.axis_size("dp")
        if global_batch % dp:
            raise DataError(f"global_batch={global_batch} is not divisible by dp={dp}")
        data = data if isinstance(data, Mixture) else Mixture([data])
        if len(data) < global_batch:
            raise DataError(f"the data has {len(data)} rows, fewer than one global batch of {global_batch}")
        data.check_batch(global_batch)
        self.data, self.mesh, self.global_batch, self.seed, self.shuffle = data, mesh, global_batch, seed, shuffle
        self.position = 0

    def _drawn(self, s: int, first: int, stop: int) -> torch.Tensor:
        """The rows (of source ``s``) of its draws ``first..stop``."""
        n, i = len(self.data.parts[s]), torch.arange(first, stop)
        if self.shuffle and stop > first:
            for epoch in range(first // n, (stop - 1) // n + 1):
                sel = i // n == epoch
                i[sel] = permute(i[sel] % n, n, _mix(self.seed, s, epoch))
        return i % n

    def batch_index(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(source, row)`` of each row of global batch ``position``, in the batch's order: computed, nothing read."""
        gb, mix = self.global_batch, self.data
        picks = [(s, self._drawn(s, mix.taken(s, gb * position), mix.taken(s, gb * (position + 1))))
                 for s in range(len(mix.parts))]
        src = torch.cat([torch.full((len(r),), s, dtype=torch.int64) for s, r in picks])
        row = torch.cat([r for _, r in picks])
        if len(picks) > 1 and self.shuffle:  # the sources interleaved, so dp ranks each see the mixture
            order = permute(torch.arange(gb), gb, _mix(self.seed, position, 0xB1E))
            src, row = src[order], row[order]
        return src, row

    def _read(self, src: torch.Tensor, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows ``(src, row)`` as a batch."""
        ids = torch.empty(len(row), self.data.parts[0].seq_len, dtype=torch.int64)
        mask = torch.empty(ids.shape, dtype=torch.bool)
        pos = torch.empty(ids.shape, dtype=torch.int64) if self.data.parts[0].documents else None
        for s in torch.unique(src).tolist():
            sel = src == s
            ids[sel], mask[sel] = self.data.parts[s].take(row[sel])
            if pos is not None:
                pos[sel] = self.data.parts[s].positions(row[sel])
        return as_batch(ids, mask, pos)

    def global_batch_at(self, position: int) -> dict[str, torch.Tensor]:
        """Global batch ``position``, every rank's block of it."""
        return self._read(*self.batch_index(position))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        """This rank's dp block of the next global batch: only its rows are read."""
        src, row = self.batch_index(self.position)
        self.position += 1
        dp, c = self.mesh.axis_size("dp"), self.mesh.coord("dp")
        block = len(row) // dp
        b = self._read(src[c * block : (c + 1) * block], row[c * block : (c + 1) * block])
        return {k: v.to(self.mesh.device) for k, v in b.items()}

    def state_dict(self) -> dict[str, Any]:
        out = {"position": self.position, "seed": self.seed, "global_batch": self.global_batch}
        return out if len(self.data.parts) == 1 else {**out, "weights": self.data.weights}

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
        saved = state.get("weights", [1.0])
        now = self.state_dict().get("weights", [1.0])
        if len(saved) != len(now) or any(abs(a - b) > 1e-9 for a, b in zip(saved, now, strict=True)):
            raise DataError(f"cannot resume data order: saved with data weights {saved}, now {now} (the rows each "
                            f"source has served follow from the weights)")
        self.position = position


def batches(dataset, mesh: Mesh, global_batch: int, seed: int = 0) -> Loader:
    """This rank's batches of ``dataset`` (see :class:`Loader`)."""
    return Loader(dataset, mesh, global_batch, seed)
