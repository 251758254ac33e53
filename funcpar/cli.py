"""``funcpar train / plan / convert``: the command-line face of the Python API.

Run bare, ``funcpar train`` starts one process per mesh rank on this machine through ``torch.distributed.run``;
under ``torchrun`` (one node or many) it uses the world it is given. Options come from defaults, then a TOML/JSON
``--config`` file, then the command line. This module only parses options and wires the library together
(models from the registry, :mod:`funcpar.generate`, :mod:`funcpar.plot`, :mod:`funcpar.planning`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import funcpar as fp
from funcpar.assets import ARITHMETIC
from funcpar.generate import show_arithmetic
from funcpar.planning import params_like, print_plan, sharding_table
from funcpar.plot import plot_metrics

DEFAULTS: dict[str, Any] = {  # in the order --help lists them
    "model": "llama-tiny", "mesh": "tp=2,dp=2", "data": "builtin:arithmetic", "tokenizer": "byte", "seq_len": 64,
    "pack": True, "global_batch": 32, "micro_batches": 1, "optimizer": "adamw", "lr": 3e-3,
    "schedule": "warmup_cosine", "warmup": 20, "weight_decay": 0.01, "zero": 1, "clip": 1.0, "precision": "fp32",
    "remat": False, "steps": 300, "eval_every": 100, "eval_fraction": 0.05, "save_every": 100, "keep": 2,
    "log_every": 20, "out": "out", "resume": False, "seed": 0,
}

_LLAMA_TINY = dict(vocab_size=264, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=False, model_type="llama")
BUILTIN_MODELS = {
    # small Llamas for the byte tokenizer (259 tokens, vocabulary rounded up to a multiple of 8 for tp)
    "llama-tiny": _LLAMA_TINY,
    "llama-micro": {**_LLAMA_TINY, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
}


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=2,dp=2"`` -> ``{"tp": 2, "dp": 2}``; ``""`` or ``"1"`` -> ``{}`` (one process).

    Any identifier names an axis (``"tp=2,dp=2,ep=2"``); ``pp``, ``dp`` and ``tp`` are the ones funcpar itself uses.
    """
    out: dict[str, int] = {}
    if text.strip() in ("", "1"):
        return out
    for part in text.split(","):
        key, _, val = part.partition("=")
        key = key.strip()
        if not key.isidentifier() or not val.strip().isdigit():
            raise SystemExit(f"funcpar: bad --mesh '{text}': expected e.g. 'tp=2,dp=2' or 'dp=2,ep=2,tp=2' "
                             f"(axis=size pairs; axes pp, dp, tp or any other name)")
        out[key] = int(val)
    return out


def _read_config(path: str) -> dict[str, Any]:
    p = Path(path)
    if p.suffix == ".toml":
        import tomllib

        return tomllib.loads(p.read_text())
    return json.loads(p.read_text())


def _options(argv: list[str], command: str) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog=f"funcpar {command}", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a TOML or JSON file of options (command-line flags override it)")
    for key, default in DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(default, bool):
            ap.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None)
        else:
            ap.add_argument(flag, dest=key, type=type(default) if default is not None else str, default=None)
    args = ap.parse_args(argv)
    opts = dict(DEFAULTS)
    if args.config:
        cfg = _read_config(args.config)
        unknown = sorted(set(cfg) - set(DEFAULTS))
        if unknown:
            raise SystemExit(f"funcpar: unknown option(s) in {args.config}: {', '.join(unknown)}")
        opts.update(cfg)
    opts.update({k: v for k, v in vars(args).items() if v is not None and k != "config"})
    return opts


def _launch_if_needed(argv: list[str], nproc: int) -> bool:
    """Outside torchrun with a multi-rank mesh: run this same command under torch.distributed.run. True if done."""
    if nproc <= 1 or "RANK" in os.environ:
        return False
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "funcpar", *argv])
    return True


# ------------------------------------------------------------------------------------------ model, data, step


def _model_config(name: str, mesh):
    """``(model, cfg)`` for a built-in model name or an HF folder's ``config.json``, padded for ``mesh``."""
    if name in BUILTIN_MODELS:
        raw = BUILTIN_MODELS[name]
    elif Path(name).is_dir():
        raw = json.loads((Path(name) / "config.json").read_text())
    else:
        raise SystemExit(f"funcpar: --model '{name}' is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor a folder")
    model = fp.get_model(raw.get("model_type"))
    return model, model.config(raw, mesh)


def _model(opts, mesh):
    """``(model, cfg, params, specs)``: a built-in model freshly initialised, or an HF folder's weights."""
    name = opts["model"]
    if name not in BUILTIN_MODELS and Path(name).is_dir():
        params, cfg = fp.hf.load(name, mesh=mesh)
        model = fp.get_model(cfg.model_type)
        return model, cfg, params, model.specs(cfg, mesh)
    model, cfg = _model_config(name, mesh)  # a built-in one (or a SystemExit naming them)
    specs = model.specs(cfg, mesh)
    torch.manual_seed(opts["seed"])
    return model, cfg, fp.shard(model.init(cfg, seed=opts["seed"]), specs, mesh), specs


def _datasets(opts, cfg):
    """``(data, train_data, eval_data)``: the tokenized samples and their train / held-out split."""
    tok = fp.data.ByteTokenizer() if opts["tokenizer"] == "byte" else fp.data.HFTokenizer(opts["tokenizer"])
    samples = fp.data.load_samples(ARITHMETIC if opts["data"] == "builtin:arithmetic" else opts["data"])
    data = fp.data.Dataset.from_samples(samples, tok, opts["seq_len"], pack=opts["pack"])
    train_data, eval_data = data.split(opts["eval_fraction"], seed=opts["seed"])
    if int(data.ids.max()) >= cfg.vocab_size:
        raise SystemExit(f"funcpar: the tokenizer produced id {int(data.ids.max())}, beyond the model's vocab_size "
                         f"{cfg.vocab_size}")
    return data, train_data, eval_data


def _optimizer(opts):
    lr, steps, warmup = opts["lr"], opts["steps"], min(opts["warmup"], max(opts["steps"] - 1, 0))
    schedules = {"constant": lambda: fp.optim.constant(lr),
                 "warmup_cosine": lambda: fp.optim.warmup_cosine(lr, warmup, max(steps, warmup + 1), end=lr / 10),
                 "warmup_linear": lambda: fp.optim.warmup_linear_decay(lr, warmup, steps, warmup_type="linear")}
    if opts["schedule"] not in schedules:
        raise SystemExit(f"funcpar: unknown --schedule '{opts['schedule']}' (constant, warmup_cosine, warmup_linear)")
    sched, wd = schedules[opts["schedule"]](), opts["weight_decay"]
    optimizers = {"adamw": lambda: fp.optim.adamw(sched, b2=0.95, weight_decay=wd),
                  "lion": lambda: fp.optim.lion(sched, weight_decay=wd),
                  "sgd": lambda: fp.optim.sgd(sched, momentum=0.9)}
    if opts["optimizer"] not in optimizers:
        raise SystemExit(f"funcpar: unknown --optimizer '{opts['optimizer']}' (adamw, lion, sgd)")
    return optimizers[opts["optimizer"]]()


def _compile(opts, model, cfg, mesh, specs) -> fp.Step:
    """The train step: the model's loss (with its micro-batch weighting, and remat if asked) and the options."""
    precisions = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if opts["precision"] not in precisions:
        raise SystemExit(f"funcpar: unknown --precision '{opts['precision']}' (fp32, bf16, fp16)")
    if opts["remat"] and not model.remat:
        raise SystemExit(f"funcpar: --remat is not supported by model '{model.name}' (it has no activation "
                         f"checkpointing); train it without --remat")
    return fp.compile_step(model.loss_fn(cfg, mesh, remat=opts["remat"]), specs, mesh=mesh,
                           optimizer=_optimizer(opts), zero=opts["zero"], accum_steps=opts["micro_batches"],
                           clip_norm=opts["clip"] or None, param_dtype=precisions[opts["precision"]])


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

    def __post_init__(self):
        self.rank0, self.out = self.mesh.rank == 0, Path(self.opts["out"])
        self.ckpts, self.metrics_file = self.out / "checkpoints", self.out / "metrics.jsonl"

    def save(self) -> None:
        """A checkpoint of the state and the data position at the current step (keeping the last ``--keep``)."""
        extra = {"model": self.cfg.model_type, "config": self.cfg.to_hf(), "tokenizer": self.opts["tokenizer"],
                 "data": self.loader.state_dict()}
        self.step.save(self.ckpts / f"step-{self.state.step}", self.state, extra=extra, keep=self.opts["keep"])


def _setup_run(opts, sizes) -> _Run:
    """Build the mesh, model, data, train step, its initial state and the data loader."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    mesh = fp.Mesh(**sizes)
    model, cfg, params, specs = _model(opts, mesh)
    data, train_data, eval_data = _datasets(opts, cfg)
    step = _compile(opts, model, cfg, mesh, specs)
    state = step.init(params)
    loader = fp.data.Loader(train_data, mesh, opts["global_batch"], seed=opts["seed"])
    return _Run(opts, mesh, model, cfg, specs, data, train_data, eval_data, step, state, loader)


def _resume(run: _Run) -> None:
    """With ``--resume`` and a checkpoint in the output folder: continue from its state and data position."""
    if run.opts["resume"] and (run.ckpts / "latest").exists():
        run.state, extra = fp.checkpoint.load(run.ckpts, run.step)
        run.loader.load_state_dict(extra["data"])
        if run.rank0:
            print(f"resumed from {fp.checkpoint.resolve(run.ckpts)} at step {run.state.step}", flush=True)


def _announce(run: _Run) -> None:
    """Rank 0: trim metrics.jsonl to the steps done so far, print the run and its sharding table."""
    if not run.rank0:
        return
    opts, step, mesh = run.opts, run.state.step, run.mesh
    run.out.mkdir(parents=True, exist_ok=True)
    old = run.metrics_file.read_text().splitlines() if run.metrics_file.exists() and step else []
    kept = [line for line in old if json.loads(line).get("step", 0) <= step]
    run.metrics_file.write_text("".join(line + "\n" for line in kept))
    print(f"funcpar train: {run.cfg.model_type} on {mesh!r} ({mesh.size} process(es), {mesh.device.type}), "
          f"{len(run.train_data)} train rows x {opts['seq_len']} tokens, {len(run.eval_data)} held-out rows"
          + (f", {run.data.truncated} samples truncated" if run.data.truncated else ""), flush=True)
    print(sharding_table(params_like(run.model, run.cfg), run.specs, mesh), flush=True)


def _evaluate(model, cfg, params, data, mesh, global_batch) -> float:
    """Mean held-out token loss over the whole eval set, split over dp."""
    dp = mesh.axis_size("dp")
    gb = max(dp, min(global_batch, len(data)) // dp * dp)
    loader = fp.data.Loader(data, mesh, gb, shuffle=False)
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(max(1, len(data) // gb)):
            b = next(loader)
            loss = model.loss(params, b, cfg=cfg, mesh=mesh, reduction="sum").item()
            total += torch.tensor([loss, fp.layers.count_targets(b)], dtype=torch.float64)
    total = fp.collectives.all_reduce(total, mesh, "dp")
    return (total[0] / total[1].clamp(min=1)).item()


def _metrics_row(run: _Run, m: dict) -> dict:
    """The metrics.jsonl row of the step just taken, with the held-out loss on eval steps."""
    opts = run.opts
    row = {k: m[k] for k in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "loss_scale", "skipped") if k in m}
    row["truncated"] = run.data.truncated
    if opts["eval_every"] and (run.state.step % opts["eval_every"] == 0 or run.state.step == opts["steps"]):
        ev = _evaluate(run.model, run.cfg, run.step.gather_params(run.state), run.eval_data, run.mesh, opts["global_batch"])
        row |= {"eval_loss": ev, "eval_ppl": math.exp(min(ev, 50))}
    return row


def _log(run: _Run, row: dict, m: dict, bar, t_start: float) -> None:
    """Rank 0: append the row to metrics.jsonl; advance the progress bar, or print a log line when due."""
    if not run.rank0:
        return
    step, steps = run.state.step, run.opts["steps"]
    with open(run.metrics_file, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    if bar is not None:
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
        bar.update(1)
    elif step % run.opts["log_every"] == 0 or step == steps or "eval_loss" in row:
        eta = (time.time() - t_start) / max(1, step) * (steps - step)
        ev = f"  eval {row['eval_loss']:.4f} (ppl {row['eval_ppl']:.2f})" if "eval_loss" in row else ""
        print(f"step {step:5d}/{steps}  loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.3f}  "
              f"lr {m['lr']:.2e}  {m['tokens_per_s']:.0f} tok/s  eta {eta:.0f}s{ev}", flush=True)


def _loop(run: _Run) -> float | None:
    """Train up to ``--steps``, logging, evaluating and checkpointing as asked; returns the first step's loss."""
    opts, bar = run.opts, None
    if run.rank0 and sys.stdout.isatty():
        from tqdm import tqdm

        bar = tqdm(total=opts["steps"], initial=run.state.step, desc="train", dynamic_ncols=True)
    t_start, first_loss = time.time(), None
    while run.state.step < opts["steps"]:
        run.state, m = run.step(run.state, next(run.loader))
        first_loss = m["loss"] if first_loss is None else first_loss
        _log(run, _metrics_row(run, m), m, bar, t_start)
        if opts["save_every"] and run.state.step % opts["save_every"] == 0 and run.state.step < opts["steps"]:
            run.save()
    if bar is not None:
        bar.close()
    return first_loss


def _finish(run: _Run, first_loss: float | None) -> None:
    """The last checkpoint, the transformers export, and on rank 0 the loss plot, a summary and the answer check."""
    run.save()
    fp.hf.save(run.out / "hf", run.step.gather_params(run.state), run.model, run.cfg, run.mesh, specs=run.specs)
    if not run.rank0:
        return
    plot_metrics(run.metrics_file, run.out / "loss.png")
    last = json.loads(run.metrics_file.read_text().splitlines()[-1])
    print(f"loss {first_loss if first_loss is not None else float('nan'):.4f} -> {last['loss']:.4f}; "
          f"wrote {run.ckpts}, {run.metrics_file}, {run.out / 'loss.png'} and a transformers folder {run.out / 'hf'}",
          flush=True)
    if run.opts["data"] == "builtin:arithmetic" and run.opts["tokenizer"] == "byte":
        show_arithmetic(run.out / "hf", run.model)


def train(argv: list[str]) -> None:
    """Train a model on a mesh (starting the ranks here unless under torchrun), then export it."""
    opts = _options(argv, "train")
    sizes = parse_mesh(opts["mesh"])
    if _launch_if_needed(["train", *argv], math.prod(sizes.values()) if sizes else 1):
        return
    run = _setup_run(opts, sizes)
    _resume(run)
    _announce(run)
    _finish(run, first_loss=_loop(run))


# --------------------------------------------------------------------------------------------- plan, convert


def plan(argv: list[str]) -> None:
    """Print the sharding table and per-rank memory for a model on a mesh, without starting processes."""
    opts = _options(argv, "plan")
    mesh = fp.Mesh.abstract(**parse_mesh(opts["mesh"]))
    model, cfg = _model_config(opts["model"], mesh)
    print_plan(model, cfg, mesh, opts["zero"], opts["optimizer"])


def _to_checkpoint(src: Path, dst: str, mesh) -> str:
    """An HF folder's weights as a parameters-only funcpar checkpoint (a fresh optimizer on resume)."""
    params, cfg = fp.hf.load(src, mesh=mesh)
    model = fp.get_model(cfg.model_type)
    step = fp.compile_step(lambda p, b: 0.0, model.specs(cfg, mesh), mesh=mesh, optimizer=fp.optim.sgd(0.0))
    step.init(params)
    fp.checkpoint.save(dst, fp.TrainState(params, None, 0), mesh,
                       extra={"model": cfg.model_type, "config": cfg.to_hf()}, step=step)
    return "funcpar checkpoint"


def _to_hf(src: Path, dst: str, mesh, max_shard_size) -> str:
    """A funcpar checkpoint (one that records its model config) exported as a transformers folder."""
    extra = json.loads((fp.checkpoint.resolve(src) / "meta.json").read_text()).get("extra") or {}
    if "config" not in extra:
        raise SystemExit(f"funcpar: {src} does not record its model config (saved by funcpar train/convert?)")
    model = fp.get_model(extra["model"])
    fp.checkpoint.export_hf(src, dst, model, model.config(extra["config"], mesh), mesh, max_shard_size=max_shard_size)
    return "transformers folder"


def convert(argv: list[str]) -> None:
    """HF folder -> funcpar checkpoint (parameters; a fresh optimizer on resume), or checkpoint -> HF folder."""
    ap = argparse.ArgumentParser(prog="funcpar convert", description=convert.__doc__)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--mesh", default="1")
    ap.add_argument("--max-shard-size", default="2GB")
    args = ap.parse_args(argv)
    sizes = parse_mesh(args.mesh)
    if _launch_if_needed(["convert", *argv], math.prod(sizes.values()) if sizes else 1):
        return
    mesh, src = fp.Mesh(**sizes), Path(args.src)
    if (src / "config.json").exists():
        what = _to_checkpoint(src, args.dst, mesh)
    else:
        what = _to_hf(src, args.dst, mesh, args.max_shard_size)
    if mesh.rank == 0:
        print(f"wrote {what} {args.dst}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": train, "plan": plan, "convert": convert}
    if not argv or argv[0] not in commands:
        unknown = bool(argv) and argv[0] not in ("-h", "--help")
        if unknown:
            print(f"funcpar: unknown command '{argv[0]}'", file=sys.stderr)
        print("usage: funcpar {train,plan,convert} [options]   (funcpar COMMAND --help for options)")
        if unknown:
            raise SystemExit(2)
        return
    try:
        commands[argv[0]](argv[1:])
    except fp.ModelError as e:  # an unknown model_type, or a capability the model lacks
        raise SystemExit(f"funcpar: {e}") from None


if __name__ == "__main__":
    main()
