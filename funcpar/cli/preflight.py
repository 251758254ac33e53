"""What ``funcpar train`` checks before step 1, so that a run which cannot finish is refused before it starts: the
batch arithmetic over the mesh, the sizes of the train and held-out sets, positions, warmup and the output folder.
Refusals are one line saying what to change (``SystemExit``); doubtful choices are warnings.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from funcpar.cli import trackers
from funcpar.io.atomic import MARKER, write_file, written_as

__all__ = ["check_run", "claim_out", "run_files", "lock_out", "RUN_FILES", "mark_run", "read_paths"]


def _seq_len_that_fits(opts: dict[str, Any], tokens: int | None) -> int:
    """The longest ``--seq-len`` whose packed rows make one global batch after the held-out split; 0 if none."""
    if not tokens or not opts["pack"]:
        return 0
    frac = opts["eval_fraction"]
    for seq_len in range(opts["seq_len"] - 1, 0, -1):
        rows = tokens // seq_len
        held = max(1, int(rows * frac)) if frac > 0 else 0
        if rows - held >= opts["global_batch"]:
            return seq_len
    return 0


def _batch(opts: dict[str, Any], mesh, train_rows: int, eval_rows: int, tokens: int | None,
           data_axes: tuple[str, ...] = ("dp",)) -> None:
    micro, gb = opts["micro_batches"], opts["global_batch"]
    unit, split = mesh.data_block(data_axes)[0] * micro, mesh.data_text(data_axes)  # (split: "dp=2", "dp=2 x ep=2")
    if gb % unit:
        raise SystemExit(f"funcpar: --global-batch {gb} does not split over {split} x --micro-batches {micro}: use a "
                         f"multiple of {unit} (e.g. {max(unit, gb // unit * unit)})")
    if train_rows < gb:
        fits, seq_len = train_rows // unit * unit, _seq_len_that_fits(opts, tokens)
        change = " or ".join(
            ([f"lower --global-batch to {fits} or less (a multiple of {split} x --micro-batches {micro})"] if fits
             else []) + ([f"use --seq-len {seq_len} or less"] if seq_len else []) or ["use fewer dp ranks"])
        raise SystemExit(f"funcpar: the training data makes {train_rows} rows of --seq-len {opts['seq_len']} "
                         f"({eval_rows} more held out), fewer than one --global-batch of {gb}: {change}, or bring "
                         "more data")
    if opts["eval_every"] and not eval_rows:
        raise SystemExit(f"funcpar: --eval-every {opts['eval_every']} needs held-out rows, and --eval-fraction "
                         f"{opts['eval_fraction']} keeps none: raise --eval-fraction or pass --eval-every 0")


def _positions(opts: dict[str, Any], cfg) -> list[str]:
    learned = getattr(cfg, "n_positions", None)  # a learned position table (GPT-2) has no row beyond it
    if learned is not None and opts["seq_len"] > learned:
        raise SystemExit(f"funcpar: --seq-len {opts['seq_len']} exceeds the model's n_positions {learned} (its "
                         f"learned position table): use --seq-len {learned} or less")
    most = getattr(cfg, "max_position_embeddings", None)
    if most is not None and opts["seq_len"] > most:
        return [f"--seq-len {opts['seq_len']} exceeds the model's max_position_embeddings {most}: positions beyond "
                "it were never trained"]
    return []


def check_run(opts: dict[str, Any], cfg, mesh, train_rows: int, eval_rows: int, tokens: int | None = None,
              data_axes: tuple[str, ...] = ("dp",)) -> list[str]:
    """Refuse a run that cannot finish (``SystemExit`` with what to change); return the warnings for the rest.
    ``tokens``: how many the data holds (to suggest a ``--seq-len`` that fits); ``data_axes``: the axes the batch is
    split over (:func:`funcpar.cli.options.run_data_axes`)."""
    _batch(opts, mesh, train_rows, eval_rows, tokens, data_axes)
    warnings = _positions(opts, cfg)
    if opts["warmup"] >= opts["steps"] > 0 and opts["schedule"] != "constant":
        short = opts["steps"] - 1  # (options.build_optimizer shortens the warmup to fit)
        what = (f"the warmup is cut to {short} steps, so the learning rate reaches --lr {opts['lr']} only at the "
                f"last step and never decays" if short else f"there is no warmup: step 1 trains at --lr {opts['lr']}")
        warnings.append(f"--warmup {opts['warmup']} is not below --steps {opts['steps']}: {what} (use a --warmup "
                        f"below --steps, e.g. {max(opts['steps'] // 10, 0)})")
    if opts["sample_prompts"]:
        _samples(opts, mesh, cfg)
    try:
        trackers.check(opts["track"])
    except ValueError as e:
        raise SystemExit(f"funcpar: {e}") from None
    return warnings


def _samples(opts, mesh, cfg) -> None:
    """``--sample-prompts``: a file of prompts, evaluations to show them at, a mesh the model decodes on whole, and
    room in a learned position table for each prompt and its continuation."""
    from funcpar.cli.generate import read_prompts
    from funcpar.cli.options import tokenizer

    tok = tokenizer(opts)
    try:
        prompts = read_prompts(opts["sample_prompts"], tok)  # (conversations through the run's chat template)
    except ValueError as e:
        raise SystemExit(f"funcpar: {e}") from None
    learned = getattr(cfg, "n_positions", None)
    if learned is not None and prompts:
        most, longest = max((len(tok.encode(p)), p) for p in prompts)
        need = most + opts["sample_tokens"]
        if need > learned:
            raise SystemExit(f"funcpar: --sample-prompts {opts['sample_prompts']}: the prompt {longest[:40]!r} and "
                             f"--sample-tokens {opts['sample_tokens']} need {need} positions, beyond the model's "
                             f"n_positions {learned} (its learned position table): shorten it or lower "
                             f"--sample-tokens")
    if not opts["eval_every"]:
        raise SystemExit("funcpar: --sample-prompts shows the samples at each evaluation, and --eval-every 0 has "
                         "none: give --eval-every N")
    split = [a for a in ("pp", "cp") if a in mesh.axis_names and mesh.axis_size(a) > 1]
    if split:
        raise SystemExit(f"funcpar: --sample-prompts decodes with the model where it trains, which a {split[0]} "
                         f"axis splits: train without it, or generate from the run's hf/ afterwards")


# what a run writes in --out (logs/: rank-N.log, the traceback of a rank that failed under funcpar's launcher)
RUN_FILES = ("metrics.jsonl", "checkpoints", "hf", "loss.png", "config.json", "tensorboard", "adapter", "samples.jsonl",
             "trackers.json", "wandb", "logs")
RUN_MARKER = MARKER  # in --out too: {"kind": "run"}, written when a run claims the folder


def _run_config(path: Path) -> bool:
    """Whether ``path`` is a run's config.json (funcpar's options), not a model's or anyone else's."""
    from funcpar.cli.options import saved_run_options

    return saved_run_options(path) is not None


def _rows(path: Path) -> bool:
    """Whether ``path`` is a file of funcpar's rows (metrics.jsonl, samples.jsonl): every whole line a JSON object
    with a ``step``; a last line cut short by a kill is allowed, an empty file holds nothing to lose."""
    import json

    if not path.is_file() or path.is_symlink():
        return False
    lines = path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                continue
            return False
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            return False
    return True


def _checkpoints(path: Path) -> bool:
    """Whether ``path`` is a run's checkpoints/: only funcpar's checkpoint folders (their marker), ``latest`` and
    the temporary names a save leaves."""
    if not path.is_dir() or path.is_symlink():
        return False
    for e in path.iterdir():
        temp = e.name.startswith(".") and e.name.endswith((".tmp", ".old"))
        if not (temp or e.name == "latest" and e.is_file() or _marked(e)):
            return False
    return True


def _marked(path: Path) -> bool:
    """Whether ``path`` is a folder funcpar wrote (its :data:`~funcpar.io.atomic.MARKER`)."""
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def _rank_logs(path: Path) -> bool:
    """Whether ``path`` is a run's logs/ folder: only ranks' logs (``rank-N.log``) in it."""
    return path.is_dir() and all(p.name.startswith("rank-") and p.name.endswith(".log") for p in path.iterdir())


# how an entry of --out is known as a run's by what it holds, not by its name (a Lightning checkpoints/ folder, a
# user's metrics.jsonl are someone else's); the others are a run's only in a folder a run has marked
_KNOWN_BY_CONTENT = {"config.json": _run_config, "metrics.jsonl": _rows, "samples.jsonl": _rows,
                     "checkpoints": _checkpoints, "hf": _marked, "adapter": _marked, "logs": _rank_logs}


def run_marked(out: Path) -> bool:
    """Whether a run has claimed ``out`` (its :data:`RUN_MARKER` says so)."""
    return written_as(out).get("kind") == "run"


def mark_run(out: Path) -> None:
    """Mark ``out`` as a run's folder (:data:`RUN_MARKER`), so that what the run writes there is known as its own."""
    import json

    write_file(out / RUN_MARKER, json.dumps({"written_by": "funcpar", "kind": "run"}) + "\n")


def run_files(out: Path) -> list[str]:
    """The entries of ``out`` a funcpar run wrote: each known by its content (:data:`_KNOWN_BY_CONTENT`), the
    others (loss.png, tensorboard/, wandb/, trackers.json) only in a folder a run has marked (or whose config.json
    holds a run's options: a run from before the marker)."""
    marked = run_marked(out) or _run_config(out / "config.json")
    return [n for n in RUN_FILES if (out / n).exists() and not (out / n).is_symlink()
            and (_KNOWN_BY_CONTENT[n](out / n) if n in _KNOWN_BY_CONTENT else marked)]


def read_paths(opts: dict[str, Any]) -> list[tuple[str, Path]]:
    """The files and folders a run reads, as ``(flag, resolved path)``: the model, the tokenizer, every data source,
    the held-out data and the sample prompts (built-in names are not paths)."""
    from funcpar.cli.options import data_sources

    out = []
    for flag, text in (("--model", opts.get("model")), ("--tokenizer", opts.get("tokenizer"))):
        if isinstance(text, str) and text and Path(text).exists():
            out.append((f"{flag} {text}", Path(text).resolve()))
    for flag in ("data", "eval_data"):
        text = opts.get(flag)
        if isinstance(text, str) and text:
            for path, _ in data_sources(text):
                if Path(path).exists():
                    out.append((f"--{flag.replace('_', '-')} {path}", Path(path).resolve()))
    text = opts.get("sample_prompts")
    if isinstance(text, str) and text and Path(text).exists():
        out.append((f"--sample-prompts {text}", Path(text).resolve()))
    return out


def claim_out(out: Path, resume: bool, overwrite: bool, check_only: bool = False,
              reads: list[tuple[str, Path]] = ()) -> None:
    """``out`` for a run: a new or empty folder, or one a funcpar run wrote (marked as a run's, or its options,
    metrics, checkpoints or ranks' logs there, each known by its content). Another run's folder is refused unless
    ``resume`` continues it or ``overwrite`` replaces it: then only the entries the run wrote are removed (others in
    ``out`` stay), never one that holds what this run reads (``reads``: :func:`read_paths`). A folder that is not a
    run's (a model folder, a user's files, a Lightning ``checkpoints/``), or an entry named as a run's that holds
    someone else's files, is refused whatever the flags: funcpar writes only into new, empty or its own folders.
    ``check_only``: refuse as that would, remove nothing (the launcher's check before the ranks start, and the
    run's own before it takes the folder's lock)."""
    if not out.is_dir():
        return  # (new; or not a folder: creating it says why)
    entries = sorted(e.name for e in out.iterdir() if e.name not in (LOCK, RUN_MARKER))
    found = run_files(out)
    if entries and not found and not run_marked(out):
        shown = ", ".join(entries[:6]) + (" ..." if len(entries) > 6 else "")
        raise SystemExit(f"funcpar: --out {out} holds files funcpar did not write ({shown}): funcpar writes only "
                         "into a new or empty folder or one of its own runs; choose another --out")
    stray = [n for n in RUN_FILES if n in entries and n not in found]
    if stray:
        raise SystemExit(f"funcpar: --out {out}: its {stray[0]} holds files funcpar did not write (a run writes its "
                         f"own {stray[0]} there): move it away or choose another --out")
    if not found or resume:
        return
    if not overwrite:
        raise SystemExit(f"funcpar: --out {out} holds an earlier run ({', '.join(found)}): pass --resume to continue "
                         "it, --overwrite to replace it, or choose another --out")
    for flag, path in reads:
        inside = next((n for n in found if path == (out / n).resolve() or (out / n).resolve() in path.parents), None)
        if inside is not None:
            raise SystemExit(f"funcpar: --overwrite would delete {out / inside}, which this run reads ({flag}): copy "
                             f"it out of --out first, or choose another --out")
    if check_only:
        return
    for name in found:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


LOCK = ".lock"  # in a run folder: held (flock) by the run writing there, with its pid


def lock_out(out: Path, hold: bool = True) -> int | None:
    """An exclusive lock on the run folder ``out`` (``flock`` on ``out/.lock``, which the kernel releases when the
    process ends, however it ends): a second run into the same folder is refused naming the first's pid, instead
    of both writing its metrics and checkpoints. Returns the lock's descriptor, to keep for the run's life;
    ``hold=False`` only checks (the launcher's check, before the ranks start)."""
    import fcntl

    if not out.is_dir():
        return None
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SystemExit(f"funcpar: --out {out} is in use by another funcpar run (pid {holder}): wait for it to end, "
                         f"or choose another --out") from None
    if not hold:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
