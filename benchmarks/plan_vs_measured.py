"""`funcpar plan`'s predicted per-rank peak against the measured one, on several meshes and ZeRO stages.

    python benchmarks/plan_vs_measured.py                          # 165M-parameter Llama, the meshes below, 4 CPU ranks
    python benchmarks/plan_vs_measured.py --hidden 256 --layers 2 --vocab 4096 --cases "dp=2:1,tp=2:1"

For each case ``MESH:ZERO[:OPTION...]`` (options: ``remat``, ``accum2``, ``sgd``, ``bf16``, ``eager``: compile=False)
it traces the train step on meta tensors (:func:`funcpar.cli.planning.trace_plan`, what ``funcpar plan`` prints; a step
that ``compile="auto"`` compiles, on one GPU, gets its eager trace's figure, shown as ``~``) and then runs the same step for real
under ``torchrun`` from an HF folder (``fp.hf.load``, ``--steps`` steps of AdamW with clipping), and reports the
largest per-rank peak of the real run: ``torch.cuda.max_memory_allocated`` on a GPU, the peak resident set
(``ru_maxrss``) on a CPU. On a CPU the plan adds the runtime's own resident set (python, torch, funcpar: measured
in a fresh interpreter), as ``funcpar plan`` does, and each case runs twice: with glibc's defaults, whose heap keeps
freed blocks below its adaptive mmap threshold (so the resident peak exceeds what was ever live), and with
``MALLOC_MMAP_THRESHOLD_=131072``, which returns every tensor above 128 KiB to the system when freed (the resident
peak is then what the step holds). A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = "1:0,dp=2:1,dp=2:2,dp=2:3,tp=2,dp=2:1,tp=2,dp=2:3,dp=4:1:remat,tp=4:0:accum2"


def parse_cases(text: str) -> list[tuple[dict, int, set]]:
    """``"1:0,tp=2,dp=2:1:remat"`` -> cases; a mesh holds commas, so a case ends at a chunk with ':'."""
    out, cases, cur = [], [], ""
    for chunk in text.split(","):
        cur = f"{cur},{chunk}" if cur else chunk
        if ":" in chunk:
            cases.append(cur)
            cur = ""
    for case in cases:
        mesh_s, zero, *opts = case.split(":")
        axes = {} if mesh_s == "1" else {k: int(v) for k, v in (kv.split("=") for kv in mesh_s.split(","))}
        out.append((axes, int(zero), set(opts)))
    return out


def _model(args, mesh):
    import funcpar as fp

    llama = fp.get_model("llama")
    heads = max(1, args.hidden // 64)
    hf = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
              num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
              tie_word_embeddings=False, model_type="llama")
    return llama, hf, llama.config(hf, mesh)


def _step(llama, cfg, mesh, zero, opts, args):
    import torch

    import funcpar as fp

    opt = fp.optim.sgd(1e-3) if "sgd" in opts else fp.optim.adamw(1e-3, weight_decay=0.01)
    return fp.compile_step(llama.loss_fn(cfg, mesh, remat="remat" in opts), llama.specs(cfg, mesh), mesh=mesh,
                           optimizer=opt, zero=zero, clip_norm=1.0, accum_steps=2 if "accum2" in opts else 1,
                           param_dtype=torch.bfloat16 if "bf16" in opts else None,
                           compile=False if "eager" in opts else "auto")


def _batch(args, mesh, device):
    import torch

    dp = mesh.axis_size("dp")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).chunk(dp)[mesh.coord("dp")]
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def predict(axes, zero, opts, args) -> dict:
    import torch

    import funcpar as fp
    from funcpar.cli.planning import trace_plan

    mesh = fp.Mesh.abstract(device="cuda" if torch.cuda.is_available() else "cpu", **axes)
    llama, _, cfg = _model(args, mesh)
    step = _step(llama, cfg, mesh, zero, opts, args)
    r = trace_plan(llama, cfg, step, args.batch // mesh.axis_size("dp"), args.seq)
    base = r["runtime"]
    return {"peak": r["peak"] + base, "step_peak": r["step_peak"] + base, "state": r["state"], "base": base,
            "activations": r["activations"], "eager_trace": r["eager_trace"]}


def measure(axes, zero, opts, args) -> dict:
    import torch

    import funcpar as fp

    mesh = fp.Mesh(**axes)
    llama, _, cfg = _model(args, mesh)
    params, _ = fp.hf.load(args.weights, llama, mesh)
    step = _step(llama, cfg, mesh, zero, opts, args)
    state = step.init(params)
    del params
    gpu = torch.cuda.is_available()
    held = torch.cuda.memory_allocated() if gpu else 0  # the state between steps (what the plan calls "state")
    init_peak = torch.cuda.max_memory_allocated() if gpu else 0
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    batch = _batch(args, mesh, mesh.device)
    for _ in range(args.steps):
        state, m = step(state, batch)
    if gpu:
        step_peak = torch.cuda.max_memory_allocated()
        peak = max(init_peak, step_peak)
    else:
        step_peak = peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    got = torch.tensor([float(peak), float(step_peak), float(held)], device=mesh.device)
    if mesh.size > 1:
        got = fp.collectives.all_reduce(got, mesh, mesh.axis_names, "max")
    return {"peak": int(got[0]), "step_peak": int(got[1]), "state": int(got[2]), "loss": m["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in dict(hidden=1024, layers=8, vocab=32000, seq=128, batch=4, steps=2).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--weights", help="an HF folder (default: a fresh one, written once)")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # one case, measured here (under torchrun)
    args = ap.parse_args()
    if args.only:
        axes, zero, opts = parse_cases(args.only)[0]
        out = measure(axes, zero, opts, args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(out), flush=True)
        return
    if args.weights is None:
        import tempfile

        import transformers

        args.weights = tempfile.mkdtemp(prefix="funcpar-plan-")
        hf = _model(args, None)[1]
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).save_pretrained(args.weights)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cpu = not __import__("torch").cuda.is_available()
    envs = [("", env), ("MALLOC_MMAP_THRESHOLD_=131072", {**env, "MALLOC_MMAP_THRESHOLD_": "131072"})] if cpu else \
        [("", env)]
    head = " | ".join(f"measured{' (' + n + ')' if n else ''} MiB | error" for n, _ in envs)
    print(f"| mesh | zero | options | predicted peak MiB | {head} |\n|---|---|---|---|" + "---|---|" * len(envs))
    rows = []
    for axes, zero, opts in parse_cases(args.cases):
        n = 1
        for v in axes.values():
            n *= v
        case = (",".join(f"{k}={v}" for k, v in axes.items()) or "1") + f":{zero}" + "".join(f":{o}" for o in opts)
        pred = predict(axes, zero, opts, args)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               os.path.abspath(__file__), "--only", case, "--weights", args.weights] + [
            f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "vocab", "seq", "batch", "steps")]
        cells = []
        for name, e in envs:
            p = subprocess.run(cmd, env=e, capture_output=True, text=True, cwd=ROOT)
            if p.returncode:
                sys.exit(f"{case} failed:\n{p.stderr[-3000:]}")
            got = json.loads(p.stdout.strip().splitlines()[-1])
            err = pred["peak"] / got["peak"] - 1
            rows.append({"case": case, "env": name, "predicted": pred, "measured": got, "error": err})
            print("#", json.dumps(rows[-1]), flush=True)  # (each case's figures, before the table row)
            cells.append(f"{got['peak'] / 2**20:.0f} | {err:+.1%}")
        shown = ("~" if pred["eager_trace"] else "") + f"{pred['peak'] / 2**20:.0f}"
        print(f"| {case.split(':')[0]} | {zero} | {' '.join(sorted(opts)) or '-'} | {shown} | "
              + " | ".join(cells) + " |", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
