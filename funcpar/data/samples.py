"""Samples: the formats a data file's lines take, what each trains on, the files a path names."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any, Iterator


from funcpar.data.tokenizers import DataError


FORMATS = ('{"text"}', '{"messages"}', '{"prompt", "completion"}', '{"type": "instruct", "instruct", "output"}',
           '{"type": "conversation", "rounds"}', '{"type": "ref_qa", "reference", "rounds"}')  # (what errors name)


def need_field(sample: dict, key: str, where: str, kind: type = str):
    if key not in sample:
        fmt = sample_kind(sample)
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
        msgs = _turns(need_field(sample, "messages", where, list), where)
    else:
        msgs = []
        for k, r in enumerate(need_field(sample, "rounds", where, list)):
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
    prompt = _turns(need_field(sample, "prompt", where, list), where, "prompt message")
    completion = _turns(need_field(sample, "completion", where, list), where, "completion message")
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


def sample_kind(sample: dict) -> str | None:
    """A sample's format: its ``type``, else the one its fields say (None: no format has them)."""
    if sample.get("type") is not None:  # (a datasets row has every column: None where a row has no type)
        return sample["type"]
    for key, kind in (("messages", "conversation"), ("text", "pretrain"), ("prompt", "prompt_completion")):
        if key in sample:
            return kind
    return None


def _templated(sample: dict) -> bool:
    """Whether a sample is a conversation (what a tokenizer's chat template renders)."""
    kind = sample_kind(sample)
    return kind in ("conversation", "ref_qa") or kind == "prompt_completion" and isinstance(sample.get("prompt"), list)


def render(sample: dict, where: str = "sample") -> list[tuple[str | None, bool]]:
    """A sample as ``[(text or None for EOS, trained_on), ...]``: the prompt template of each format."""
    if not isinstance(sample, dict):
        raise DataError(f"{where}: a sample must be a JSON object, got {type(sample).__name__}")
    kind = sample_kind(sample)
    if kind is None:
        fields = ", ".join(f"'{k}'" for k in list(sample)[:8]) or "none"
        raise DataError(f"{where}: not a sample format funcpar knows (its fields: {fields}); expected one of: "
                        f"{', '.join(FORMATS)}")
    if kind == "pretrain":
        return [(need_field(sample, "text", where), True), (None, True)]
    if kind == "prompt_completion" and isinstance(sample.get("prompt"), list):
        return _builtin_chat(*_prompt_completion(sample, where))
    if kind == "prompt_completion":
        return [(need_field(sample, "prompt", where), False), (need_field(sample, "completion", where), True),
                (None, True)]
    if kind == "instruct":
        instruct = need_field(sample, "instruct", where)
        inp = sample.get("input")
        if inp is not None and not isinstance(inp, str):
            raise DataError(f"{where}: field 'input' must be a str, got {type(inp).__name__}")
        prompt = f"{instruct}\n{inp}\n" if inp else f"{instruct}\n"
        return [(prompt, False), (need_field(sample, "output", where), True), (None, True)]
    if kind == "conversation":
        return _builtin_chat(_chat(sample, where))
    if kind == "ref_qa":
        return [(f"Reference: {need_field(sample, 'reference', where)}\n", False)] + _builtin_chat(_chat(sample, where))
    raise DataError(f"{where}: unknown sample type '{kind}' (known: pretrain, instruct, conversation, ref_qa)")


def _messages(sample: dict, where: str) -> tuple[list[dict], int]:
    """A conversation, ref_qa or conversational prompt-completion sample as chat messages (the reference as a
    system message), and the index of the first message whose assistant replies are trained on."""
    if sample_kind(sample) == "prompt_completion":
        return _prompt_completion(sample, where)
    msgs = _chat(sample, where)
    if sample_kind(sample) == "ref_qa":
        msgs.insert(0, {"role": "system", "content": f"Reference: {need_field(sample, 'reference', where)}"})
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
        msgs = _turns(need_field(row, "messages", where, list), where)
    elif isinstance(row.get("prompt"), list):
        msgs = _turns(row["prompt"], where, "prompt message")
    elif "prompt" in row:
        return need_field(row, "prompt", where)
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
