"""Text generation with a trained model: greedy decoding, samples of a run in training, and the answer check
``funcpar train`` runs at the end.

:func:`greedy` decodes with any ``logits_fn(ids) -> logits``; :func:`sample_on_mesh` decodes with the sharded
model where it trains (every rank in step, the vocabulary's argmax taken over tp); :func:`show_arithmetic` loads
an exported transformers folder, greedy-decodes the built-in arithmetic task with funcpar's own forward, and, where
transformers is installed, checks that transformers loads the folder and generates from it too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["greedy", "sample_on_mesh", "read_prompts", "show_arithmetic"]


def greedy(logits_fn: Callable[[torch.Tensor], torch.Tensor], prompts: list[list[int]], eos: int,
           max_new: int, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[list[int]]:
    """Greedy decoding of each prompt (grouped by length; no KV cache: the models here are small).

    ``argmax(last_logits) -> ids``: how the next token is picked (default ``argmax(-1)``; over tp, the sharded
    vocabulary's). Returns the new tokens of each prompt, without the ``eos`` that ended it.
    """
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for idx in by_len.values():
            _greedy_group(logits_fn, [prompts[i] for i in idx], [out[i] for i in idx], eos, max_new,
                          argmax or (lambda x: x.argmax(-1)))
    return out


def _greedy_group(logits_fn, prompts: list[list[int]], outs: list[list[int]], eos: int, max_new: int,
                  argmax) -> None:
    """Decode prompts of one length together, appending each one's new tokens to its list in ``outs``."""
    ids = torch.tensor(prompts)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(max_new):
        nxt = argmax(logits_fn(ids)[:, -1]).cpu()
        for k, out in enumerate(outs):
            if not done[k]:
                if int(nxt[k]) == eos:
                    done[k] = True
                else:
                    out.append(int(nxt[k]))
        ids = torch.cat([ids, nxt[:, None]], 1)
        if done.all():
            break


def vocab_argmax(logits: torch.Tensor, mesh, axis: str = "tp") -> torch.Tensor:
    """The index of each row's largest logit over the whole vocabulary, from this rank's block of it (``axis``'s
    ranks hold consecutive blocks, maybe of unequal widths): every rank gets the same answer, the lowest index among
    equal maxima, as ``argmax`` over the whole row gives."""
    from funcpar.parallel import collectives as C

    if mesh.axis_size(axis) == 1:
        return logits.argmax(-1)
    width = torch.tensor([float(logits.shape[-1])], dtype=torch.float64, device=logits.device)
    widths = C.all_gather_nograd(width, mesh, axis, 0)
    offset = widths[: mesh.coord(axis)].sum()
    if logits.shape[-1]:
        vals, idx = logits.double().max(-1)
    else:  # (a rank whose block is all padding: nothing to offer)
        vals = torch.full(logits.shape[:-1], -math.inf, dtype=torch.float64, device=logits.device)
        idx = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    both = C.all_gather_nograd(torch.stack([vals, idx.double() + offset])[None], mesh, axis, 0)  # (tp, 2, B)
    best = both[:, 0].argmax(0)  # (the first rank with the maximum: the lowest global index)
    return both[:, 1].gather(0, best[None])[0].long()


def read_prompts(path: str | Path, tok=None) -> list[str]:
    """The prompts of ``--sample-prompts``, as the text the model reads: a ``.txt`` file's lines (``\\n`` for a
    newline), or a ``.jsonl`` file's objects: ``{"prompt": text}`` (as given), ``{"messages": [...]}`` (the
    conversation so far) or ``{"prompt": [messages]}`` (TRL's conversational prompt), the conversations through the
    chat template training renders them with for ``tok`` up to where the reply starts
    (:func:`funcpar.data.prompt_text`; funcpar's builtin template without ``tok``). A ``.txt`` line that is a JSON
    object is one of these too."""
    import json

    from funcpar.data.samples import PROMPTS, prompt_text

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--sample-prompts {path}: no such file")
    out = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # (a binary file, or another encoding)
        raise ValueError(f"--sample-prompts {path}: not UTF-8 text (byte {e.start}: {e.reason}): give a .txt or "
                         f".jsonl file of prompts") from None
    for n, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln) if path.suffix == ".jsonl" or ln.lstrip().startswith("{") else ln
        except ValueError:
            row = None if path.suffix == ".jsonl" else ln
        if path.suffix == ".jsonl" and not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object: {PROMPTS}")
        out.append(prompt_text(row, tok, f"{path}:{n}") if isinstance(row, dict) else ln.replace("\\n", "\n"))
    return out


def sample_on_mesh(model, params, cfg, mesh, tok, prompts: list[str], max_new: int) -> list[str]:
    """Greedy continuations of ``prompts`` by the model as it trains: every rank decodes with its shards (collective
    over tp; not for pp or cp meshes) and gets the same text."""
    ids = [tok.encode(p) for p in prompts]
    new = greedy(lambda x: model.forward(params, x.to(mesh.device), cfg, mesh), ids, tok.eos_id, max_new,
                 argmax=lambda logits: vocab_argmax(logits, mesh))
    return [tok.decode(n) for n in new]


def show_arithmetic(folder: str | Path, model: Any) -> None:
    """Greedy answers of the exported model to the built-in task: a few shown, accuracy over all facts.

    ``model`` is a :class:`funcpar.ModelSpec` (or anything :func:`funcpar.get_model` accepts); the folder's own
    config is loaded with its parameters.
    """
    import funcpar as fp
    from funcpar.assets import arithmetic_facts
    from funcpar.data import ByteTokenizer

    model = fp.get_model(model)
    tok = ByteTokenizer()
    params, cfg = fp.hf.load(folder, model)
    facts = arithmetic_facts()
    prompts = [tok.encode(f"{a}+{b}=\n") for a, b in facts]
    answers = greedy(lambda ids: model.forward(params, ids, cfg, fp.Mesh()), prompts, tok.eos_id, max_new=4)
    got = [tok.decode(a) for a in answers]
    correct = sum(g == str(a + b) for g, (a, b) in zip(got, facts, strict=True))
    shown = ", ".join(f"{a}+{b}={g}" for g, (a, b) in list(zip(got, facts, strict=True))[::13][:8])
    print(f"greedy answers of the exported model: {shown}; {correct}/{len(facts)} correct", flush=True)
    _show_transformers(Path(folder), tok)


def _show_transformers(folder: Path, tok) -> None:
    """transformers loads the exported folder and greedy-generates an answer (skipped without transformers)."""
    try:
        import transformers

        hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        ids = torch.tensor([tok.encode("7+5=\n")])
        gen = hf_model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=tok.eos_id,
                                pad_token_id=tok.pad_id)
        print(f"transformers loads {folder} and generates: 7+5= -> {tok.decode(gen[0, ids.shape[1]:].tolist())!r}",
              flush=True)
    except ImportError:
        pass
