"""The options of a run and what they build: defaults, then a TOML/JSON ``--config`` file, then the command line;
from them the model (a built-in name or an HF folder), the data, the optimizer and the train step. Shared by
``funcpar train`` and ``funcpar plan`` (:mod:`funcpar.cli.main`), which trace or run the same step.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

import funcpar as fp
from funcpar.assets import ARITHMETIC
from funcpar.parallel.mesh import CONTEXT_LAYOUTS, DEVICES

DEFAULTS: dict[str, Any] = {  # in the order --help lists them
    "model": "llama-tiny", "mesh": "tp=2,dp=2", "device": "auto", "data": "builtin:arithmetic", "tokenizer": "auto",
    "token_cache": "auto",
    "seq_len": 64, "pack": True, "cross_document": False, "global_batch": 32, "micro_batches": 1,
    "optimizer": "adamw", "lr": 3e-3,
    "pipeline": "1f1b", "chunks": 0, "parts": "", "schedule": "warmup_cosine", "warmup": 20, "weight_decay": 0.01,
    "zero": 1, "clip": 1.0, "precision": "fp32", "remat": False, "sequence_parallel": False, "offload": False,
    "compile": "auto", "final_lr": 0.1,
    "cp_layout": "zigzag", "lora": "", "steps": 300,
    "epochs": 0, "eval_every": 100, "eval_fraction": 0.05, "eval_data": "", "save_every": 100, "keep": 2,
    "log_every": 20, "out": "out", "resume": False, "overwrite": False, "seed": 0,
    "heartbeat": 60.0, "chat_template": "auto", "max_restarts": 0, "export_dtype": "auto",
    "sample_prompts": "", "sample_tokens": 32, "track": "", "project": "funcpar",
}

HELP = {
    "model": "a built-in model (llama-tiny, llama-micro) or an HF folder to fine-tune",
    "mesh": "axis sizes, e.g. tp=2,dp=2 or pp=2,dp=2 ('1': one process); the ranks start here unless under torchrun",
    "device": "where the ranks run: cuda (one GPU per rank, refused when a node's ranks outnumber its GPUs), cpu, "
              "or auto: cuda when every rank of the node has a GPU, else cpu with a warning",
    "data": "a .jsonl/.txt file or a folder of them, or builtin:arithmetic (README: the formats and their text); "
            "several mixed by weight: a.jsonl:0.7,b.txt:0.3 (each batch draws those shares of its rows)",
    "token_cache": "where sources are tokenized once and read by every later run and rank: auto (sources "
                   "of 256 MiB or more, under $FUNCPAR_TOKEN_CACHE or ~/.cache/funcpar/tokens), a folder (every "
                   "source), or off (tokenize in memory each run)",
    "tokenizer": "auto (the --model folder's own tokenizer; byte for a built-in model), byte, or a folder with an "
                 "HF tokenizer", "seq_len": "tokens per row",
    "pack": "pack samples into rows (--no-pack: one sample per row, padded)",
    "cross_document": "let a packed sample attend to the samples before it in its row, at the row's positions (the "
                      "default keeps each sample to itself, positions from 0, as if run alone; models without "
                      "document support always pack this way)",
    "global_batch": "rows per optimizer step, over all dp ranks and micro-batches",
    "micro_batches": "micro-batches accumulated per step (the pipeline's micro-batches with pp)",
    "optimizer": "adamw, lion or sgd", "lr": "peak learning rate",
    "pipeline": "schedule with pp > 1: 1f1b, gpipe, interleaved or zb (zero bubble)",
    "chunks": "virtual stages per pp rank (interleaved, zb)",
    "parts": "layers per pipeline stage, e.g. 3,5 or 2.5,1.5 (default: balanced by weight, head included)",
    "schedule": "warmup_cosine, warmup_linear or constant", "warmup": "warmup steps",
    "weight_decay": "decoupled weight decay (not on norms and biases)", "zero": "ZeRO stage: 0, 1, 2 or 3",
    "clip": "clip the global gradient norm to this (0: off)", "precision": "fp32, bf16 or fp16 (with loss scaling)",
    "remat": "recompute activations in the backward pass (less memory)",
    "offload": "keep the optimizer state and the master weights in host memory (GPU memory for larger models; the "
               "update runs on the host)",
    "compile": "torch.compile the gradient: auto (on a GPU, where it pays), on or off",
    "final_lr": "the learning rate the warmup_cosine schedule ends at, as a fraction of --lr",
    "sequence_parallel": "between tp regions each tp rank keeps its block of the sequence (less activation memory; "
                         "--seq-len a multiple of tp; llama-family and gpt2)", "steps": "optimizer steps to train",
    "cp_layout": "how --mesh cp=N splits each sequence: zigzag (rank c: pieces c and 2N-1-c of 2N, balanced "
                 "attention work; --seq-len a multiple of 2N) or contiguous (rank c: chunk c of N)",
    "lora": "train low-rank adapters, the base frozen: r=16,alpha=32,targets=q,v[,dropout=0.05]; exports the merged "
            "model to hf/ and a PEFT adapter folder to adapter/",
    "eval_every": "held-out loss every N steps and at the end (0: never)",
    "eval_fraction": "share of each source's rows held out for evaluation, at most 2000 rows each (without "
                     "--eval-data)",
    "eval_data": "held-out data (a file or folder, --data's formats): the held-out loss is computed on it, and every "
                 "row of --data trains",
    "epochs": "passes over the training rows: sets --steps to epochs x (rows // --global-batch); not together with "
              "--steps (0: --steps decides)",
    "save_every": "checkpoint every N steps (0: only at the end)",
    "keep": "checkpoints of this run to keep", "log_every": "a log line every N steps",
    "out": "the run folder: metrics.jsonl, loss.png, config.json, checkpoints/, hf/",
    "resume": "continue the run in --out from its latest checkpoint",
    "overwrite": "replace an earlier run in --out, or folders funcpar did not write",
    "seed": "initialisation, data order and split",
    "heartbeat": "seconds without progress after which a stuck rank is reported and the job ends (0: off)",
    "chat_template": "conversations through the HF tokenizer's chat_template when it has one (auto), or "
                     "funcpar's User:/Assistant: template (builtin)",
    "sample_prompts": "a .txt file of prompts (one a line; \\n for a newline) or .jsonl of {\"prompt\": text or "
                      "messages} or {\"messages\": [...]} (through the chat template): at each evaluation their "
                      "greedy continuations by the model in training are printed and written to samples.jsonl (not "
                      "with pp or cp)",
    "sample_tokens": "tokens generated per prompt for --sample-prompts",
    "track": "experiment trackers besides TensorBoard, when installed: wandb, mlflow or wandb,mlflow (the run's "
             "options and every metrics row; a resumed run continues the same tracked run)",
    "project": "the wandb project or MLflow experiment of --track",
    "export_dtype": "the dtype of hf/'s weights: auto (the training dtype: --precision bf16 exports bf16), fp32 (with "
                    "bf16/fp16 the float32 master weights, not their roundings), bf16 or fp16",
    "max_restarts": "when a rank dies, restart every rank up to this many times (torchrun's restarts); restarted "
                    "ranks resume from the run's last complete checkpoint",
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
    ``dp=auto`` (under torchrun) is the ranks torchrun started over the other axes: an elastic job
    (``torchrun --nnodes MIN:MAX``) that restarts on fewer nodes resumes on a smaller data-parallel mesh.
    """
    out: dict[str, int] = {}
    if text.strip() in ("", "1"):
        return out
    auto = False
    for part in text.split(","):
        key, _, val = part.partition("=")
        key, val = key.strip(), val.strip()
        if key == "dp" and val == "auto":
            auto = True
            val = "1"
        if not key.isidentifier() or not val.isdigit():
            raise SystemExit(f"funcpar: bad --mesh '{text}': expected e.g. 'tp=2,dp=2' or 'dp=2,ep=2,tp=2' "
                             f"(axis=size pairs; axes pp, dp, tp or any other name; dp=auto under torchrun)")
        if key in out:
            raise SystemExit(f"funcpar: bad --mesh '{text}': axis '{key}' is given twice")
        out[key] = int(val)
    if auto:
        out["dp"] = _elastic_dp(text, out)
    return out


def _elastic_dp(text: str, sizes: dict[str, int]) -> int:
    """``dp=auto``: torchrun's world size over the product of the other axes."""
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise SystemExit(f"funcpar: --mesh {text}: dp=auto takes dp from the ranks torchrun starts (its world size "
                         f"over the other axes, for an elastic --nnodes MIN:MAX job); when funcpar starts the ranks, "
                         f"give dp=N")
    rest = math.prod(size for axis, size in sizes.items() if axis != "dp")
    if int(world) % rest:
        raise SystemExit(f"funcpar: --mesh {text}: torchrun started {world} ranks, not a multiple of the other "
                         f"axes' {rest}")
    return int(world) // rest


def _toml():
    """The TOML reader: the standard library's from Python 3.11, ``tomli`` (a dependency there) before."""
    try:
        import tomllib
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            raise SystemExit("funcpar: reading a TOML --config needs Python 3.11+ or the tomli package "
                             "(pip install tomli); or write the config as JSON") from None
    return tomllib


def _read_config(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"funcpar: --config {path}: no such file")
    try:
        cfg = _toml().loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except ValueError as e:  # TOMLDecodeError, JSONDecodeError
        kind = "TOML" if p.suffix == ".toml" else "JSON"
        raise SystemExit(f"funcpar: --config {path} is not valid {kind}: {e}") from None
    if not isinstance(cfg, dict):
        raise SystemExit(f"funcpar: --config {path} must hold a table of options, not a {type(cfg).__name__}")
    return cfg


# what shapes the step's memory; the rest: defaults
_PLAN_FLAGS = ("model", "mesh", "device", "seq_len", "global_batch", "micro_batches", "optimizer", "pipeline",
               "chunks", "parts", "zero", "precision", "remat", "sequence_parallel", "cp_layout", "offload", "compile",
               "cross_document")
_ABOUT = {"train": "Train a model on a mesh, evaluate and checkpoint it as it goes, then export a transformers folder.",
          "plan": "Print the sharding table and the traced per-rank memory of the train step, without processes."}


def read_options(argv: list[str], command: str, epilog: str | None = None, parents=()) -> dict[str, Any]:
    """The options of ``funcpar train`` or ``funcpar plan`` (its flags: those that shape the step). ``parents``:
    parsers of the command's own flags (``add_help=False``), parsed by the caller: listed in the usage line and
    ``--help``, never taken here (abbreviations are then off: ``--mem`` is not ``--memory``)."""
    ap = argparse.ArgumentParser(prog=f"funcpar {command}", description=_ABOUT[command], epilog=epilog,
                                 parents=list(parents), allow_abbrev=not parents)
    ap.add_argument("--config", help="a TOML or JSON file of options (command-line flags override it; a run's "
                                     "--out/config.json is one)")
    ap.add_argument("--debug", action="store_true", help="tracebacks and torchrun's own logs on errors")
    for key, default in DEFAULTS.items():
        if command == "plan" and key not in _PLAN_FLAGS:
            continue
        flag, text = "--" + key.replace("_", "-"), HELP[key] + (f" (default: {default})" if default != "" else "")
        if isinstance(default, bool):
            ap.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            ap.add_argument(flag, dest=key, type=type(default), default=None, help=text,
                            metavar=type(default).__name__.upper())
    args, unknown = ap.parse_known_args(argv)
    if unknown:
        flags = ["--config", "--debug"] + ["--" + k.replace("_", "-") for k in DEFAULTS
                                           if command != "plan" or k in _PLAN_FLAGS]
        flags += [f for p in parents for f in p._option_string_actions if f.startswith("--")]
        raise SystemExit(_unknown_flag(unknown[0], ap.prog, flags))
    opts = dict(DEFAULTS)
    if args.config:
        cfg = _read_config(args.config)
        unknown = sorted(set(cfg) - set(DEFAULTS))
        if unknown:
            raise SystemExit(f"funcpar: unknown option(s) in {args.config}: {', '.join(unknown)}")
        opts.update(cfg)
    opts.update({k: v for k, v in vars(args).items() if v is not None and k in DEFAULTS})
    _check_options(opts, args.config)
    return opts


def saved_run_options(path: Path) -> dict[str, Any] | None:
    """The options in ``path`` if it is a run's config.json (a non-empty object of funcpar's option names), else
    None (absent, unreadable, or a model's or anyone else's config.json)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and cfg and set(cfg) <= set(DEFAULTS) else None


def run_options(opts: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """``--resume`` without ``--config``: the run's own options (``--out``/config.json, written when it started)
    under the command line's flags, so that a resumed run is the run it continues unless a flag says otherwise. A
    flag that changes ``--steps`` is said (the learning-rate schedule is stretched or cut from the step resumed)."""
    saved = Path(opts["out"]) / "config.json"
    run = saved_run_options(saved) if opts["resume"] and "--config" not in argv else None
    if run is None:  # (none, or not a run's options: claim_out and the checkpoint say what the folder is)
        _one_length(opts, argv, None)
        return opts
    out = read_options(["--config", str(saved), *argv], "train")
    _one_length(out, argv, saved)
    if out["steps"] != run.get("steps", out["steps"]) and _speaks_for_the_job():
        print(f"funcpar: warning: --steps {out['steps']} differs from the run's {run['steps']}: its "
              f"{out['schedule']} learning-rate schedule is laid over {out['steps']} steps from here on, so the "
              f"rate at the step resumed changes too", flush=True)
    return out


def _given(argv: list[str]) -> dict[str, Any]:
    """The options the command line itself sets (as ``read_options`` parses it, abbreviations included)."""
    ap = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    ap.add_argument("--config")
    ap.add_argument("--debug", action="store_true", default=None)
    for key, default in DEFAULTS.items():
        kind = {"action": argparse.BooleanOptionalAction} if isinstance(default, bool) else {}
        ap.add_argument("--" + key.replace("_", "-"), dest=key, default=None, **kind)
    try:
        args, _ = ap.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit):  # (read_options has said what is wrong with argv already)
        return {}
    return {k: v for k, v in vars(args).items() if v is not None}


def _one_length(opts: dict[str, Any], argv: list[str], saved: Path | None) -> None:
    """Refuse ``--steps`` on the command line together with ``--epochs`` (there, in ``--config`` or in the resumed
    run's options ``saved``): each sets how long the run trains, and --epochs would silently decide."""
    given = _given(argv)
    if "steps" not in given or not opts["epochs"]:
        return
    where = ("" if "epochs" in given else f" (the run's, from {saved})" if saved is not None
             else f" (from {given.get('config')})")
    raise SystemExit(f"funcpar: --steps {opts['steps']} and --epochs {opts['epochs']}{where} both set how long the "
                     f"run trains (--epochs: {opts['epochs']} passes over the training rows, whatever --steps says): "
                     f"give one of them (--epochs 0 lets --steps decide)")


def _speaks_for_the_job() -> bool:
    """Whether this process says what the whole job would: a lone process or funcpar's launcher (whose ranks stay
    quiet), or rank 0 under a user's torchrun."""
    from funcpar.parallel.lifeline import LAUNCHER_ENV

    return "RANK" not in os.environ or (os.environ["RANK"] == "0" and os.environ.get(LAUNCHER_ENV) != "1")


PATH_OPTIONS = ("model", "data", "tokenizer", "out")  # options that may name files or folders


def saved_options(opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` as a run's config.json holds them: the paths made absolute (a --config read from another working
    directory, or ``--resume`` from one, names the same files); built-in names stay as they are."""
    out = dict(opts)
    for key in PATH_OPTIONS:
        v = out[key]
        if isinstance(v, str) and v not in BUILTIN_MODELS and not v.startswith("builtin:") and v != "byte" and (
                key == "out" or Path(v).exists()):
            out[key] = str(Path(v).resolve())
    return out


def _unknown_flag(arg: str, prog: str, flags: list[str]) -> str:
    """One line for an argument the command does not take, with the closest of its ``flags``."""
    import difflib

    close = difflib.get_close_matches(arg.split("=")[0], flags, n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]}?)" if close else f" ({prog} --help lists its options)"
    what = "option" if arg.startswith("-") else "argument"
    return f"funcpar: {prog.removeprefix('funcpar ')} takes no {what} '{arg}'{hint}"


_AT_LEAST = {"seq_len": 1, "global_batch": 1, "micro_batches": 1, "steps": 0, "warmup": 0, "weight_decay": 0,
             "clip": 0, "zero": 0, "eval_every": 0, "save_every": 0, "keep": 1, "log_every": 1, "chunks": 0,
             "eval_fraction": 0, "lr": 0, "heartbeat": 0, "max_restarts": 0, "epochs": 0, "final_lr": 0,
             "sample_tokens": 1}
_AT_MOST = {"zero": 3, "eval_fraction": 0.5, "final_lr": 1}
MIN_HEARTBEAT = 2.0  # seconds: below it a slow collective or a checkpoint write reads as a stuck rank
_CHOICES = {"device": DEVICES, "export_dtype": ("auto", "fp32", "bf16", "fp16"), "compile": ("auto", "on", "off")}


def _check_options(opts: dict[str, Any], config: str | None) -> None:
    """Every option of the type its default has, and numbers in their ranges: one clear line otherwise."""
    where = f" (from {config} or the command line)" if config else ""
    for key, default in DEFAULTS.items():
        v, kind = opts[key], type(default)
        ok = isinstance(v, bool) if kind is bool else (
            isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
            if kind in (int, float) else isinstance(v, str))
        if not ok:
            raise SystemExit(f"funcpar: --{key.replace('_', '-')} {v!r}{where}: expected {kind.__name__}")
        if key in _CHOICES and v not in _CHOICES[key]:
            raise SystemExit(f"funcpar: --{key.replace('_', '-')} {v!r}{where}: expected one of "
                             f"{', '.join(_CHOICES[key])}")
        if key == "heartbeat" and 0 < v < MIN_HEARTBEAT:
            raise SystemExit(f"funcpar: --heartbeat {v!r}{where}: a rank is declared stuck after this many seconds "
                             f"without progress; use 0 (off) or at least {MIN_HEARTBEAT:g} (a healthy step's "
                             f"collectives and checkpoints take longer than {v!r} s)")
        if key in _AT_LEAST and not (v >= _AT_LEAST[key] and v <= _AT_MOST.get(key, float("inf"))):
            hi = f" and at most {_AT_MOST[key]}" if key in _AT_MOST else ""
            raise SystemExit(f"funcpar: --{key.replace('_', '-')} {v!r}{where}: must be a number at least "
                             f"{_AT_LEAST[key]}{hi}")


# ------------------------------------------------------------------------------------------ model, data, step


def model_config(name: str, mesh):
    """``(model, cfg)`` for a built-in model name or an HF folder's ``config.json``, padded for ``mesh``."""
    if name in BUILTIN_MODELS:
        raw = BUILTIN_MODELS[name]
    elif Path(name).is_dir():
        raw = fp.hf.read_config(Path(name))  # an object, or an error naming the file
    else:
        raise SystemExit(f"funcpar: --model '{name}' is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor a folder")
    model = fp.get_model(raw.get("model_type"))
    if name in BUILTIN_MODELS:
        return model, model.config(raw, mesh)
    try:
        return model, model.config(raw, mesh)
    except ValueError as e:  # a key of the wrong type, a size the mesh cannot split: named with the file
        raise fp.hf.HFError(f"{Path(name) / 'config.json'}: {e}") from None


def build_params(opts, model, cfg, specs, mesh, keep=None):
    """This rank's parameters: a built-in model freshly initialised, or an HF folder's weights (only the leaves
    ``keep(path)`` accepts are read: a pipeline stage's, with ``keep=step.holds``), in float32 whatever the folder
    holds: the parameters (``--precision fp32``) or the masters mixed precision keeps (``bf16``, ``fp16``) are
    float32, so a bf16 checkpoint (most of the Hub's) does not train with bf16 weights and optimizer state."""
    name = opts["model"]
    if name not in BUILTIN_MODELS and Path(name).is_dir():
        return fp.hf.load(name, model=model, mesh=mesh, keep=keep, dtype=torch.float32)[0]
    torch.manual_seed(opts["seed"])
    return fp.shard(model.init(cfg, seed=opts["seed"]), specs, mesh)


def tokenizer_choice(opts) -> str:
    """``--tokenizer`` resolved: ``auto`` is the ``--model`` folder itself when it holds a tokenizer (what HF
    Trainer, TRL and torchtune train with: the model's ids, special tokens and chat template), ``byte`` for a
    built-in model; a folder without one is refused, naming both choices, rather than trained on bytes its
    vocabulary was not made for."""
    choice, model = opts["tokenizer"], opts["model"]
    if choice != "auto":
        return choice
    if model in BUILTIN_MODELS:
        return "byte"
    if fp.data.has_tokenizer(model):
        return str(model)
    raise SystemExit(f"funcpar: --model {model} holds no tokenizer (no tokenizer.json, tokenizer.model or vocab "
                     f"files): give --tokenizer FOLDER (the one the model was trained with), or --tokenizer byte "
                     f"(funcpar's 259 byte ids, for a model trained on them)")


def with_tokenizer(opts) -> dict[str, Any]:
    """``opts`` with ``--tokenizer auto`` resolved (:func:`tokenizer_choice`): what checkpoints and config.json
    record, so a resumed or converted run names the tokenizer it used."""
    return {**opts, "tokenizer": tokenizer_choice(opts)}


def tokenizer(opts):
    """The run's tokenizer: bytes, or an HF tokenizer folder (``auto``: :func:`tokenizer_choice`)."""
    if opts["chat_template"] not in ("auto", "builtin"):
        raise SystemExit(f"funcpar: --chat-template {opts['chat_template']!r}: expected auto or builtin")
    choice = tokenizer_choice(opts)
    if choice == "byte":
        return fp.data.ByteTokenizer()
    return fp.data.HFTokenizer(choice, chat_template=opts["chat_template"] == "auto")


def data_sources(text: str) -> list[tuple[str, float]]:
    """``--data``: ``PATH`` or ``PATH:WEIGHT,PATH:WEIGHT,...`` (a mixture; a missing weight is 1) as ``[(path,
    weight)]``; ``builtin:arithmetic`` is a path."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        path, _, tail = part.rpartition(":")
        try:
            weight = float(tail) if path else None
        except ValueError:
            weight = None
        if weight is None:
            path, weight = part, 1.0
        if not path or not 0 < weight < float("inf"):
            raise SystemExit(f"funcpar: bad --data '{text}': expected FILE or FILE:WEIGHT,FILE:WEIGHT,... (weights "
                             f"positive numbers)")
        out.append((path, weight))
    return out


def _source_stream(path: str, tok, choice: str):
    from funcpar.data.cache import stream

    return stream(ARITHMETIC if path == "builtin:arithmetic" else path, tok, choice)


def documents_on(opts, cfg) -> bool:
    """Whether packed rows keep each sample to itself (``position_ids`` in the batches: attention inside the sample,
    positions from 0): by default, where the model takes packed documents; ``--cross-document`` turns it off."""
    return bool(opts["pack"]) and not opts["cross_document"] and fp.get_model(cfg.model_type).documents


def datasets(opts, cfg):
    """``(data, train_data, eval_data)`` as :class:`funcpar.data.Mixture` s: every source's rows, their train
    part weighted as ``--data`` says, and the held-out part (``--eval-fraction`` of each source, or with
    ``--eval-data`` every row of ``--data`` trains and that data is held out). A large source is read from the
    token cache (``--token-cache``), tokenizing it first if needed."""
    tok, seq, pack = tokenizer(opts), opts["seq_len"], opts["pack"]
    rows = functools.partial(fp.data.Dataset, seq_len=seq, pack=pack, pad_id=tok.pad_id,
                             documents=documents_on(opts, cfg))
    sources = data_sources(opts["data"])
    whole = [rows(_source_stream(path, tok, opts["token_cache"])) for path, _ in sources]
    names, weights = [p for p, _ in sources], [w for _, w in sources]
    if opts["eval_data"]:
        evals = [p for p, _ in data_sources(opts["eval_data"])]
        held = [(p, rows(_source_stream(p, tok, opts["token_cache"]))) for p in evals]
        train = whole
    else:
        train, parts = zip(*(d.split(opts["eval_fraction"], seed=opts["seed"]) for d in whole), strict=True)
        held = [(n, h) for n, h in zip(names, parts, strict=True) if len(h)]
    data = fp.data.Mixture(whole, weights, names)
    train_data = fp.data.Mixture(list(train), weights, names)
    eval_data = fp.data.Mixture([h for _, h in held], names=[n for n, _ in held])
    top = max(data.max_id, eval_data.max_id)
    if top >= cfg.vocab_size:
        raise SystemExit(f"funcpar: the tokenizer produced id {top}, beyond the model's vocab_size {cfg.vocab_size}")
    return data, train_data, eval_data


def with_epochs(opts, train_rows: int) -> dict[str, Any]:
    """``opts`` with ``--steps`` set from ``--epochs`` (whole global batches per pass over ``train_rows``)."""
    if not opts["epochs"]:
        return opts
    return {**opts, "steps": opts["epochs"] * max(1, train_rows // opts["global_batch"])}


def build_optimizer(opts):
    lr, steps, warmup = opts["lr"], opts["steps"], min(opts["warmup"], max(opts["steps"] - 1, 0))
    schedules = {"constant": lambda: fp.optim.constant(lr),
                 "warmup_cosine": lambda: fp.optim.warmup_cosine(lr, warmup, max(steps, warmup + 1),
                                                                 end=lr * opts["final_lr"]),
                 "warmup_linear": lambda: fp.optim.warmup_linear_decay(lr, warmup, steps, warmup_type="linear")}
    if opts["schedule"] not in schedules:
        raise SystemExit(f"funcpar: unknown --schedule '{opts['schedule']}' (constant, warmup_cosine, warmup_linear)")
    if opts["final_lr"] != DEFAULTS["final_lr"] and opts["schedule"] != "warmup_cosine":
        raise SystemExit(f"funcpar: --final-lr sets where warmup_cosine ends; --schedule {opts['schedule']} "
                         f"{'keeps --lr throughout' if opts['schedule'] == 'constant' else 'decays to 0'}")
    sched, wd = schedules[opts["schedule"]](), opts["weight_decay"]
    optimizers = {"adamw": lambda: fp.optim.adamw(sched, b2=0.95, weight_decay=wd),
                  "lion": lambda: fp.optim.lion(sched, weight_decay=wd),
                  "sgd": lambda: fp.optim.sgd(sched, momentum=0.9)}
    if opts["optimizer"] not in optimizers:
        raise SystemExit(f"funcpar: unknown --optimizer '{opts['optimizer']}' (adamw, lion, sgd)")
    return optimizers[opts["optimizer"]]()


def _number(text: str, flag: str) -> int | float:
    """``"3"`` -> 3, ``"2.5"`` -> 2.5 (a count of layers, halves allowed)."""
    try:
        x = float(text)
    except ValueError:
        raise SystemExit(f"funcpar: bad {flag} entry '{text}': expected layer counts such as 3,5 or 2.5,1.5") from None
    return int(x) if x.is_integer() else x


def _step_parts(opts, model, cfg, mesh):
    """The model's loss (with remat if asked) and the ``compile_step`` options every train step takes from
    ``opts``, checked: shared by the full step and the ``--lora`` one."""
    precisions = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if opts["precision"] not in precisions:
        raise SystemExit(f"funcpar: unknown --precision '{opts['precision']}' (fp32, bf16, fp16)")
    if opts["remat"] and not model.remat:
        raise SystemExit(f"funcpar: --remat is not supported by model '{model.name}' (it has no activation "
                         f"checkpointing); train it without --remat")
    if opts["sequence_parallel"] and not model.sequence_parallel:
        raise SystemExit(f"funcpar: --sequence-parallel is not supported by model '{model.name}' yet ("
                         f"{_having('sequence_parallel')} have it); train it without --sequence-parallel")
    cp = mesh.axis_size("cp") if "cp" in mesh.axis_names else 1
    if cp > 1 and not model.context_parallel:
        raise SystemExit(f"funcpar: --mesh cp={cp} (context parallelism) is not supported by model '{model.name}' "
                         f"yet ({_having('context_parallel')} have it)")
    if opts["cp_layout"] not in CONTEXT_LAYOUTS:
        raise SystemExit(f"funcpar: unknown --cp-layout '{opts['cp_layout']}' ({', '.join(CONTEXT_LAYOUTS)})")
    pieces = 2 * cp if opts["cp_layout"] == "zigzag" else cp
    if cp > 1 and opts["seq_len"] % pieces:
        raise SystemExit(f"funcpar: --mesh cp={cp} splits each sequence into {pieces} pieces (--cp-layout "
                         f"{opts['cp_layout']}): --seq-len {opts['seq_len']} is not a multiple of {pieces}")
    mesh = mesh.with_context_layout(opts["cp_layout"])
    if opts["sequence_parallel"] and opts["seq_len"] % mesh.axis_size("tp"):
        raise SystemExit(f"funcpar: --sequence-parallel splits each sequence over tp={mesh.axis_size('tp')}: "
                         f"--seq-len {opts['seq_len']} is not a multiple of it")
    return model.loss_fn(cfg, mesh, remat=opts["remat"], sequence_parallel=opts["sequence_parallel"]), dict(
        mesh=mesh, optimizer=build_optimizer(opts), zero=opts["zero"], accum_steps=opts["micro_batches"],
        clip_norm=opts["clip"] or None, param_dtype=precisions[opts["precision"]],
        offload="cpu" if opts["offload"] else None, compile={"on": True, "off": False}.get(opts["compile"], "auto"),
        data_axes=("dp", "cp") if cp > 1 else ("dp",))  # (cp: every rank a chunk of each sequence, its sums partial)


def _having(capability: str) -> str:
    """The model types whose models have ``capability`` (a :class:`funcpar.ModelSpec` flag), for a message."""
    return ", ".join(sorted(t for t, m in fp.known_models().items() if getattr(m, capability)))


def build_step(opts, model, cfg, mesh, specs) -> fp.Step:
    """The train step: the model's loss (with its micro-batch weighting, and remat if asked) and the options."""
    loss, kw = _step_parts(opts, model, cfg, mesh)
    parts = [_number(p, "--parts") for p in str(opts["parts"]).replace(" ", "").split(",") if p] or None
    return fp.compile_step(loss, specs, pipeline=opts["pipeline"], chunks=opts["chunks"] or None, parts=parts, **kw)


def lora_parts(opts, model, cfg, mesh, specs):
    """``--lora``'s checks and parts without the model's parameters: ``(lora, base loss, step options)``."""
    if mesh.axis_size("pp") > 1:
        raise SystemExit("funcpar: --lora trains on tp and dp meshes (the adapters are small: pipeline stages have "
                         "nothing to gain; --zero 3 shards the frozen base over dp instead)")
    base_loss, kw = _step_parts(opts, model, cfg, mesh)
    try:
        return fp.lora.Lora(model, cfg, fp.lora.LoraConfig.parse(opts["lora"]), mesh, specs), base_loss, kw
    except fp.lora.LoraError as e:
        raise SystemExit(f"funcpar: {e}") from None


def build_lora(opts, model, cfg, mesh, specs):
    """``--lora``: ``(lora, base, step over the adapters, its initial state)``; the base never enters the step's
    state. It is this rank's whole shards, or with ``--zero 3`` a :class:`funcpar.train.lora.ShardedBase` holding 1/dp
    of each block (the adapters then train at ZeRO-2: their gradients and state 1/dp too)."""
    lora, base_loss, kw = lora_parts(opts, model, cfg, mesh, specs)
    try:
        params = build_params(opts, model, cfg, specs, mesh)
        loss = lora.loss_fn(base_loss, params, shard_base=opts["zero"] == 3)
    except fp.lora.LoraError as e:
        raise SystemExit(f"funcpar: {e}") from None
    if opts["zero"] == 3:
        params, kw["zero"] = loss.fn, 2  # (the base's 1/dp parts; the whole shards go)
    step = fp.compile_step(loss, lora.specs(), **kw)
    return lora, params, step, step.init(lora.init(seed=opts["seed"]))
