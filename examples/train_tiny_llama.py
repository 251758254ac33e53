"""Train a small Llama from scratch with funcpar's Python API: the README quickstart's loop, end to end.

    torchrun --nproc-per-node 4 examples/train_tiny_llama.py            # Mesh(tp=2, dp=2) on 4 CPU processes
    python examples/train_tiny_llama.py --steps 50                      # one process, Mesh()

It trains on the arithmetic task shipped with funcpar, checkpoints, and exports a transformers folder.
"""

import argparse
import os

import torch

import funcpar as fp
from funcpar.assets import ARITHMETIC

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--out", default="out/tiny")
args = ap.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
mesh = fp.Mesh(tp=2, dp=world // 2) if world > 1 else fp.Mesh()
torch.manual_seed(0)
llama = fp.get_model("llama")                                      # the registered model (a ModelSpec)

cfg = llama.Config.from_hf(dict(vocab_size=264, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, model_type="llama"))
specs = llama.specs(cfg, mesh)                                     # pytree of P(...) matching the params
params = fp.shard(llama.init(cfg, seed=0), specs, mesh)            # each rank keeps its blocks
warmup = min(20, args.steps // 10)
opt = fp.optim.adamw(fp.optim.warmup_cosine(3e-3, warmup, total=args.steps), b2=0.95, weight_decay=0.01)
loss_fn = llama.loss_fn(cfg, mesh)                                 # loss_fn(params, batch) -> scalar
step = fp.compile_step(loss_fn, specs, mesh=mesh, optimizer=opt, zero=1, accum_steps=2, clip_norm=1.0)
state = step.init(params)                                          # optimizer state sharded over dp (ZeRO-1)

tok = fp.data.ByteTokenizer()
data = fp.data.Dataset.from_samples(fp.data.load_samples(ARITHMETIC), tok, seq_len=64)
loader = fp.data.batches(data, mesh, global_batch=32)

for batch in loader:
    state, metrics = step(state, batch)                            # loss, grad_norm, lr, tokens/s
    if mesh.rank == 0 and state.step % 20 == 0:
        print(f"step {state.step}: loss {metrics['loss']:.4f}, {metrics['tokens_per_s']:.0f} tokens/s", flush=True)
    if state.step == args.steps:
        break

step.save(f"{args.out}/ckpt/step-{state.step}", state, extra={"data": loader.state_dict()})
fp.hf.save(f"{args.out}/hf", state.params, llama, cfg, mesh, tokenizer=tok)  # transformers.pipeline loads it
if mesh.rank == 0:
    print(f"final loss {metrics['loss']:.4f}; exported {args.out}/hf")
