"""``funcpar train / plan / convert``: the command-line face of the Python API.

Run bare, ``funcpar train`` starts one process per mesh rank on this machine through ``torch.distributed.run``;
under ``torchrun`` (one node or many) it uses the world it is given. Options come from defaults, then a TOML/JSON
``--config`` file, then the command line. This module only parses options and wires the library together
(models from the registry, :mod:`funcpar.cli.generate`, :mod:`funcpar.cli.plot`, :mod:`funcpar.cli.planning`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import shlex
import sys
import types
import time
from pathlib import Path
from typing import Any

import optree
import torch

import funcpar as fp
from funcpar.parallel.lifeline import LAUNCHER_ENV
from funcpar.cli.launch import (INTERRUPTED, USER_ERRORS, StopRequest, debug, fail, launch_if_needed, restarted,
                            run_and_exit)
from funcpar.io.atomic import agree, open_own, refuse_links, write_file
from funcpar.parallel.mesh import resolve_device
from funcpar.cli.generate import read_prompts, sample_on_mesh, show_arithmetic
from funcpar.cli.preflight import RUN_FILES, check_run, claim_out, lock_out, mark_run, read_paths, run_files
from funcpar.cli.progress import Progress, flops_per_token, measure_peak_flops
from funcpar.cli.options import (DEFAULTS, build_lora, build_params, build_step, data_differences, data_record,
                             datasets, generic_path, lora_parts,
                             model_config, parse_mesh, read_options, run_data_axes, run_options, saved_options,
                             saved_run_options,
                             tokenizer, with_epochs,
                             with_tokenizer)
from funcpar.cli.planning import OPTIMIZER_SLOTS, params_like, print_plan, sharding_table, vocab_note
from funcpar.cli.search import print_ranking, rank_meshes, stage_depth, trace_layout
from funcpar.cli.timing import DEFAULT_LINKS, DEVICES, GPU_REACHED, LINKS, Pricing, host_device
from funcpar.cli.plot import plot_metrics
from funcpar.cli.trackers import open_trackers



# ------------------------------------------------------------------------------------------------------ train


@dataclasses.dataclass
class _Run:
    """Everything one ``funcpar train`` run works with (``state`` advances as it trains)."""

    opts: dict[str, Any]
    mesh: Any
    model: Any
    cfg: Any
    specs: Any
    data: Any
    train_data: Any
    eval_data: Any
    step: Any
    state: Any
    loader: Any
    warnings: list
    lora: Any = None  # --lora: the adapters' Lora, and the frozen base parameters (this rank's shards)
    base: Any = None
    lock: int | None = None  # rank 0: the run folder's lock (preflight.lock_out), held until the run ends
    _data_record: dict | None = None

    def __post_init__(self):
        self.rank0, self.out = self.mesh.rank == 0, Path(self.opts["out"])
        self.ckpts, self.metrics_file = self.out / "checkpoints", self.out / "metrics.jsonl"

    def data_record(self) -> dict:
        """The run's :func:`~funcpar.cli.options.data_record` (its sources hashed once a run)."""
        if self._data_record is None:
            self._data_record = data_record(self.opts)
        return self._data_record

    def save(self) -> None:
        """A checkpoint of the state and the data position at the current step (keeping the last ``--keep``)."""
        extra = {"model": self.cfg.model_type, "generic": generic_path(self.cfg), "config": self.cfg.to_hf(),
                 "tokenizer": self.opts["tokenizer"],
                 "data": self.loader.state_dict(), "data_record": self.data_record(),
                 "seq_len": self.opts["seq_len"], "lora": _lora_fields(self.opts)}
        self.step.save(self.ckpts / f"step-{self.state.step}", self.state, extra=extra, keep=self.opts["keep"],
                       overwrite=self.opts["overwrite"])


CHOSEN_DEVICE = "FUNCPAR_CHOSEN_DEVICE"  # funcpar's launcher tells the ranks it starts the device it chose for them


def _run_mesh(opts, sizes) -> tuple[Any, str | None]:
    """This rank's mesh of ``--mesh`` on the device chosen for it, and why it is not a GPU (None: it is, or cpu
    was asked for)."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    choice = os.environ.get(CHOSEN_DEVICE, opts["device"])  # (funcpar's launcher chose already)
    device, why_not_gpu = resolve_device(choice, local_world=None if sizes else 1)
    return fp.Mesh(**sizes, heartbeat=opts["heartbeat"], device=device), why_not_gpu


def _setup_run(opts, mesh, why_not_gpu: str | None = None) -> _Run:
    """Build the model, data, train step, its initial state and the data loader on ``mesh``."""
    model, cfg = model_config(opts["model"], mesh, opts["generic"])
    opts = with_tokenizer(opts)  # (auto: the model folder's own; what the checkpoints and config.json then record)
    specs = model.specs(cfg, mesh)
    data, train_data, eval_data = datasets(opts, cfg)
    opts = with_epochs(opts, len(train_data))
    # before any work: refused now or never
    warnings = check_run(opts, cfg, mesh, len(train_data), len(eval_data), data.tokens, run_data_axes(model, mesh))
    if why_not_gpu:
        warnings.insert(0, f"the ranks run on the CPU: {why_not_gpu}")
    lora = base = None
    if opts["lora"]:
        lora, base, step, state = build_lora(opts, model, cfg, mesh, specs)
    else:
        step = build_step(opts, model, cfg, mesh, specs)
        # (a stage reads its leaves; handed off: freed once in the step's buffers, before the optimizer state)
        state = step.init(fp.Handoff(build_params(opts, model, cfg, specs, mesh, keep=step.holds)))
    loader = fp.data.Loader(train_data, mesh, opts["global_batch"], seed=opts["seed"],
                            data_axes=step.options.parallel.data_axes)
    return _Run(opts, mesh, model, cfg, specs, data, train_data, eval_data, step, state, loader, warnings, lora, base)


def _params(run: _Run) -> Any:
    """The model's parameters now (this rank's shards): the step's, or under --lora the base with the adapters
    merged in."""
    if not run.lora:
        return run.step.gather_params(run.state)
    base = run.base.gather_base() if isinstance(run.base, fp.lora.ShardedBase) else run.base
    return run.lora.merge(base, run.state.params)


def resume_point(ckpts: Path) -> Path | None:
    """The checkpoint ``--resume`` continues: the one ``latest`` names, else the newest ``step-N`` beside it (each
    is complete: written aside and renamed into place; a crash between that rename and ``latest``'s leaves one
    without the other), else None."""
    if (ckpts / "latest").exists():
        return ckpts
    saved = [p for p in ckpts.glob("step-*") if p.name[5:].isdigit() and (p / "meta.json").is_file()]
    return max(saved, key=lambda p: int(p.name[5:])) if saved else None


def _parsed_row(line: str, where: Path) -> dict:
    """A row of metrics.jsonl (or samples.jsonl); a line cut short (a kill or a full disk mid-append) is dropped,
    with a warning."""
    try:
        row = json.loads(line)
    except ValueError:
        row = None
    if not isinstance(row, dict):
        print(f"funcpar: warning: {where}: dropped a line that is not a whole row (a write cut short): "
              f"{line[:60]!r}", flush=True)
        return {"step": float("inf")}
    return row


def _lora_fields(opts) -> dict | None:
    """``--lora``'s settings as a checkpoint records them (r, alpha, targets, dropout), None without it."""
    return dataclasses.asdict(fp.lora.LoraConfig.parse(opts["lora"])) if opts["lora"] else None


def _same_run(opts, extra: dict, src: Path, loader=None) -> None:
    """Refuse to resume with settings the checkpoint's state cannot continue under (``extra``: what it recorded;
    read from its meta.json before any tensor, so the launcher checks it before the ranks start): another
    --seq-len (the saved data position counts rows of the old length); another --lora (alpha or dropout: the
    adapters were trained under the old scale; r or targets: other adapters), or --lora on a whole model's
    checkpoint or none on an adapters' one; and what ``loader`` (the run's :class:`funcpar.data.Loader`) would
    refuse of the saved data position (:func:`_same_data`). A checkpoint that predates a record is not checked."""
    if extra.get("seq_len") not in (None, opts["seq_len"]):
        raise SystemExit(f"funcpar: --seq-len {opts['seq_len']} differs from the checkpoint's {extra['seq_len']} "
                         f"({src}): its data position counts rows of {extra['seq_len']} tokens; resume with --seq-len "
                         f"{extra['seq_len']}, or start a new run")
    saved, now = extra.get("lora"), _lora_fields(opts)
    if "lora" in extra and (saved is None) != (now is None):
        held = (f"LoRA adapters (--lora r={saved['r']},alpha={saved['alpha']:g},targets={','.join(saved['targets'])})"
                if saved else "a whole model's state (no --lora)")
        raise SystemExit(f"funcpar: --resume: the checkpoint ({src}) holds {held}, and this run "
                         f"{'trains the whole model' if now is None else 'trains LoRA adapters'}: resume with the "
                         f"run's --lora, or start a new run")
    if saved is not None and now is not None:
        changed = [f"{k}={_shown(now[k])} (the checkpoint's: {_shown(saved[k])})"
                   for k in ("r", "alpha", "targets", "dropout") if k in saved and _shown(saved[k]) != _shown(now[k])]
        if changed:
            raise SystemExit(f"funcpar: --lora {', '.join(changed)} differs from the run being resumed ({src}): its "
                             f"adapters were trained under the checkpoint's settings; resume with them")
    diff = _data_diff(opts, extra)
    if diff and opts.get("data_changed"):
        return  # (--data-changed: the data order starts afresh, the saved position is not read)
    if loader is not None and isinstance(extra.get("data"), dict):
        _same_data(opts, extra["data"], loader.state_dict(), src)  # (another mix or batch: said in its flags)
    if diff:
        raise SystemExit(f"funcpar: --resume: the data differs from the checkpoint's ({src}): {'; '.join(diff)}; "
                         f"its saved position would continue over other rows (and rows it trained on could be held "
                         f"out): resume with the data as it was, or pass --data-changed to go on with the model and "
                         f"start the data order afresh on the new data")


def _data_diff(opts, extra: dict) -> list[str]:
    """How the run's data differs from what the checkpoint recorded (``extra["data_record"]``: each source's size
    and content hash, the held-out split, packing), in words; empty where it does not or the checkpoint predates
    the record. Rows trained on would otherwise turn into held-out rows, and the saved position would replay over
    other rows."""
    saved = extra.get("data_record")
    return data_differences(saved, data_record(opts)) if isinstance(saved, dict) else []


def _data_changed(opts, extra: dict) -> bool:
    """Whether ``--data-changed`` applies: the flag given and the data differing (the data order starts afresh)."""
    return bool(opts.get("data_changed")) and bool(_data_diff(opts, extra))


def _shown(v):
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v


def _same_data(opts, saved: dict, now: dict, src: Path) -> None:
    """What :meth:`funcpar.data.Loader.load_state_dict` refuses of a saved data position (``saved``; ``now``: the
    run's loader's own state), said in flags: another --global-batch or --seed (the order the position counts
    in), another number of --data sources or other weights (the rows each source has served)."""
    for key in ("global_batch", "seed"):
        if key in saved and saved[key] != now[key]:
            flag = "--" + key.replace("_", "-")
            raise SystemExit(f"funcpar: {flag} {now[key]} differs from the checkpoint's {saved[key]} ({src}): its data "
                             f"position counts global batches in the order of --global-batch and --seed; resume with "
                             f"{flag} {saved[key]}, or start a new run")
    was, weights = saved.get("weights", [1.0]), now.get("weights", [1.0])
    if len(was) != len(weights) or any(abs(a - b) > 1e-9 for a, b in zip(was, weights, strict=True)):
        now_by, was_by = (", ".join(f"{w:g}" for w in ws) for ws in (weights, was))
        raise SystemExit(f"funcpar: --data {opts['data']} mixes {len(weights)} source(s) by {now_by}, the "
                         f"checkpoint's run {len(was)} by {was_by} ({src}): the rows each source has served follow "
                         f"from the mix; resume with the run's --data, or start a new run")


def _resume_source(opts) -> Path | None:
    """With ``--resume``: the checkpoint it continues (:func:`resume_point`). None of them is refused, naming the
    folder (a mistyped --out would otherwise train from scratch), but in a rank torchrun restarted (it continues
    the run it was; one that failed before its first checkpoint starts again at step 0) unless the folder holds the
    run's hf/ export without --overwrite (its checkpoints are gone: a start at step 0 would replace the export)."""
    out = Path(opts["out"])
    src = resume_point(out / "checkpoints")
    if src is not None:
        return src
    if out.is_dir():
        refuse_links(out, RUN_FILES)  # (what the run would refuse first: a link is no run's file)
    found = run_files(out) if out.is_dir() else []
    if "hf" in found and not opts["overwrite"]:  # (a finished run: starting at step 0 would replace its export)
        gone = "is gone" if not (out / "checkpoints").exists() else "holds no checkpoint"
        raise SystemExit(f"funcpar: --resume: the run in {out} exported {out / 'hf'}, but its {out / 'checkpoints'} "
                         f"{gone}: there is nothing to continue, and training from step 0 would replace that export; "
                         f"restore the checkpoints, or pass --overwrite (without --resume) to start a new run there")
    if restarted():
        return None
    if found:
        raise SystemExit(f"funcpar: --resume: --out {out} holds no checkpoint to continue (its earlier run saved none: "
                         f"{', '.join(found)}): drop --resume and pass --overwrite to start a new run there")
    what = "no such folder" if not out.exists() else "no checkpoints in it"
    raise SystemExit(f"funcpar: --resume: --out {out} holds no checkpoint to continue ({what}): drop --resume to "
                     f"start a new run (or check --out)")


def _resume(run: _Run) -> None:
    """With ``--resume``: continue from the output folder's checkpoint (:func:`_resume_source`), its state and data
    position, once its recorded settings agree (:func:`_same_run`, before a tensor is read); a rank torchrun
    restarted before the run's first checkpoint says so and starts at step 0."""
    if not run.opts["resume"]:
        return
    src = _resume_source(run.opts)
    if src is None:
        if run.rank0:
            print(f"funcpar: --resume: {run.ckpts} holds no checkpoint yet: starting at step 0", flush=True)
        return
    meta = fp.checkpoint.metadata(src).get("extra") or {}
    _same_run(run.opts, meta, src, run.loader)
    fresh = _data_changed(run.opts, meta)  # (--data-changed, and the data did change)
    run.state, extra = run.step.load(src)
    if fresh:
        if run.rank0:
            print(f"funcpar: --data-changed: the data differs from the checkpoint's; the data order starts afresh "
                  f"on it at step {run.state.step}", flush=True)
    else:
        run.loader.load_state_dict(extra["data"])
    if run.rank0:
        print(f"resumed from {fp.checkpoint.resolve(src)} at step {run.state.step}", flush=True)
        if src != run.ckpts:
            print(f"funcpar: --resume (its 'latest' was missing: {src.name} is the newest complete checkpoint)",
                  flush=True)


def _announce(run: _Run) -> None:
    """Rank 0: trim metrics.jsonl (and samples.jsonl) to the steps done so far, print the run and its sharding
    table."""
    opts, step, mesh = run.opts, run.state.step, run.mesh

    def prepare():
        refuse_links(run.out, RUN_FILES + ("checkpoints/latest", "checkpoints/.latest.tmp"))
        reads = read_paths(opts)
        claim_out(run.out, opts["resume"], opts["overwrite"], check_only=True, reads=reads)  # (refusals only)
        run.out.mkdir(parents=True, exist_ok=True)
        run.lock = lock_out(run.out)  # (kept open: the lock lasts as long as this process)
        claim_out(run.out, opts["resume"], opts["overwrite"], reads=reads)  # (--overwrite: only once the lock is held)
        mark_run(run.out)
        for log in (run.metrics_file, run.out / "samples.jsonl"):  # (a resumed run repeats the steps after `step`)
            old = log.read_text().splitlines() if log.exists() and step else []
            kept = [line for line in old if _parsed_row(line, log).get("step", 0) <= step]
            if kept or log == run.metrics_file:
                write_file(log, "".join(line + "\n" for line in kept))  # (whole or not at all: the run's history)
            elif log.exists():
                log.unlink()
        write_file(run.out / "config.json", json.dumps(saved_options(opts), indent=2) + "\n")  # (a --config)

    error = None
    if run.rank0:
        try:
            prepare()
        except OSError as e:
            error = OSError(f"funcpar: cannot prepare the run folder {run.out}: {e}")
        except SystemExit as e:
            error = e
    message = agree(error, mesh)  # the other ranks hear why, instead of waiting at the first collective
    if message is not None:
        raise SystemExit(message)
    if not run.rank0:
        return
    for w in run.warnings:
        print(f"funcpar: warning: {w}", flush=True)
    path = "transformers' module split by its tp plan" if generic_path(run.cfg) else "funcpar's built-in model"
    print(f"funcpar train: {run.cfg.model_type} ({path}) on {mesh!r} ({mesh.size} process(es), {mesh.device.type}), "
          f"{len(run.train_data)} train rows x {opts['seq_len']} tokens, {len(run.eval_data)} held-out rows"
          + (f", {run.data.truncated} samples truncated" if run.data.truncated else ""), flush=True)
    if run.lora:
        total = sum(x.numel() for _, x in fp.tree.leaves_with_path(params_like(run.model, run.cfg)))
        print(f"funcpar train: LoRA {opts['lora']}: {run.lora.trainable():,} trainable parameters "
              f"({run.lora.trainable() / total:.2%} of the model's {total:,}; the base frozen)", flush=True)
    mix = run.train_data
    if len(mix.parts) > 1:
        print("funcpar train: mixing " + ", ".join(f"{name} {w:.0%} ({len(p)} rows)" for name, w, p in
                                                   zip(mix.names, mix.weights, mix.parts, strict=True)), flush=True)
    print(sharding_table(params_like(run.model, run.cfg), run.specs, mesh), flush=True)
    tok = _tokenizer(opts)
    if opts["pack"] and not opts["cross_document"] and not run.model.documents:
        print(f"funcpar train: model '{run.model.name}' packs samples attending across each other (it takes no "
              f"document masks yet)", flush=True)
    if opts["tokenizer"] == opts["model"]:
        print(f"funcpar train: the tokenizer of --model {opts['model']} ({tok.vocab_size} ids"
              + (", its chat template" if getattr(tok, "chat", False) else "") + ")", flush=True)
    note = vocab_note(run.cfg, tok.vocab_size)
    if note:
        print(note, flush=True)
    if run.step.executor is not None:
        print(run.step.executor.plan.describe(), flush=True)


def _evaluate(run: _Run, data, global_batch) -> tuple[float, dict[str, float]]:
    """Mean held-out token loss over the whole eval set, split over dp (through the pipeline's stages on pp), and
    with several sources each one's (``{source file name: loss}``)."""
    parts = [(name, fp.data.Mixture([p])) for name, p in zip(data.names, data.parts, strict=True)]
    sums = {name: _held_out_sums(run, part, global_batch) for name, part in parts}
    total = sum(sums.values(), torch.zeros(2, dtype=torch.float64))
    each = {Path(name).name: (t[0] / t[1].clamp(min=1)).item() for name, t in sums.items()} if len(sums) > 1 else {}
    return (total[0] / total[1].clamp(min=1)).item(), each


def _held_out_sums(run: _Run, data, global_batch) -> torch.Tensor:
    """``[summed token loss, tokens]`` of one source's held-out rows over the whole mesh (:meth:`funcpar.Step.
    held_out` on each rank's rows, summed over the step's data axes: dp splits the rows (and Mixtral's ep), cp
    each row)."""
    mesh = run.mesh
    blocks, c = mesh.data_block(run.step.options.parallel.data_axes)
    gb = min(global_batch, len(data)) // blocks * blocks
    if gb:  # whole batches of the held-out rows in order, each data rank its block (read one batch at a time)
        block = gb // blocks
        local = (data.take_range(lo + c * block, lo + (c + 1) * block) for lo in range(0, len(data) // gb * gb, gb))
    else:  # fewer held-out rows than data ranks: every rank evaluates them all, data rank 0's sums count
        local = iter([data.take_range(0, len(data))])
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for b in local:
            total += run.step.held_out(run.state, {k: v.to(mesh.device) for k, v in b.items()})
    if not gb and c:
        total.zero_()
    return fp.collectives.all_reduce(total, mesh, run.step.options.parallel.data_axes)


def _metrics_row(run: _Run, m: dict) -> dict:
    """The metrics.jsonl row of the step just taken, with the held-out loss on eval steps."""
    opts = run.opts
    row = {k: m[k] for k in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "loss_scale", "skipped", "bubble")
           if k in m}
    row["truncated"] = run.data.truncated
    row["time"] = round(time.time(), 3)  # (when the step ended: seconds since the epoch, for trackers and plots)
    if opts["eval_every"] and (run.state.step % opts["eval_every"] == 0 or run.state.step == opts["steps"]):
        ev, each = _evaluate(run, run.eval_data, opts["global_batch"])
        row |= {"eval_loss": ev, "eval_ppl": math.exp(min(ev, 50))} | {f"eval_loss/{k}": v for k, v in each.items()}
        if opts["sample_prompts"]:
            _samples(run)
    return row


@functools.lru_cache(maxsize=2)
def _cached_tokenizer(name: str, chat: str):
    return tokenizer({**DEFAULTS, "tokenizer": name, "chat_template": chat})


def _tokenizer(opts):
    """The run's tokenizer, loaded once in this process (an HF tokenizer takes a while): the summary's vocabulary
    line, every evaluation's samples and the export share it."""
    return _cached_tokenizer(opts["tokenizer"], opts["chat_template"])


def _samples(run: _Run) -> None:
    """``--sample-prompts``: greedy continuations by the model as it is now (every rank decodes; rank 0 shows them
    and appends them to samples.jsonl)."""
    prompts = read_prompts(run.opts["sample_prompts"], _tokenizer(run.opts))
    texts = sample_on_mesh(run.model, _params(run), run.cfg, run.mesh, _tokenizer(run.opts), prompts,
                           run.opts["sample_tokens"])
    if not run.rank0:
        return
    with open_own(run.out / "samples.jsonl", "a") as fh:
        for p, t in zip(prompts, texts, strict=True):
            fh.write(json.dumps({"step": run.state.step, "prompt": p, "completion": t}) + "\n")
            print(f"sample at step {run.state.step}: {p!r} -> {t!r}", flush=True)


def _progress(run: _Run) -> Progress:
    """The run's progress account, with the model's FLOPs per token and the mesh's measured matmul peak (MFU)."""
    cfg, like = run.cfg, params_like(run.model, run.cfg)
    n = sum(x.numel() for _, x in fp.tree.leaves_with_path(like))
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    return Progress(run.rank0, run.metrics_file, run.opts["steps"], run.opts["log_every"], run.state.step,
                    flops_per_token(n, layers, hidden, run.opts["seq_len"]), measure_peak_flops(run.mesh),
                    run.mesh.device, open_trackers(run.opts, run.out) if run.rank0 else None)


def _loop(run: _Run) -> bool:
    """Train up to ``--steps``, logging, evaluating and checkpointing as asked; False if stopped by Ctrl-C."""
    opts, progress = run.opts, _progress(run)
    with StopRequest() as stop:
        while run.state.step < opts["steps"]:
            run.state, m = run.step(run.state, next(run.loader))
            progress.log(run.state.step, _metrics_row(run, m))
            if opts["save_every"] and run.state.step % opts["save_every"] == 0 and run.state.step < opts["steps"]:
                run.save()
            if stop.agreed(run.mesh):
                progress.close()
                return False
    progress.close()
    return True


def _interrupted(run: _Run, argv: list[str]) -> None:
    """Stopped by Ctrl-C: save at this step (every rank) and say how to resume."""
    run.save()
    if run.rank0:
        again = ["funcpar", "train", *argv] + ([] if "--resume" in argv else ["--resume"])
        print(f"funcpar: interrupted at step {run.state.step}: saved {run.ckpts / f'step-{run.state.step}'}; resume "
              f"with: {shlex.join(again)}", flush=True)
    raise SystemExit(INTERRUPTED)


def _finish(run: _Run) -> None:
    """The last checkpoint, the transformers export, and on rank 0 the loss plot, a summary and the answer check."""
    run.save()
    choice, opt_state = run.opts["export_dtype"], run.state.opt_state
    masters = (fp.MixedState(opt_state.master, None)  # (--export-dtype fp32: the masters, not the moments)
               if choice == "fp32" and not run.lora and isinstance(opt_state, fp.MixedState) else None)
    # the checkpoint holds the optimizer state now: its memory goes to the export's whole leaves (at ZeRO-3 each
    # rank gathers them from its parts; a model sized to fill the ranks has no room for both)
    run.state = run.state._replace(opt_state=None)
    run.step.buffers.live = None
    params = run.step.gather_masters(run.state._replace(opt_state=masters)) if masters else _params(run)
    if choice != "auto":
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[choice]
        params = optree.tree_map(lambda x: x.to(dtype) if x.is_floating_point() else x, params)
    fp.hf.save(run.out / "hf", params, run.model, run.cfg, run.mesh, specs=run.specs,
               overwrite=run.opts["overwrite"], tokenizer=_tokenizer(run.opts))
    peft = None
    if run.lora:
        try:
            run.lora.save_peft(run.out / "adapter", run.state.params, base_model=run.opts["model"],
                               overwrite=run.opts["overwrite"])
            peft = run.out / "adapter"
        except fp.lora.LoraError as e:  # (fused or transposed leaves: the merged export stands alone)
            peft = f"no PEFT adapter folder ({e})"
    if not run.rank0:
        return
    title = (f"{run.cfg.model_type} on {run.mesh!r}: {run.opts['data']}, {run.opts['optimizer']} lr "
             f"{run.opts['lr']:g}, global batch {run.opts['global_batch']} x {run.opts['seq_len']}")
    plot_metrics(run.metrics_file, run.out / "loss.png", title=title)
    rows = [json.loads(line) for line in run.metrics_file.read_text().splitlines()]  # the whole run's, resumed or not
    first, last = (rows[0]["loss"], rows[-1]["loss"]) if rows else (float("nan"), float("nan"))
    print(f"loss {first:.4f} -> {last:.4f}; "
          f"wrote {run.ckpts}, {run.metrics_file}, {run.out / 'loss.png'} and a transformers folder {run.out / 'hf'}"
          + (f" (the adapters merged); adapter: {peft}" if run.lora else ""), flush=True)
    if run.opts["data"] == "builtin:arithmetic" and run.opts["tokenizer"] == "byte":
        if run.state.step >= ANSWER_CHECK_STEPS:  # (before that the model has not learnt the task: 0/100 says nothing)
            show_arithmetic(run.out / "hf", run.model)
        else:
            print(f"(the answers to the built-in task are checked after {ANSWER_CHECK_STEPS} steps or more)",
                  flush=True)


ANSWER_CHECK_STEPS = 100


def _preflight(opts, sizes) -> None:
    """What every rank would check before its first step, checked once here, before the ranks start, so that a
    mistake is one line within seconds rather than after every rank has loaded torch and built its mesh: the
    options, the model on the mesh (heads, vocabulary, layers over pp), the tokenizer and the data (read and
    tokenized, as each rank then does), the batch arithmetic, an --out that holds another run, and with --resume
    a checkpoint to continue whose recorded settings the run keeps (another --seq-len, --global-batch, --seed,
    data mix or --lora is refused here, not after the ranks have started and loaded it)."""
    mesh = fp.Mesh.abstract(**sizes)
    model, cfg = model_config(opts["model"], mesh, opts["generic"])
    specs = model.specs(cfg, mesh)
    if opts["lora"]:
        lora_parts(opts, model, cfg, mesh, specs)
    else:
        build_step(opts, model, cfg, mesh, specs)
    data, train_data, eval_data = datasets(opts, cfg)
    check_run(with_epochs(opts, len(train_data)), cfg, mesh, len(train_data), len(eval_data), data.tokens,
              run_data_axes(model, mesh))
    claim_out(Path(opts["out"]), opts["resume"], opts["overwrite"], check_only=True, reads=read_paths(opts))
    lock_out(Path(opts["out"]), hold=False)
    src = _resume_source(opts) if opts["resume"] else None
    if src is not None:  # (the checkpoint's meta.json only: what it recorded, not a tensor)
        loader = fp.data.Loader(train_data, mesh, opts["global_batch"], seed=opts["seed"],
                                data_axes=run_data_axes(model, mesh))
        _same_run(opts, fp.checkpoint.metadata(src).get("extra") or {}, src, loader)


def _writable_out(out: Path) -> None:
    """Refuse an ``--out`` this process cannot write (the folder, or the nearest folder above it that exists, when
    it is to be made), before the model, the data or the ranks are: the run would otherwise find out when it first
    writes there."""
    at = out.absolute()
    while not at.exists() and at != at.parent:
        at = at.parent
    if at.is_dir() and not os.access(at, os.W_OK | os.X_OK):
        what = "it" if at == out.absolute() else f"the folder {at} it is to be made in"
        raise SystemExit(f"funcpar: --out {out}: {what} is not writable by this user: make it writable, or choose "
                         f"another --out")


def train(argv: list[str]) -> None:
    """Train a model on a mesh (starting the ranks here unless under torchrun), then export it."""
    opts = run_options(read_options(argv, "train"), argv)
    _writable_out(Path(opts["out"]))
    sizes = parse_mesh(opts["mesh"])
    nproc = math.prod(sizes.values()) if sizes else 1
    if "RANK" not in os.environ and nproc > 1:
        # the ranks start here, all on this node: what they would refuse is refused now, before any starts; a
        # device they cannot have too; auto's choice is made (and said) once, and the ranks are told it
        _preflight(opts, sizes)
        device, why_not_gpu = resolve_device(opts["device"], local_rank=0, local_world=nproc)
        if why_not_gpu:
            print(f"funcpar: warning: the ranks run on the CPU: {why_not_gpu}", flush=True)
        os.environ[CHOSEN_DEVICE] = device.type  # (not in argv: the resume command a rank prints is the user's)
        try:  # (a rank's traceback goes to --out/logs/rank-N.log; the console gets its one line)
            launch_if_needed(["train", *argv], nproc, opts["max_restarts"], logs=Path(opts["out"]) / "logs")
        finally:
            os.environ.pop(CHOSEN_DEVICE, None)
        return
    if restarted():  # torchrun restarted this rank's group after a failure: continue the run it was, from its last
        opts = {**opts, "resume": True}  # checkpoint (or from step 0 when it had saved none yet)
        if os.environ.get("RANK") == "0":
            of = f" of --max-restarts {opts['max_restarts']}" if os.environ.get(LAUNCHER_ENV) == "1" else ""
            print(f"funcpar: a rank failed; torchrun restarted the ranks (restart {restarted()}{of}): resuming",
                  flush=True)  # (under a user's torchrun, its own --max-restarts counts them)
    elif opts["resume"]:
        _resume_source(opts)  # (none to continue: refused before the model and data are built)
    run = _setup_run(opts, *_run_mesh(opts, sizes))
    try:
        _resume(run)
        _announce(run)
        if not _loop(run):
            _interrupted(run, argv)
        _finish(run)
    finally:  # (the kernel releases it when the process ends; a program that calls main() goes on)
        if run.lock is not None:
            os.close(run.lock)


# --------------------------------------------------------------------------------------------- plan, convert


def planner(argv: list[str]):
    """``funcpar plan``'s command line read: ``(ranking, opts, build, estimate)``: its own flags, the step's options,
    ``build(axes, zero, micro=None, layers=None, **over)`` -> ``(model, cfg, step, rows, seq_len)`` of one dp rank
    on an abstract mesh (rank 0's), and
    ``estimate(row, axes, step)`` (:func:`_estimator`; None where the plan has no device to time)."""
    ap = argparse.ArgumentParser(prog="funcpar plan", add_help=False, allow_abbrev=False)  # (--device is not --devices)
    ap.add_argument("--devices", type=int, metavar="N", help="rank the meshes of N devices (dp x tp, and pp and cp "
                                                              "where the model has them) by the traced step")
    ap.add_argument("--memory", type=float, default=float("inf"), metavar="GiB",
                    help="with --devices: each device's memory; the meshes whose peak fits come first")
    ap.add_argument("--gpu", choices=sorted(DEVICES), help="estimate each step's time on these GPUs (their peaks "
                                                           "then without the host process)")
    ap.add_argument("--links", metavar="INTRA,INTER",
                    help=f"with --gpu: the links within a node and between nodes, of {', '.join(LINKS)} (default: "
                         f"nvlink3,ib200 for an A100, else nvlink,ib400)")
    ap.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="with --gpu: GPUs a node (default: 8)")
    ap.add_argument("--efficiency", type=float, metavar="F",
                    help=f"with --gpu: the share of the datasheet's matmul rate a large matmul reaches (default: "
                         f"{GPU_REACHED['ceiling']['half']:.2f} in bf16/fp16, measured; funcpar.cli.timing)")
    ap.add_argument("--micro-batch-size", type=int, metavar="ROWS",
                    help="rows a micro-batch (DeepSpeed's train_micro_batch_size_per_gpu): each mesh then runs its dp "
                         "rank's rows over ROWS micro-batches (default: --micro-batches; pipelines at least 2 x pp)")
    ap.add_argument("--search-seconds", type=float, default=240.0, metavar="S",
                    help="with --devices: stop the search after S seconds (its floors' traces counted) and rank "
                         "what was judged (it says how many were left and the least time any of them could take; "
                         "default 240)")
    ap.add_argument("--threads", type=int, metavar="N", help="on the CPU: threads a rank (default: OMP_NUM_THREADS, "
                                                             "else 1, as funcpar train runs)")
    ranking, rest = ap.parse_known_args(argv)
    opts = read_options(rest, "plan", parents=[ap], epilog=(
        "--devices N [--memory GiB]: rank the meshes that fit; --gpu h100|h200|a100|a100-40g [--links INTRA,INTER] "
        "[--gpus-per-node N] [--efficiency F]: estimate each step's time on such GPUs (on the CPU: this machine's; "
        "docs/MEASUREMENTS.md: the model and its checks)"))
    _check_ranking(ranking)
    estimate = _estimator(ranking, opts)

    def build(axes, zero, micro=None, layers=None, **over):
        """One data rank's step of the mesh ``axes`` at ZeRO ``zero``, with the options ``over`` sets (``remat``,
        ``pipeline``, ``chunks``, ``micro_batches``) over the command line's; ``micro``: that many micro-batches of
        the step's size, ``layers``: that many layers (a pipeline's: on each of its virtual stages), for
        :func:`funcpar.cli.search.trace_layout`'s extrapolation."""
        device = _plan_device(opts["device"], ranking.gpu, axes)
        mesh = fp.Mesh.abstract(device=device, **axes)
        o = {**opts, **over, "zero": zero}
        if layers is not None and axes.get("pp", 1) > 1:  # (every virtual stage that many layers)
            stages = axes["pp"] * (o["chunks"] or {"interleaved": 2}.get(o["pipeline"], 1))
            o["parts"], layers = ",".join([f"{layers:g}"] * stages), round(layers * stages)
        model, cfg = model_config(opts["model"], mesh, opts["generic"], layers)  # (ValueErrors: a row's reason)
        data_axes = run_data_axes(model, mesh)
        blocks = mesh.data_block(data_axes)[0]  # (dp's ranks; Mixtral's ep ranks too: each its own rows)
        micro_batches = over.get("micro_batches") or _micro_batches(opts, axes, ranking.micro_batch_size, blocks)
        if opts["global_batch"] % (blocks * micro_batches):
            raise ValueError(f"--global-batch {opts['global_batch']} does not split over "
                             f"{mesh.data_text(data_axes)} x {micro_batches}")
        micro = micro or micro_batches
        try:
            step = build_step({**o, "micro_batches": micro}, model, cfg, mesh, model.specs(cfg, mesh))
        except SystemExit as e:  # an option this mesh cannot take (--seq-len over cp, ...): a reason, not the end
            raise ValueError(str(e.code).removeprefix("funcpar: ")) from None
        return model, cfg, step, opts["global_batch"] // blocks // micro_batches * micro, opts["seq_len"]

    return ranking, opts, build, estimate


def plan(argv: list[str]) -> None:
    """Print the sharding table and the traced per-rank memory of the train step for a model on a mesh, without
    starting processes, and its estimated time; with ``--devices N --memory GiB``, search the layouts of N devices
    (:mod:`funcpar.cli.search`) and rank those that fit."""
    ranking, opts, build, estimate = planner(argv)
    documents = not opts["cross_document"] and None  # (None: where the model takes them)
    if ranking.devices:
        memory = ranking.memory * 2**30
        spec, cfg = model_config(opts["model"], None, opts["generic"])
        layers = stage_depth(spec, cfg, types.SimpleNamespace(executor=None))  # (floors: alike layers only)
        frozen = gc.get_freeze_count() == 0  # (a program that froze its own objects keeps them so)
        if frozen:  # what is live now lives through the search: frozen, each trace's gc.collect walks only its own
            gc.collect()
            gc.freeze()
        try:
            rows = rank_meshes(build, ranking.devices, memory, context=spec.context_parallel,
                               pipeline=spec.stages is not None, estimate=estimate, documents=documents,
                               gpu=ranking.gpu is not None, micro_size=ranking.micro_batch_size,
                               global_batch=opts["global_batch"], layers=None if opts["parts"] else layers,
                               slots=OPTIMIZER_SLOTS.get(opts["optimizer"], 2), chunks=opts["chunks"] or None,
                               log=functools.partial(print, file=sys.stderr, flush=True), budget=ranking.search_seconds,
                               **_search_space(argv, opts, spec))
        finally:
            if frozen:
                gc.unfreeze()
        print_ranking(rows, ranking.devices, memory)
        return
    axes = parse_mesh(opts["mesh"])
    try:
        model, cfg, step, rows, seq_len = built = build(axes, opts["zero"])
    except ValueError as e:
        raise SystemExit(f"funcpar: {e}") from None
    traced = trace_layout(build, axes, opts["zero"], ranking.gpu is not None, documents, built)
    print_plan(model, cfg, step, opts["zero"], opts["optimizer"], rows, seq_len,
               (lambda row, step: estimate(row, axes, step)) if estimate else None, gpu=ranking.gpu is not None,
               documents=documents, traced=traced)


PLANNED_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb")  # what plan --devices tries on pipeline meshes


def _search_space(argv: list[str], opts, spec) -> dict[str, Any]:
    """What ``plan --devices`` searches besides the meshes: every ZeRO stage, remat on and off (where the model has
    it), every schedule and micro-batch count; a flag given on the command line (``--zero``, ``--remat`` or
    ``--no-remat``, ``--pipeline``, ``--micro-batches``) fixes its part instead."""
    def given(*flags):
        return any(a == f or a.startswith(f + "=") for a in argv for f in flags)
    return {"zeros": (opts["zero"],) if given("--zero") else (0, 1, 2, 3),
            "remats": (opts["remat"],) if given("--remat", "--no-remat") else (False, True) if spec.remat else
            (None,),
            "schedules": (opts["pipeline"],) if given("--pipeline") else PLANNED_SCHEDULES,
            "search_micro": not given("--micro-batches")}


def _estimator(ranking, opts) -> Pricing | None:
    """How a traced step is priced (:class:`funcpar.cli.timing.Pricing`): on the GPUs ``--gpu`` names (``--links``
    between them, ``--efficiency`` their matmuls' share), or on this machine's CPU when the plan is for it (its
    ranks sharing its cores); None for a plan on a GPU without ``--gpu``."""
    if ranking.gpu:
        links = tuple(ranking.links.split(",")) if ranking.links else DEFAULT_LINKS.get(ranking.gpu,
                                                                                        ("nvlink", "ib400"))
        if len(links) != 2 or any(x not in LINKS for x in links):
            raise SystemExit(f"funcpar: --links takes two of {', '.join(LINKS)} (within a node, between nodes), not "
                             f"'{ranking.links}'")
        dev = DEVICES[ranking.gpu]
        if ranking.efficiency is not None:
            dev = dataclasses.replace(dev, ceiling={k: ranking.efficiency for k in dev.ceiling})
        return Pricing(dev, links, ranking.gpus_per_node)
    if _plan_device(opts["device"], None, {}).type != "cpu":
        return None
    threads = ranking.threads or max(1, int(os.environ.get("OMP_NUM_THREADS") or 1))
    return Pricing(host_device(threads), ("loopback", "loopback"), host=True, threads=threads)


def _micro_batches(opts, axes: dict, size: int | None, blocks: int) -> int:
    """The micro-batches a planned mesh runs: each data rank's rows (``blocks``: the data axes' ranks) over ``size``
    rows a micro-batch (``--micro-batch-size``) when given; else ``--micro-batches``, and on pipeline
    stages (``pp`` > 1) at least twice the stages where it gives fewer (a pipeline of as many micro-batches as stages
    idles half its time), the smallest such count that splits each data rank's rows, else ``--micro-batches`` as
    given."""
    rows = opts["global_batch"] // blocks
    if size:
        if rows % size:
            raise ValueError(f"a data rank's {rows} rows do not split into micro-batches of {size}")
        return rows // size
    micro, pp = opts["micro_batches"], axes.get("pp", 1)
    if pp <= 1 or micro >= 2 * pp:
        return micro
    return next((m for m in range(2 * pp, rows + 1) if rows % m == 0), micro)


def _plan_device(device: str, gpu: str | None, axes: dict) -> "torch.device":
    """The device rank 0 of a planned mesh computes on: ``cuda`` when asked (``--device cuda``) or when the plan is
    for GPUs (``--gpu``), whether or not this machine has one (the trace's meta tensors stand for it:
    ``planning._GpusOnMeta``); otherwise what ``--device`` gives here (auto: cuda when this node has a GPU for each
    rank)."""
    if gpu is not None and device in ("auto", "cuda") or device == "cuda":
        return torch.device("cuda", 0)
    if isinstance(device, str) and device.startswith("cuda:"):
        return torch.device(device)
    return resolve_device(device, local_rank=0, local_world=math.prod(axes.values()) or 1)[0]


def _check_ranking(ranking) -> None:
    """``funcpar plan``'s own numbers in range: a count of devices (not 0, which would plan --mesh instead), a memory
    and an efficiency that are positive numbers (not NaN, which nothing fits under without a word)."""
    if ranking.devices is not None and ranking.devices < 1:
        raise SystemExit(f"funcpar: --devices {ranking.devices}: expected the number of devices to rank meshes of "
                         f"(1 or more)")
    if not ranking.memory > 0:
        raise SystemExit(f"funcpar: --memory {ranking.memory:g}: expected each device's memory in GiB, a positive "
                         f"number (e.g. 80)")
    if ranking.gpus_per_node < 1:
        raise SystemExit(f"funcpar: --gpus-per-node {ranking.gpus_per_node}: expected 1 or more")
    if ranking.efficiency is not None and not 0 < ranking.efficiency <= 1:
        raise SystemExit(f"funcpar: --efficiency {ranking.efficiency:g}: expected the share of the datasheet's "
                         f"matmul rate a large matmul reaches, above 0 and at most 1 (default "
                         f"{GPU_REACHED['ceiling']['half']:.2f}, measured)")
    if ranking.micro_batch_size is not None and ranking.micro_batch_size < 1:
        raise SystemExit(f"funcpar: --micro-batch-size {ranking.micro_batch_size}: expected rows a micro-batch, 1 or "
                         f"more")
    if not ranking.search_seconds > 0:
        raise SystemExit(f"funcpar: --search-seconds {ranking.search_seconds:g}: expected seconds to search, above 0")
    if ranking.threads is not None and ranking.threads < 1:
        raise SystemExit(f"funcpar: --threads {ranking.threads}: expected threads a rank, 1 or more")


def _to_checkpoint(src: Path, dst: str, mesh, overwrite: bool) -> str:
    """An HF folder's weights as a parameters-only funcpar checkpoint (a fresh optimizer on resume)."""
    params, cfg = fp.hf.load(src, mesh=mesh)
    model = fp.get_model(cfg.model_type)
    step = fp.compile_step(lambda p, b: 0.0, model.specs(cfg, mesh), mesh=mesh, optimizer=fp.optim.sgd(0.0))
    step.init(params)
    extra = {"model": cfg.model_type, "generic": generic_path(cfg), "config": cfg.to_hf()}
    step.save(dst, fp.TrainState(params, None, 0), extra=extra,
              overwrite=overwrite, latest=False)  # DST is the checkpoint: nothing is written beside it
    return "funcpar checkpoint"


def _to_hf(src: Path, dst: str, mesh, max_shard_size, overwrite: bool, tokenizer=None) -> str:
    """A funcpar checkpoint (one that records its model config) exported as a transformers folder, with
    ``tokenizer``'s files when given."""
    extra = fp.checkpoint.metadata(src).get("extra") or {}  # verified: schema and checksum
    if "config" not in extra:
        raise SystemExit(f"funcpar: {src} does not record its model config (saved by funcpar train/convert?)")
    if extra.get("lora"):
        lo, run = extra["lora"], src.parent if src.name == "checkpoints" else src.parent.parent
        raise SystemExit(f"funcpar: {src} holds LoRA adapters (r={lo['r']}, alpha={lo['alpha']}, targets "
                         f"{','.join(lo['targets'])}), not a model: funcpar convert exports whole models. Its run "
                         f"wrote the model with the adapters merged to {run / 'hf'} and the adapters alone (a PEFT "
                         f"folder) to {run / 'adapter'}")
    model = fp.get_model(extra["model"], generic=bool(extra.get("generic")))
    fp.checkpoint.export_hf(src, dst, model, model.config(extra["config"], mesh), mesh, max_shard_size=max_shard_size,
                            overwrite=overwrite, tokenizer=tokenizer)
    return "transformers folder"


def _run_tokenizer(src: Path, speak: bool):
    """The tokenizer a run trained with, from its checkpoint ``src`` (``--tokenizer``, as the checkpoint records
    it, with the chat template its config.json names), so that ``convert RUN DST`` writes the tokenizer files its
    hf/ export has; None where it records none (a converted HF folder) or the folder is not there any more
    (said)."""
    name = (fp.checkpoint.metadata(src).get("extra") or {}).get("tokenizer")
    if not isinstance(name, str) or not name:
        return None
    run = src.parent if src.name == "checkpoints" else src.parent.parent
    saved = saved_run_options(run / "config.json") or {}
    chat = saved.get("chat_template", DEFAULTS["chat_template"])
    if name != "byte" and not Path(name).is_dir() and Path(str(saved.get("tokenizer") or name)).is_dir():
        name = str(saved["tokenizer"])  # (a relative path the run was given: its config.json holds it absolute)
    if name != "byte" and not Path(name).is_dir():
        if speak:
            print(f"funcpar: warning: the run's tokenizer {name} is not there: the export gets no tokenizer files "
                  f"(give --tokenizer FOLDER)", flush=True)
        return None
    return tokenizer({**DEFAULTS, "tokenizer": name, "chat_template": chat})


def convert(argv: list[str]) -> None:
    """HF folder -> funcpar checkpoint (parameters; a fresh optimizer on resume), or checkpoint -> HF folder."""
    ap = argparse.ArgumentParser(prog="funcpar convert", description=convert.__doc__)
    ap.add_argument("src", help="an HF model folder (with config.json), a funcpar checkpoint (or the folder holding "
                                "its 'latest'), or a run folder (--out of funcpar train: its latest checkpoint)")
    ap.add_argument("dst", help="the folder to write: a funcpar checkpoint from an HF folder, a transformers "
                                "folder from a checkpoint; never SRC or a folder inside it")
    ap.add_argument("--mesh", default="1", help="the ranks to convert with (default 1)")
    ap.add_argument("--max-shard-size", default="2GB", help="the largest safetensors file of an HF export")
    ap.add_argument("--tokenizer", help="a tokenizer folder (or 'byte') whose files the HF export gets, so that "
                                        "transformers.pipeline loads it")
    ap.add_argument("--overwrite", action="store_true", help="replace DST even if funcpar did not write it, or "
                                                             "wrote it as another kind of folder or for another run")
    args = ap.parse_args(argv)
    src, dst = Path(args.src), Path(args.dst)
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise SystemExit(f"funcpar: convert {src} {dst}: the destination is the source or inside it; write to "
                         f"another folder")
    if (src / "config.json").is_file() and run_files(src) and (src / "checkpoints").is_dir():
        src = src / "checkpoints"  # a run folder: its config.json holds funcpar's options; its latest checkpoint
    sizes = parse_mesh(args.mesh)
    if launch_if_needed(["convert", *argv], math.prod(sizes.values()) if sizes else 1):
        return
    mesh = fp.Mesh(**sizes)
    if (src / "config.json").exists():
        what = _to_checkpoint(src, args.dst, mesh, args.overwrite)
    else:
        tok = (tokenizer({**DEFAULTS, "tokenizer": args.tokenizer}) if args.tokenizer else
               _run_tokenizer(src, mesh.rank == 0))
        what = _to_hf(src, args.dst, mesh, args.max_shard_size, args.overwrite, tok)
    if mesh.rank == 0:
        print(f"wrote {what} {args.dst}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:  # tracebacks and torchrun's logs; the workers inherit it
        argv.remove("--debug")
        os.environ["FUNCPAR_DEBUG"] = "1"
    commands = {"train": train, "plan": plan, "convert": convert}
    if argv[:1] == ["--version"]:
        print(f"funcpar {fp.__version__} (torch {torch.__version__})")
        return
    if not argv or argv[0] not in commands:
        unknown = bool(argv) and argv[0] not in ("-h", "--help")
        if unknown:
            print(f"funcpar: unknown command '{argv[0]}'", file=sys.stderr)
        print("usage: funcpar {train,plan,convert} [options] [--debug]   (funcpar COMMAND --help for options; "
              "funcpar --version)")
        if unknown:
            raise SystemExit(2)
        return
    try:
        commands[argv[0]](argv[1:])
    except SystemExit as e:
        if not isinstance(e.code, str) or "RANK" not in os.environ:
            raise
        fail(e.code, retry=False)  # (a refusal: a restart would refuse again)
    except USER_ERRORS as e:
        if debug():
            raise
        fail(f"funcpar: {e}", retry=not isinstance(e, ValueError))  # (funcpar's own errors: the same again)
    except KeyboardInterrupt:  # before training started (or a second Ctrl-C): nothing to save
        if debug():
            raise
        fail("funcpar: interrupted", code=INTERRUPTED)


def entry() -> None:
    """The command line (``python -m funcpar``, the ``funcpar`` script): :func:`main`, ending the process promptly."""
    run_and_exit(main)


if __name__ == "__main__":
    entry()
