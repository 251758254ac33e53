"""The options of a run and what they build: defaults, then a TOML/JSON ``--config`` file, then the command line;
from them the model (a built-in name or an HF folder), the data, the optimizer and the train step. Shared by
``funcpar train`` and ``funcpar plan`` (:mod:`funcpar.cli.main`), which trace or run the same step.

Each option is declared once, as a typed field of a group (:data:`GROUPS`: ``ModelOptions``, ``ParallelOptions``,
...) with its default, help and rules (:func:`opt`); the parsers, ``--help``, :data:`DEFAULTS` and the checks are
made from them (:data:`OPTIONS`). The rest of the CLI reads a run's options as a plain dict, ``opts["lr"]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Callable

import torch

import funcpar as fp
from funcpar.assets import ARITHMETIC
from funcpar.parallel.mesh import CONTEXT_LAYOUTS, DEVICES

# ------------------------------------------------------------------------------------------ the options
# One field per option: its type, default, --help text and rules. From them: the parsers of ``funcpar train`` and
# ``funcpar plan`` (``--no-x`` for booleans, a --help section per group), DEFAULTS, the checks, plan's flags.

MIN_HEARTBEAT = 2.0  # seconds: below it a slow collective or a checkpoint write reads as a stuck rank


def opt(default, help: str, *, choices: tuple[str, ...] = (), at_least=None, at_most=None, plan: bool = False,
        check: Callable[[Any, str], str | None] | None = None):
    """One option, as a field of its group: its ``default``, its ``--help`` text and its rules: ``choices`` (the
    values taken), ``at_least``/``at_most`` (a number's range), ``check(value, where)`` (a message for a value it
    refuses, else None); ``plan``: ``funcpar plan`` takes it too (it shapes the step's memory)."""
    return dataclasses.field(default=default, metadata=dict(help=help, choices=tuple(choices), at_least=at_least,
                                                            at_most=at_most, plan=plan, check=check))


def _stuck_after(v, where: str) -> str | None:
    if 0 < v < MIN_HEARTBEAT:
        return (f"funcpar: --heartbeat {v!r}{where}: a rank is declared stuck after this many seconds without "
                f"progress; use 0 (off) or at least {MIN_HEARTBEAT:g} (a healthy step's collectives and checkpoints "
                f"take longer than {v!r} s)")
    return None


def _lora_settings(v, where: str) -> str | None:
    """``--lora`` as :meth:`funcpar.lora.LoraConfig.parse` reads it: refused with the options, before any model."""
    try:
        if v:
            fp.lora.LoraConfig.parse(v)
    except fp.lora.LoraError as e:
        return f"funcpar: {e}{where}"
    return None


def _a_folder(v, where: str) -> str | None:
    if not v.strip():
        return (f"funcpar: --out {v!r}{where}: name the run folder (an empty --out would write the run into the "
                f"working directory)")
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """model and tokenizer"""

    model: str = opt("llama-tiny", "a built-in model (llama-tiny, llama-micro) or an HF folder to fine-tune",
                     plan=True)
    tokenizer: str = opt("auto", "auto (the --model folder's own tokenizer; byte for a built-in model), byte, or a "
                                 "folder with an HF tokenizer")
    chat_template: str = opt("auto", "conversations through the HF tokenizer's chat_template when it has one (auto), "
                                     "or funcpar's User:/Assistant: template (builtin)")
    lora: str = opt("", "train low-rank adapters, the base frozen: r=16,alpha=32,targets=q,v[,dropout=0.05]; exports "
                        "the merged model to hf/ and a PEFT adapter folder to adapter/", check=_lora_settings)
    generic: bool = opt(False, "run the model as transformers writes it, split by its config's tp plan (the path every "
                               "type without a built-in takes), even where funcpar has a built-in model of its type",
                        plan=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """mesh and parallelism"""

    mesh: str = opt("tp=2,dp=2", "axis sizes, e.g. tp=2,dp=2 or pp=2,dp=2 ('1': one process); the ranks start here "
                                 "unless under torchrun", plan=True)
    device: str = opt("auto", "where the ranks run: cuda (one GPU per rank, refused when a node's ranks outnumber its "
                              "GPUs), cpu, or auto: cuda when every rank of the node has a GPU, else cpu with a "
                              "warning", choices=DEVICES, plan=True)
    zero: int = opt(1, "ZeRO stage: 0, 1, 2 or 3", at_least=0, at_most=3, plan=True)
    pipeline: str = opt("1f1b", "schedule with pp > 1: 1f1b, gpipe, interleaved or zb (zero bubble)", plan=True)
    chunks: int = opt(0, "virtual stages per pp rank (interleaved, zb)", at_least=0, plan=True)
    parts: str = opt("", "layers per pipeline stage, e.g. 3,5 or 2.5,1.5 (default: balanced by weight, head "
                         "included)", plan=True)
    sequence_parallel: bool = opt(False, "between tp regions each tp rank keeps its block of the sequence (less "
                                         "activation memory; --seq-len a multiple of tp; llama-family and gpt2)",
                                  plan=True)
    cp_layout: str = opt("zigzag", "how --mesh cp=N splits each sequence: zigzag (rank c: pieces c and 2N-1-c of 2N, "
                                   "balanced attention work; --seq-len a multiple of 2N) or contiguous (rank c: chunk "
                                   "c of N)", plan=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataOptions:
    """data and batches"""

    data: str = opt("builtin:arithmetic", "a .jsonl/.txt file or a folder of them, or builtin:arithmetic (README: the "
                                          "formats and their text); several mixed by weight: a.jsonl:0.7,b.txt:0.3 "
                                          "(each batch draws those shares of its rows)")
    token_cache: str = opt("auto", "where sources are tokenized once and read by every later run and rank: auto "
                                   "(sources of 256 MiB or more, under $FUNCPAR_TOKEN_CACHE or "
                                   "~/.cache/funcpar/tokens), a folder (every source), or off (tokenize in memory "
                                   "each run)")
    seq_len: int = opt(64, "tokens per row", at_least=1, plan=True)
    pack: bool = opt(True, "pack samples into rows (--no-pack: one sample per row, padded)")
    cross_document: bool = opt(False, "let a packed sample attend to the samples before it in its row, at the row's "
                                      "positions (the default keeps each sample to itself, positions from 0, as if "
                                      "run alone; models without document support always pack this way)", plan=True)
    global_batch: int = opt(32, "rows per optimizer step, over all dp ranks and micro-batches", at_least=1, plan=True)
    micro_batches: int = opt(1, "micro-batches accumulated per step (the pipeline's micro-batches with pp)",
                             at_least=1, plan=True)
    eval_data: str = opt("", "held-out data (a file or folder, --data's formats): the held-out loss is computed on "
                             "it, and every row of --data trains")
    eval_fraction: float = opt(0.05, "share of each source's rows held out for evaluation, at most 2000 rows each "
                                     "(without --eval-data)", at_least=0, at_most=0.5)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerOptions:
    """optimizer and schedule"""

    optimizer: str = opt("adamw", "adamw, lion or sgd", plan=True)
    lr: float = opt(3e-3, "peak learning rate", at_least=0)
    schedule: str = opt("warmup_cosine", "warmup_cosine, warmup_linear or constant")
    warmup: int = opt(20, "warmup steps", at_least=0)
    final_lr: float = opt(0.1, "the learning rate the warmup_cosine schedule ends at, as a fraction of --lr",
                          at_least=0, at_most=1)
    weight_decay: float = opt(0.01, "decoupled weight decay (not on norms and biases)", at_least=0)
    clip: float = opt(1.0, "clip the global gradient norm to this (0: off)", at_least=0)
    steps: int = opt(300, "optimizer steps to train", at_least=0)
    epochs: int = opt(0, "passes over the training rows: sets --steps to epochs x (rows // --global-batch); not "
                         "together with --steps (0: --steps decides)", at_least=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """precision, memory and compilation"""

    precision: str = opt("fp32", "fp32, bf16 or fp16 (with loss scaling)", plan=True)
    remat: bool = opt(False, "recompute activations in the backward pass (less memory)", plan=True)
    offload: bool = opt(False, "keep the optimizer state and the master weights in host memory (GPU memory for larger "
                               "models; the update runs on the host)", plan=True)
    compile: str = opt("auto", "torch.compile the gradient: auto (on a GPU, where it pays), on or off",
                       choices=("auto", "on", "off"), plan=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """evaluation and samples"""

    eval_every: int = opt(100, "held-out loss every N steps and at the end (0: never)", at_least=0)
    sample_prompts: str = opt("", "a .txt file of prompts (one a line; \\n for a newline) or .jsonl of {\"prompt\": "
                                  "text or messages} or {\"messages\": [...]} (through the chat template): at each "
                                  "evaluation their greedy continuations by the model in training are printed and "
                                  "written to samples.jsonl (not with pp or cp)")
    sample_tokens: int = opt(32, "tokens generated per prompt for --sample-prompts", at_least=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFolderOptions:
    """run folder, checkpoints and restarts"""

    out: str = opt("out", "the run folder: metrics.jsonl, loss.png, config.json, checkpoints/, hf/", check=_a_folder)
    resume: bool = opt(False, "continue the run in --out from its latest checkpoint")
    overwrite: bool = opt(False, "replace an earlier run in --out, or folders funcpar did not write")
    data_changed: bool = opt(False, "with --resume: continue though the data differs from the checkpoint's (a source's "
                                    "files, --data, --eval-data, --eval-fraction, --no-pack): the model and optimizer "
                                    "state go on, the data order starts afresh on the new data")
    save_every: int = opt(100, "checkpoint every N steps (0: only at the end)", at_least=0)
    keep: int = opt(2, "checkpoints of this run to keep", at_least=1)
    log_every: int = opt(20, "a log line every N steps", at_least=1)
    export_dtype: str = opt("auto", "the dtype of hf/'s weights: auto (the training dtype: --precision bf16 exports "
                                    "bf16), fp32 (with bf16/fp16 the float32 master weights, not their roundings), "
                                    "bf16 or fp16", choices=("auto", "fp32", "bf16", "fp16"))
    seed: int = opt(0, "initialisation, data order and split")
    heartbeat: float = opt(60.0, "seconds without progress after which a stuck rank is reported and the job ends (0: "
                                 "off)", at_least=0, check=_stuck_after)
    max_restarts: int = opt(0, "when a rank dies, restart every rank up to this many times (torchrun's restarts); "
                               "restarted ranks resume from the run's last complete checkpoint (not after an error a "
                               "restart would repeat: a refusal, a NaN loss)", at_least=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackingOptions:
    """experiment tracking"""

    track: str = opt("", "experiment trackers besides TensorBoard, when installed: wandb, mlflow or wandb,mlflow (the "
                         "run's options and every metrics row; a resumed run continues the same tracked run)")
    project: str = opt("funcpar", "the wandb project or MLflow experiment of --track")


GROUPS = (ModelOptions, ParallelOptions, DataOptions, OptimizerOptions, MemoryOptions, EvalOptions, RunFolderOptions,
          TrackingOptions)  # in the order --help lists them


@dataclasses.dataclass(frozen=True)
class Option:
    """One option as the parsers and checks read it: a field of a group in :data:`GROUPS`."""

    name: str
    kind: type  # the field's declared type: str, int, float or bool
    default: Any
    group: type
    help: str
    choices: tuple[str, ...]
    at_least: Any
    at_most: Any
    plan: bool
    check: Callable[[Any, str], str | None] | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _options() -> dict[str, Option]:
    out = {}
    for group in GROUPS:
        kinds = typing.get_type_hints(group)
        for f in dataclasses.fields(group):
            if f.name in out or type(f.default) is not kinds[f.name]:  # (a mistake in a declaration: said at import)
                raise TypeError(f"option {f.name} of {group.__name__}: declared twice, or its default "
                                f"{f.default!r} is not of its type {kinds[f.name]}")
            out[f.name] = Option(f.name, kinds[f.name], f.default, group, **f.metadata)
    return out


OPTIONS = _options()  # name -> Option, in --help's order
DEFAULTS = types.MappingProxyType({name: o.default for name, o in OPTIONS.items()})  # (read only: opts copy it)


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


_ABOUT = {"train": "Train a model on a mesh, evaluate and checkpoint it as it goes, then export a transformers folder.",
          "plan": "Print the sharding table and the traced per-rank memory of the train step, without processes."}


def taken(command: str) -> list[Option]:
    """The options ``funcpar train`` takes (all), or ``funcpar plan`` (those that shape the step's memory; the rest
    keep their defaults there)."""
    return [o for o in OPTIONS.values() if command != "plan" or o.plan]


def _add(ap, o: Option, typed: bool = False, **kw) -> None:
    """``o``'s flag on ``ap`` (a parser or a group of one): ``--x``/``--no-x`` for a boolean, else ``--x VALUE``
    (``typed``: converted to the option's type, ``--x INT``); ``None`` where the command line does not give it."""
    if o.kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif typed:
        kw.update(type=o.kind, metavar=o.kind.__name__.upper())
    ap.add_argument(o.flag, dest=o.name, default=None, **kw)


def parser(command: str, epilog: str | None = None, parents=()) -> argparse.ArgumentParser:
    """The parser of ``funcpar train`` or ``funcpar plan`` (:func:`read_options`), a --help section per group."""
    ap = argparse.ArgumentParser(prog=f"funcpar {command}", description=_ABOUT[command], epilog=epilog,
                                 parents=list(parents), allow_abbrev=not parents)
    ap.add_argument("--config", help="a TOML or JSON file of options (command-line flags override it; a run's "
                                     "--out/config.json is one)")
    ap.add_argument("--debug", action="store_true", help="tracebacks and torchrun's own logs on errors")
    sections = {}
    for o in taken(command):
        if o.group not in sections:
            sections[o.group] = ap.add_argument_group(o.group.__doc__)
        text = o.help + (f" (default: {o.default})" if o.default != "" else "")
        _add(sections[o.group], o, typed=True, help=text)
    return ap


def read_options(argv: list[str], command: str, epilog: str | None = None, parents=()) -> dict[str, Any]:
    """The options of ``funcpar train`` or ``funcpar plan`` (its flags: those that shape the step). ``parents``:
    parsers of the command's own flags (``add_help=False``), parsed by the caller: listed in the usage line and
    ``--help``, never taken here (abbreviations are then off: ``--mem`` is not ``--memory``)."""
    ap = parser(command, epilog, parents)
    args, unknown = ap.parse_known_args(argv)
    if unknown:
        flags = ["--config", "--debug"] + [o.flag for o in taken(command)]
        flags += [f for p in parents for f in p._option_string_actions if f.startswith("--")]
        raise SystemExit(_unknown_flag(unknown[0], ap.prog, flags))
    opts = dict(DEFAULTS)
    if args.config:
        cfg = _read_config(args.config)
        unknown = sorted(set(cfg) - set(OPTIONS))
        if unknown:
            raise SystemExit(f"funcpar: unknown option(s) in {args.config}: {', '.join(unknown)}")
        opts.update(cfg)
    opts.update({k: v for k, v in vars(args).items() if v is not None and k in OPTIONS})
    _check_options(opts, args.config)
    return opts


def saved_run_options(path: Path) -> dict[str, Any] | None:
    """The options in ``path`` if it is a run's config.json (a non-empty object of funcpar's option names), else
    None (absent, unreadable, or a model's or anyone else's config.json)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and cfg and set(cfg) <= set(OPTIONS) else None


def run_options(opts: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """``--resume`` without ``--config``: the run's own options (``--out``/config.json, written when it started)
    under the command line's flags, so that a resumed run is the run it continues unless a flag says otherwise. A
    flag that changes ``--steps`` is said (the learning-rate schedule is stretched or cut from the step resumed)."""
    saved = Path(opts["out"]) / "config.json"
    run = saved_run_options(saved) if opts["resume"] and "--config" not in argv else None
    if run is None and opts["resume"] and "--config" not in argv:
        _lost_options(saved)
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


def _lost_options(saved: Path) -> None:
    """Refuse ``--resume`` of a run that has checkpoints but whose config.json (its options) is missing, empty or
    not its options (a full disk or a kill at its write in an older funcpar, a hand edit): resuming on the defaults
    would train on other data at another rate without a word."""
    ckpts = saved.parent / "checkpoints"
    if not ckpts.is_dir() or not any(ckpts.iterdir()):
        return  # (no run to continue: what --resume then says is _resume_source's)
    if not saved.exists():
        what = "is missing"
    elif saved.is_file() and saved.stat().st_size == 0:
        what = "is empty"
    else:
        try:
            json.loads(saved.read_text())
            what = "does not hold a run's options"
        except (OSError, ValueError) as e:
            what = f"is unreadable ({type(e).__name__})"
    raise SystemExit(f"funcpar: --resume: {saved} {what}: the run's options (data, learning rate, schedule, ...) "
                     f"are not known, and the defaults would continue it as another run; restore the file, or "
                     f"give the run's options with --config FILE")


def _given(argv: list[str]) -> dict[str, Any]:
    """The options the command line itself sets (as ``read_options`` parses it, abbreviations included)."""
    ap = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    ap.add_argument("--config")
    ap.add_argument("--debug", action="store_true", default=None)
    for o in OPTIONS.values():
        _add(ap, o)
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
    out = {k: v for k, v in opts.items() if k != "data_changed"}  # (said for one resume, never for the next)
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


def _check_options(opts: dict[str, Any], config: str | None) -> None:
    """Every option of its declared type, within its choices, range and check: one clear line otherwise."""
    where = f" (from {config} or the command line)" if config else ""
    for o in OPTIONS.values():
        v, kind = opts[o.name], o.kind
        ok = isinstance(v, bool) if kind is bool else (
            isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
            if kind in (int, float) else isinstance(v, str))
        if not ok:
            raise SystemExit(f"funcpar: {o.flag} {v!r}{where}: expected {kind.__name__}")
        if o.choices and v not in o.choices:
            raise SystemExit(f"funcpar: {o.flag} {v!r}{where}: expected one of {', '.join(o.choices)}")
        refused = o.check(v, where) if o.check else None
        if refused:
            raise SystemExit(refused)
        at_most = float("inf") if o.at_most is None else o.at_most
        if o.at_least is not None and not (v >= o.at_least and v <= at_most):
            hi = f" and at most {o.at_most}" if o.at_most is not None else ""
            raise SystemExit(f"funcpar: {o.flag} {v!r}{where}: must be a number at least {o.at_least}{hi}")
        if kind is float and not math.isfinite(v):  # (--lr inf: a NaN at step 1; 0 turns the others off)
            raise SystemExit(f"funcpar: {o.flag} {v!r}{where}: must be a finite number")


# ------------------------------------------------------------------------------------------ model, data, step


def model_config(name: str, mesh, generic: bool = False, layers: int | None = None):
    """``(model, cfg)`` for a built-in model name or an HF folder's ``config.json``, padded for ``mesh``; ``generic``:
    transformers' own module of its type (:func:`funcpar.get_model`'s ``generic``); ``layers``: the same model cut
    to its first ``layers`` layers (:func:`shallow`: what ``funcpar plan`` traces to extrapolate a deep model)."""
    if name in BUILTIN_MODELS:
        raw = BUILTIN_MODELS[name]
    elif Path(name).is_dir():
        raw = fp.hf.read_config(Path(name))  # an object, or an error naming the file
    else:
        raise SystemExit(f"funcpar: --model '{name}' is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor a folder")
    raw = raw if layers is None else shallow(raw, layers)
    model = fp.get_model(raw.get("model_type"), generic=generic)
    if name in BUILTIN_MODELS:
        return model, model.config(raw, mesh)
    try:
        return model, model.config(raw, mesh)
    except ValueError as e:  # a key of the wrong type, a size the mesh cannot split: named with the file
        raise fp.hf.HFError(f"{Path(name) / 'config.json'}: {e}") from None


def shallow(raw: dict, layers: int) -> dict:
    """A config's keys for the same model with ``layers`` layers: its count (``num_hidden_layers``, or GPT-2's
    ``n_layer``, ...) and every list with an entry per layer (``layer_types``, ...) cut to that many, or repeated
    from its start to reach them."""
    key = next((k for k in LAYER_COUNT_KEYS if isinstance(raw.get(k), int)), None)
    depth = raw.get(key)
    if key is None or depth < 1 or layers < 1:
        raise ValueError(f"cannot make a model of {key or 'num_hidden_layers'}={depth!r} {layers} layers deep")
    return {**{k: [v[i % depth] for i in range(layers)] if isinstance(v, list) and len(v) == depth else v
               for k, v in raw.items()}, key: layers}


LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")  # (config.json's names for the depth)


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


def _fingerprint(path: str) -> dict[str, Any]:
    """What a resume compares of one data source: its path, size and a SHA-256 of its bytes (a folder: of each
    file's name and bytes, in order), and its mtime (recorded, not compared: a copy keeps the content)."""
    import hashlib

    p = Path(path)
    if not p.exists():
        return {"path": path}  # (a built-in source)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h, size, mtime = hashlib.sha256(), 0, 0
    for f in files:
        if p.is_dir():
            h.update(str(f.relative_to(p)).encode() + b"\0")
        st = f.stat()
        h.update(_file_sha256(str(f.resolve()), st.st_size, st.st_mtime_ns).encode())
        size, mtime = size + st.st_size, max(mtime, st.st_mtime_ns)
    return {"path": str(p.resolve()), "size": size, "mtime_ns": mtime, "sha256": h.hexdigest()}


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """A file's SHA-256, read once per process while its size and mtime stay (the checks before the ranks start
    and at the resume, and every checkpoint's record)."""
    import hashlib

    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def data_record(opts: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of the run's data, so that ``--resume`` knows it continues on the same rows: each
    source's :func:`_fingerprint` and weight, the held-out data or fraction, and packing."""
    return {"sources": [{**_fingerprint(p), "weight": w} for p, w in data_sources(opts["data"])],
            "eval_data": [_fingerprint(p) for p, _ in data_sources(opts["eval_data"])] if opts["eval_data"] else [],
            "eval_fraction": opts["eval_fraction"], "pack": opts["pack"]}


def data_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the data of ``now`` (:func:`data_record`) differs from the checkpoint's ``saved``, in words naming the
    flag or the file (empty: the same rows)."""
    out = []

    def files(key: str, flag: str) -> None:
        was, is_ = saved.get(key, []), now.get(key, [])
        if [s["path"] for s in was] != [s["path"] for s in is_]:
            shown = lambda xs: ",".join(s["path"] for s in xs) or "none"  # noqa: E731
            out.append(f"{flag} is {shown(is_)}, the checkpoint's {shown(was)}")
            return
        for a, b in zip(was, is_, strict=True):
            if a.get("size") != b.get("size"):
                out.append(f"{b['path']} is {b.get('size')} bytes, {a.get('size')} at the checkpoint")
            elif a.get("sha256") != b.get("sha256"):
                out.append(f"{b['path']} has other contents than at the checkpoint (the same size)")
    files("sources", "--data")
    if not out and [s.get("weight") for s in saved["sources"]] != [s.get("weight") for s in now["sources"]]:
        out.append("--data weighs its sources otherwise")
    files("eval_data", "--eval-data")
    if not now["eval_data"] and saved.get("eval_fraction") != now["eval_fraction"]:
        out.append(f"--eval-fraction is {now['eval_fraction']:g}, the checkpoint's {saved.get('eval_fraction'):g}")
    if saved.get("pack") != now["pack"]:
        out.append("--no-pack is " + ("off" if now["pack"] else "on") + " (at the checkpoint " +
                   ("off" if saved.get("pack") else "on") + ")")
    return out


def _source_stream(path: str, tok, choice: str):
    from funcpar.data.cache import stream

    return stream(ARITHMETIC if path == "builtin:arithmetic" else path, tok, choice)


def documents_on(opts, cfg) -> bool:
    """Whether packed rows keep each sample to itself (``position_ids`` in the batches: attention inside the sample,
    positions from 0): by default, where the model takes packed documents; ``--cross-document`` turns it off."""
    model = fp.get_model(cfg.model_type, generic=generic_path(cfg))
    return bool(opts["pack"]) and not opts["cross_document"] and model.documents


def generic_path(cfg) -> bool:
    """Whether ``cfg`` is run by the generic transformers path (``funcpar.models.transformers_auto``); its probe
    and refusals run in ``compile_step`` (``ModelSpec.check_run``), as the step is built."""
    return bool(getattr(cfg, "generic", False))


def datasets(opts, cfg):
    """``(data, train_data, eval_data)`` as :class:`funcpar.data.Mixture` s: every source's rows, their train
    part weighted as ``--data`` says, and the held-out part (``--eval-fraction`` of each source, or with
    ``--eval-data`` every row of ``--data`` trains and that data is held out). A large source is read from the
    token cache (``--token-cache``), tokenizing it first if needed."""
    tok, seq, pack = tokenizer(opts), opts["seq_len"], opts["pack"]
    rows = functools.partial(fp.data.Dataset, seq_len=seq, pack=pack, pad_id=tok.pad_id,
                             documents=documents_on(opts, cfg))
    def source(path: str, flag: str):  # (a source too small for one row: named, among several)
        stream = _source_stream(path, tok, opts["token_cache"])  # (its own errors name the file)
        try:
            return rows(stream)
        except fp.data.DataError as e:
            raise fp.data.DataError(f"{flag} {path}: {e}") from None

    sources = data_sources(opts["data"])
    whole = [source(path, "--data") for path, _ in sources]
    names, weights = [p for p, _ in sources], [w for _, w in sources]
    if opts["eval_data"]:
        evals = [p for p, _ in data_sources(opts["eval_data"])]
        held = [(p, source(p, "--eval-data")) for p in evals]
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
    """``"3"`` -> 3, ``"2.5"`` -> 2.5 (a count of layers, halves allowed; not NaN, infinite, negative or beyond any
    model's layers, which the pipeline's own check would overflow on)."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not 0 <= x <= 2**31:
        raise SystemExit(f"funcpar: bad {flag} entry '{text}': expected layer counts such as 3,5 or 2.5,1.5")
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
        data_axes=run_data_axes(model, mesh))


def run_data_axes(model, mesh) -> tuple[str, ...]:
    """The axes a run's batch and its sums go over: the model's data axes the mesh has (dp; Mixtral's ep too: each
    rank of them its own rows), then cp where it is over 1 (every rank a chunk of each sequence, its sums partial)."""
    return (*(a for a in model.data_axes if a in mesh.axis_names and a != "cp"),
            *(("cp",) if "cp" in mesh.axis_names and mesh.axis_size("cp") > 1 else ()))


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
