"""Peak memory of a train step: funcpar against the plain eager PyTorch loop (and DeepSpeed), same model and batch.

    python benchmarks/memory.py                              # the 165M-parameter Llama of issue 10, one process each
    python benchmarks/memory.py --hidden 256 --layers 2 --vocab 4096     # a quick run

Every configuration runs in a fresh process (so each peak is its own): build the model, train ``--steps`` steps of
AdamW with clipping, report the peak resident set size (``ru_maxrss``; ``torch.cuda.max_memory_allocated`` on a GPU)
over the parameter bytes. Prints a markdown table and one JSON line. With ``--dp 2``: funcpar ZeRO-1/2/3 and DeepSpeed
ZeRO-1/2/3 (``pip install deepspeed``; ``DS_ACCELERATOR=cpu`` is set) over 2 local processes, the largest per-rank
peak of each. A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "params": "parameters only (python + torch + weights)",
    "eager": "transformers + torch.optim.AdamW(foreach=True) + clip_grad_norm_",
    "funcpar": "funcpar compile_step(zero=0, clip_norm=1.0), fp.optim.adamw",
}
DIST_RUNS = {  # --dp N: N local processes each, per-rank peak (the largest of the ranks)
    "funcpar-z1": "funcpar Mesh(dp=N) zero=1", "funcpar-z2": "funcpar Mesh(dp=N) zero=2",
    "deepspeed-z1": "DeepSpeed ZeRO-1 (AdamW, clipping)", "deepspeed-z2": "DeepSpeed ZeRO-2 (AdamW, clipping)",
    "funcpar-z3": "funcpar Mesh(dp=N) zero=3", "deepspeed-z3": "DeepSpeed ZeRO-3 (AdamW, clipping)",
}


def _config(args):
    heads = max(1, args.hidden // 64)
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                tie_word_embeddings=False, model_type="llama")


def _batch(args):
    import torch

    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)}


def _peak_bytes() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_one(kind: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import funcpar as fp

    llama = fp.get_model("llama")
    mesh = fp.Mesh(dp=int(os.environ.get("WORLD_SIZE", "1")))
    params, cfg = fp.hf.load(args.weights, llama)  # the same weights for every configuration
    nbytes = sum(x.numel() * x.element_size() for _, x in fp.tree.leaves_with_path(params))
    batch = {k: v.chunk(mesh.size)[mesh.rank].to(mesh.device) for k, v in _batch(args).items()}
    losses = []
    if kind == "eager" or kind.startswith("deepspeed"):
        del params
        losses = _eager(kind, args, batch, mesh)
    elif kind.startswith("funcpar"):
        zero = 0 if kind == "funcpar" else int(kind[-1])
        step = fp.compile_step(llama.loss_fn(cfg, mesh), llama.specs(cfg), mesh=mesh,
                               optimizer=fp.optim.adamw(1e-3, weight_decay=0.01), zero=zero, clip_norm=1.0)
        state = step.init(params)
        del params
        for _ in range(args.steps):
            state, m = step(state, batch)
            losses.append(m["loss"])
    peak = torch.tensor(float(_peak_bytes()))
    if mesh.size > 1:
        peak = fp.collectives.all_reduce(peak, mesh, "dp", "max")
    return {"kind": kind, "param_bytes": nbytes, "peak_bytes": int(peak), "losses": losses, "ranks": mesh.size}


def _eager(kind: str, args, batch: dict, mesh) -> list[float]:
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(args.weights).to(mesh.device)
    batch = {k: v.to(mesh.device) for k, v in batch.items()}
    losses = []
    if kind == "eager":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    else:
        import deepspeed

        n = batch["input_ids"].shape[0]
        config = {"train_batch_size": n * mesh.size, "train_micro_batch_size_per_gpu": n,
                  "zero_optimization": {"stage": int(kind[-1])}, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}
        model, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(args.steps):
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        if kind == "eager":
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.backward(loss)
            model.step()
        value = loss.detach().clone()
        if mesh.size > 1:  # the mean over the data-parallel ranks, as funcpar reports it
            value = fp_all_reduce_mean(value, mesh)
        losses.append(value.item())
    return losses


def fp_all_reduce_mean(x, mesh):
    import funcpar as fp

    return fp.collectives.all_reduce(x, mesh, "dp", "avg")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=sorted(RUNS) + sorted(DIST_RUNS), help=argparse.SUPPRESS)  # one, here
    ap.add_argument("--runs", default=None, help=f"comma-separated, of {', '.join(RUNS)}; with --dp: {', '.join(DIST_RUNS)}")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel processes (the distributed runs)")
    ap.add_argument("--weights", help="an HF folder to start from (default: a fresh one, written once)")
    args = ap.parse_args()
    if args.only:
        out = run_one(args.only, args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(out), flush=True)
        return
    runs = (args.runs or ",".join(DIST_RUNS if args.dp > 1 else RUNS)).split(",")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    if args.weights is None:
        import tempfile

        import torch
        import transformers

        args.weights = tempfile.mkdtemp(prefix="funcpar-bench-")
        torch.manual_seed(0)  # the same weights, so the same losses, in every invocation
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**_config(args))).save_pretrained(args.weights)
    rows = []
    for kind in runs:
        launch = [sys.executable] if args.dp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc-per-node={args.dp}"]
        env["DS_ACCELERATOR"] = "cpu"
        cmd = launch + [os.path.abspath(__file__), "--only", kind] + [
            f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "vocab", "seq", "batch", "steps", "threads",
                                                  "weights")]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"{kind} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| | peak RSS / parameter bytes | peak MiB | losses |\n|---|---|---|---|")
    names = {**RUNS, **DIST_RUNS}
    for r in rows:
        name = names[r["kind"]].replace("=N", f"={r['ranks']}")
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        print(f"| {name} | {r['peak_bytes'] / r['param_bytes']:.2f}x | {r['peak_bytes'] / 2**20:.0f} | {losses} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
