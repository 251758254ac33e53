"""``funcpar train / plan / convert``: the command-line face of the Python API.

Run bare, ``funcpar train`` starts one process per mesh rank on this machine through ``torch.distributed.run``;
under ``torchrun`` (one node or many) it uses the world it is given. Options come from defaults, then a TOML/JSON
``--config`` file, then the command line.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEFAULTS: dict[str, Any] = {
    "model": "llama-tiny",
    "mesh": "tp=2,dp=2",
    "data": "builtin:arithmetic",
    "tokenizer": "byte",
    "seq_len": 64,
    "pack": True,
    "global_batch": 32,
    "micro_batches": 1,
    "optimizer": "adamw",
    "lr": 3e-3,
    "schedule": "warmup_cosine",
    "warmup": 20,
    "weight_decay": 0.01,
    "zero": 1,
    "clip": 1.0,
    "precision": "fp32",
    "remat": False,
    "steps": 300,
    "eval_every": 100,
    "eval_fraction": 0.05,
    "save_every": 100,
    "keep": 2,
    "log_every": 20,
    "out": "out",
    "resume": False,
    "seed": 0,
}

BUILTIN_MODELS = {
    # a small Llama for the byte tokenizer (259 tokens, vocabulary rounded up to a multiple of 8 for tp)
    "llama-tiny": dict(vocab_size=264, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, model_type="llama"),
    "llama-micro": dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, model_type="llama"),
}


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=2,dp=2"`` -> ``{"tp": 2, "dp": 2}``; ``""`` or ``"1"`` -> ``{}`` (one process)."""
    out: dict[str, int] = {}
    if text.strip() in ("", "1"):
        return out
    for part in text.split(","):
        key, _, val = part.partition("=")
        key = key.strip()
        if key not in ("pp", "dp", "tp") or not val.strip().isdigit():
            raise SystemExit(f"funcpar: bad --mesh '{text}': expected e.g. 'tp=2,dp=2' (axes pp, dp, tp)")
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


# ---------------------------------------------------------------------------------------------------- models


def _model(opts, mesh):
    import funcpar as fp
    from funcpar.models import llama

    name = opts["model"]
    if name in BUILTIN_MODELS:
        cfg = llama.Config.from_hf(BUILTIN_MODELS[name]).with_mesh(mesh)
        specs = llama.specs(cfg, mesh)
        torch.manual_seed(opts["seed"])
        return llama, cfg, fp.shard(llama.init(cfg, seed=opts["seed"]), specs, mesh), specs
    if Path(name).is_dir():
        params, cfg = fp.hf.load(name, mesh=mesh)
        model = fp.hf.known_models()[cfg.model_type]
        return model, cfg, params, model.specs(cfg, mesh)
    raise SystemExit(f"funcpar: --model '{name}' is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor a folder")


def _tokenizer(opts):
    from funcpar import data

    return data.ByteTokenizer() if opts["tokenizer"] == "byte" else data.HFTokenizer(opts["tokenizer"])


def _samples(opts):
    from funcpar import data

    if opts["data"] == "builtin:arithmetic":
        from funcpar.assets import ARITHMETIC

        return data.load_samples(ARITHMETIC)
    return data.load_samples(opts["data"])


def _optimizer(opts):
    import funcpar as fp

    lr, steps, warmup = opts["lr"], opts["steps"], min(opts["warmup"], max(opts["steps"] - 1, 0))
    kind = opts["schedule"]
    if kind == "constant":
        sched = fp.optim.constant(lr)
    elif kind == "warmup_cosine":
        sched = fp.optim.warmup_cosine(lr, warmup, max(steps, warmup + 1), end=lr / 10)
    elif kind == "warmup_linear":
        sched = fp.optim.warmup_linear_decay(lr, warmup, steps, warmup_type="linear")
    else:
        raise SystemExit(f"funcpar: unknown --schedule '{kind}' (constant, warmup_cosine, warmup_linear)")
    if opts["optimizer"] == "adamw":
        return fp.optim.adamw(sched, b2=0.95, weight_decay=opts["weight_decay"])
    if opts["optimizer"] == "lion":
        return fp.optim.lion(sched, weight_decay=opts["weight_decay"])
    if opts["optimizer"] == "sgd":
        return fp.optim.sgd(sched, momentum=0.9)
    raise SystemExit(f"funcpar: unknown --optimizer '{opts['optimizer']}' (adamw, lion, sgd)")


# ------------------------------------------------------------------------------------------------- reporting


def sharding_table(params_like, specs, mesh) -> str:
    """One row per leaf (layers collapsed when alike): global shape, spec, local shape, MiB per rank."""
    import re

    from funcpar.spec import broadcast_specs, local_shape

    rows: dict[str, list] = {}
    for path, spec, x in broadcast_specs(specs, params_like):
        key = re.sub(r"\.\d+\.", ".*.", path)
        loc = local_shape(spec, tuple(x.shape), mesh, path)
        mib = math.prod(loc) * x.element_size() / 2**20
        row = rows.setdefault(key, [key, tuple(x.shape), spec, loc, mib, 0])
        row[5] += 1
    lines = [f"{'leaf':<28} {'global shape':<16} {'spec':<18} {'local shape':<16} {'MiB/rank':>9}"]
    for key, shape, spec, loc, mib, count in rows.values():
        name = key if count == 1 else f"{key} (x{count})"
        lines.append(f"{name:<28} {str(shape):<16} {str(spec):<18} {str(loc):<16} {mib * count:>9.3f}")
    return "\n".join(lines)


def memory_plan(params_like, specs, mesh, zero: int, opt_slots: int = 2) -> dict[str, float]:
    """Per-rank MiB of parameters, gradients and optimizer state (``opt_slots`` fp32 tensors per parameter)."""
    from funcpar.spec import broadcast_specs, local_shape

    params = grads = opt = 0.0
    for path, spec, x in broadcast_specs(specs, params_like):
        n = math.prod(local_shape(spec, tuple(x.shape), mesh, path))
        repl = [a for a in ("dp", "tp") if a not in spec.axes]
        parts = math.prod(mesh.axis_size(a) for a in repl) if zero >= 1 else 1
        params += n * x.element_size()
        grads += n * x.element_size() / (mesh.axis_size("dp") if zero >= 2 else 1)
        opt += opt_slots * 4 * n / parts
    return {"params": params / 2**20, "grads": grads / 2**20, "optimizer": opt / 2**20,
            "total": (params + grads + opt) / 2**20}


def _plot(metrics_file: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- commands


def _evaluate(model, cfg, params, data, mesh, global_batch) -> float:
    """Mean held-out token loss over the whole eval set, split over dp."""
    from funcpar import collectives as C
    from funcpar.data import Loader
    from funcpar.layers import count_targets

    dp = mesh.axis_size("dp")
    gb = max(dp, min(global_batch, len(data)) // dp * dp)
    loader = Loader(data, mesh, gb, shuffle=False)
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(max(1, len(data) // gb)):
            b = next(loader)
            total += torch.tensor([model.loss(params, b, cfg=cfg, mesh=mesh, reduction="sum").item(), count_targets(b)],
                                  dtype=torch.float64)
    total = C.all_reduce(total, mesh, "dp")
    return (total[0] / total[1].clamp(min=1)).item()


def train(argv: list[str]) -> None:
    opts = _options(argv, "train")
    sizes = parse_mesh(opts["mesh"])
    if _launch_if_needed(["train", *argv], math.prod(sizes.values()) if sizes else 1):
        return
    import funcpar as fp
    from funcpar.data import Dataset, Loader

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    mesh = fp.Mesh(**sizes)
    rank0 = mesh.rank == 0
    out = Path(opts["out"])
    ckpts = out / "checkpoints"
    metrics_file = out / "metrics.jsonl"
    model, cfg, params, specs = _model(opts, mesh)
    tok = _tokenizer(opts)
    samples = _samples(opts)
    data = Dataset.from_samples(samples, tok, opts["seq_len"], pack=opts["pack"])
    train_data, eval_data = data.split(opts["eval_fraction"], seed=opts["seed"])
    vocab = getattr(cfg, "vocab_size")
    if int(data.ids.max()) >= vocab:
        raise SystemExit(f"funcpar: the tokenizer produced id {int(data.ids.max())}, beyond the model's vocab_size {vocab}")
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if opts["precision"] not in dtypes:
        raise SystemExit(f"funcpar: unknown --precision '{opts['precision']}' (fp32, bf16, fp16)")
    loss_kw = {"remat": True} if opts["remat"] else {}
    if loss_kw and "remat" not in model.loss.__code__.co_varnames:
        raise SystemExit(f"funcpar: --remat is not supported by {model.__name__}")
    step = fp.compile_step(functools.partial(model.loss, cfg=cfg, mesh=mesh, **loss_kw), specs, mesh=mesh,
                           optimizer=_optimizer(opts), zero=opts["zero"], accum_steps=opts["micro_batches"],
                           clip_norm=opts["clip"] or None, param_dtype=dtypes[opts["precision"]])
    state = step.init(params)
    loader = Loader(train_data, mesh, opts["global_batch"], seed=opts["seed"])
    extra_base = {"model": cfg.model_type, "config": cfg.to_hf(), "tokenizer": opts["tokenizer"]}
    if opts["resume"] and (ckpts / "latest").exists():
        state, extra = fp.checkpoint.load(ckpts, step)
        loader.load_state_dict(extra["data"])
        if rank0:
            print(f"resumed from {fp.checkpoint.resolve(ckpts)} at step {state.step}", flush=True)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        kept = [line for line in (metrics_file.read_text().splitlines() if metrics_file.exists() and state.step else [])
                if json.loads(line).get("step", 0) <= state.step]
        metrics_file.write_text("".join(line + "\n" for line in kept))
        print(f"funcpar train: {cfg.model_type} on {mesh!r} ({mesh.size} process(es), {mesh.device.type}), "
              f"{len(train_data)} train rows x {opts['seq_len']} tokens, {len(eval_data)} held-out rows"
              + (f", {data.truncated} samples truncated" if data.truncated else ""), flush=True)
        print(sharding_table(params_like(model, cfg), specs, mesh), flush=True)
    bar = None
    if rank0 and sys.stdout.isatty():
        from tqdm import tqdm

        bar = tqdm(total=opts["steps"], initial=state.step, desc="train", dynamic_ncols=True)
    t_start = time.time()
    first_loss = None
    while state.step < opts["steps"]:
        state, m = step(state, next(loader))
        first_loss = m["loss"] if first_loss is None else first_loss
        row = {k: m[k] for k in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "loss_scale", "skipped") if k in m}
        row["truncated"] = data.truncated
        if opts["eval_every"] and (state.step % opts["eval_every"] == 0 or state.step == opts["steps"]):
            ev = _evaluate(model, cfg, state.params, eval_data, mesh, opts["global_batch"])
            row |= {"eval_loss": ev, "eval_ppl": math.exp(min(ev, 50))}
        if rank0:
            with open(metrics_file, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
                bar.update(1)
            elif state.step % opts["log_every"] == 0 or state.step == opts["steps"] or "eval_loss" in row:
                elapsed = time.time() - t_start
                eta = elapsed / max(1, state.step) * (opts["steps"] - state.step)
                ev = f"  eval {row['eval_loss']:.4f} (ppl {row['eval_ppl']:.2f})" if "eval_loss" in row else ""
                print(f"step {state.step:5d}/{opts['steps']}  loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.3f}  "
                      f"lr {m['lr']:.2e}  {m['tokens_per_s']:.0f} tok/s  eta {eta:.0f}s{ev}", flush=True)
        if opts["save_every"] and state.step % opts["save_every"] == 0 and state.step < opts["steps"]:
            step.save(ckpts / f"step-{state.step}", state, extra={**extra_base, "data": loader.state_dict()}, keep=opts["keep"])
    if bar is not None:
        bar.close()
    step.save(ckpts / f"step-{state.step}", state, extra={**extra_base, "data": loader.state_dict()}, keep=opts["keep"])
    fp.hf.save(out / "hf", state.params, model, cfg, mesh, specs=specs)
    if rank0:
        _plot(metrics_file, out / "loss.png")
        last = json.loads(metrics_file.read_text().splitlines()[-1])
        print(f"loss {first_loss if first_loss is not None else float('nan'):.4f} -> {last['loss']:.4f}; "
              f"wrote {ckpts}, {metrics_file}, {out / 'loss.png'} and a transformers folder {out / 'hf'}", flush=True)
        if opts["data"] == "builtin:arithmetic" and opts["tokenizer"] == "byte":
            _show_arithmetic(out / "hf", model, cfg)


def params_like(model, cfg):
    return model.init(cfg, device="meta")


def _show_arithmetic(folder: Path, model, cfg) -> None:
    """Greedy answers of the exported model to the built-in task: a few shown, accuracy over all facts."""
    import funcpar as fp
    from funcpar.assets import arithmetic_facts
    from funcpar.data import ByteTokenizer

    tok = ByteTokenizer()
    params, cfg = fp.hf.load(folder, model)
    facts = arithmetic_facts()
    prompts = [tok.encode(f"{a}+{b}=\n") for a, b in facts]
    answers = greedy(lambda ids: model.forward(params, ids, cfg, fp.Mesh()), prompts, tok.eos_id, max_new=4)
    got = [tok.decode(a) for a in answers]
    correct = sum(g == str(a + b) for g, (a, b) in zip(got, facts))
    shown = ", ".join(f"{a}+{b}={g}" for g, (a, b) in list(zip(got, facts))[::13][:8])
    print(f"greedy answers of the exported model: {shown}; {correct}/{len(facts)} correct", flush=True)
    try:
        import transformers

        hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        ids = torch.tensor([tok.encode("7+5=\n")])
        gen = hf_model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        print(f"transformers loads {folder} and generates: 7+5= -> {tok.decode(gen[0, ids.shape[1]:].tolist())!r}", flush=True)
    except ImportError:
        pass


def greedy(logits_fn, prompts: list[list[int]], eos: int, max_new: int) -> list[list[int]]:
    """Greedy decoding of each prompt (grouped by length; no KV cache: the models here are small)."""
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for idx in by_len.values():
            ids = torch.tensor([prompts[i] for i in idx])
            done = torch.zeros(len(idx), dtype=torch.bool)
            for _ in range(max_new):
                nxt = logits_fn(ids)[:, -1].argmax(-1)
                for k, i in enumerate(idx):
                    if not done[k]:
                        if int(nxt[k]) == eos:
                            done[k] = True
                        else:
                            out[i].append(int(nxt[k]))
                ids = torch.cat([ids, nxt[:, None]], 1)
                if done.all():
                    break
    return out


def plan(argv: list[str]) -> None:
    """Print the sharding table and per-rank memory for a model on a mesh, without starting processes."""
    import funcpar as fp
    from funcpar.models import llama

    opts = _options(argv, "plan")
    mesh = fp.Mesh.abstract(**parse_mesh(opts["mesh"]))
    if opts["model"] in BUILTIN_MODELS:
        model, cfg = llama, llama.Config.from_hf(BUILTIN_MODELS[opts["model"]]).with_mesh(mesh)
    else:
        raw = json.loads((Path(opts["model"]) / "config.json").read_text())
        model = fp.hf.known_models()[raw.get("model_type")]
        cfg = model.Config.from_hf(raw).with_mesh(mesh)
    like = params_like(model, cfg)
    specs = model.specs(cfg, mesh)
    print(f"{cfg.model_type} on {mesh!r}: {sum(x.numel() for _, x in fp.tree.leaves_with_path(like)):,} parameters")
    print(sharding_table(like, specs, mesh))
    slots = {"adamw": 2, "lion": 1, "sgd": 1}.get(opts["optimizer"], 2)
    mem = memory_plan(like, specs, mesh, opts["zero"], slots)
    print(f"per rank (zero={opts['zero']}, {opts['optimizer']}): params {mem['params']:.2f} MiB, grads "
          f"{mem['grads']:.2f} MiB, optimizer state {mem['optimizer']:.2f} MiB, total {mem['total']:.2f} MiB")


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
    import funcpar as fp

    mesh = fp.Mesh(**sizes)
    src = Path(args.src)
    if (src / "config.json").exists():
        params, cfg = fp.hf.load(src, mesh=mesh)
        model = fp.hf.known_models()[cfg.model_type]
        specs = model.specs(cfg, mesh)
        step = fp.compile_step(lambda p, b: 0.0, specs, mesh=mesh, optimizer=fp.optim.sgd(0.0))
        step.init(params)
        fp.checkpoint.save(args.dst, fp.TrainState(params, None, 0), mesh,
                           extra={"model": cfg.model_type, "config": cfg.to_hf()}, step=step)
        what = "funcpar checkpoint"
    else:
        meta = json.loads((fp.checkpoint.resolve(src) / "meta.json").read_text())
        extra = meta.get("extra") or {}
        if "config" not in extra:
            raise SystemExit(f"funcpar: {src} does not record its model config (saved by funcpar train/convert?)")
        model = fp.hf.known_models()[extra["model"]]
        cfg = model.Config.from_hf(extra["config"])
        fp.checkpoint.export_hf(src, args.dst, model, cfg, mesh, max_shard_size=args.max_shard_size)
        what = "transformers folder"
    if mesh.rank == 0:
        print(f"wrote {what} {args.dst}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": train, "plan": plan, "convert": convert}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"funcpar: unknown command '{argv[0]}'", file=sys.stderr)
        print("usage: funcpar {train,plan,convert} [options]   (funcpar COMMAND --help for options)")
        if argv and argv[0] not in ("-h", "--help"):
            raise SystemExit(2)
        return
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
