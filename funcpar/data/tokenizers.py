"""Tokenizers: funcpar's byte tokenizer and a local Hugging Face tokenizer folder."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path




class DataError(ValueError):
    """A malformed sample or data file (the message names the file and line)."""

    __module__ = "funcpar.data"  # (public as funcpar.data.DataError, where a traceback names it)


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
