"""Text generation with a trained model: greedy decoding, and the answer check ``funcpar train`` runs at the end.

:func:`greedy` decodes with any ``logits_fn(ids) -> logits``; :func:`show_arithmetic` loads an exported
transformers folder, greedy-decodes the built-in arithmetic task with funcpar's own forward, and, where
transformers is installed, checks that transformers loads the folder and generates from it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["greedy", "show_arithmetic"]


def greedy(logits_fn: Callable[[torch.Tensor], torch.Tensor], prompts: list[list[int]], eos: int,
           max_new: int) -> list[list[int]]:
    """Greedy decoding of each prompt (grouped by length; no KV cache: the models here are small).

    Returns the new tokens of each prompt, without the ``eos`` that ended it.
    """
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for idx in by_len.values():
            _greedy_group(logits_fn, [prompts[i] for i in idx], [out[i] for i in idx], eos, max_new)
    return out


def _greedy_group(logits_fn, prompts: list[list[int]], outs: list[list[int]], eos: int, max_new: int) -> None:
    """Decode prompts of one length together, appending each one's new tokens to its list in ``outs``."""
    ids = torch.tensor(prompts)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(max_new):
        nxt = logits_fn(ids)[:, -1].argmax(-1)
        for k, out in enumerate(outs):
            if not done[k]:
                if int(nxt[k]) == eos:
                    done[k] = True
                else:
                    out.append(int(nxt[k]))
        ids = torch.cat([ids, nxt[:, None]], 1)
        if done.all():
            break


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
