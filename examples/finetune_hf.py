"""Supervised fine-tuning of a Hugging Face checkpoint on the JSON formats, then an export transformers loads.

    torchrun --nproc-per-node 2 examples/finetune_hf.py --model path/to/hf-llama --data sft.jsonl   # its tokenizer
    python examples/finetune_hf.py --model path/to/hf-llama --data sft.jsonl --tokenizer byte     # one process, bytes

``sft.jsonl`` holds lines such as {"type": "instruct", "instruct": ..., "output": ...} or
{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}; the loss counts answer
tokens only. The export holds the tokenizer too, so ``transformers.pipeline("text-generation", OUT)`` loads it.
"""

import argparse
import os

import funcpar as fp

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True, help="a transformers folder (config.json + safetensors)")
ap.add_argument("--data", required=True, help="a .jsonl file or folder of the supervised formats")
ap.add_argument("--tokenizer", help="'byte' or a tokenizer folder (default: the model folder's own)")
ap.add_argument("--out", default="out/finetuned")
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--seq-len", type=int, default=128)
ap.add_argument("--global-batch", type=int, default=8)
args = ap.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
mesh = fp.Mesh(tp=world) if world > 1 else fp.Mesh()
params, cfg = fp.hf.load(args.model, mesh=mesh)                    # each rank reads only its slices
model = fp.get_model(cfg.model_type)                               # the registered model of that model_type
specs = model.specs(cfg, mesh)
tok = fp.data.ByteTokenizer() if args.tokenizer == "byte" else fp.data.HFTokenizer(args.tokenizer or args.model)
data = fp.data.Dataset.from_samples(fp.data.load_samples(args.data), tok, args.seq_len, pack=False)
if data.max_id >= cfg.vocab_size:
    raise SystemExit(f"the tokenizer produced id {data.max_id}, beyond the model's vocab_size {cfg.vocab_size}")
if mesh.rank == 0 and data.truncated:
    print(f"{data.truncated} of {data.samples} samples were longer than {args.seq_len} tokens and were truncated")

opt = fp.optim.adamw(fp.optim.warmup_linear_decay(1e-4, min(10, args.steps // 10), args.steps, warmup_type="linear"),
                     weight_decay=0.0)
step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, optimizer=opt, zero=1, clip_norm=1.0)
state = step.init(params)
for batch in fp.data.batches(data, mesh, global_batch=args.global_batch):
    state, metrics = step(state, batch)
    if mesh.rank == 0 and (state.step % 10 == 0 or state.step == 1):
        print(f"step {state.step}: loss {metrics['loss']:.4f}", flush=True)
    if state.step == args.steps:
        break
fp.hf.save(args.out, state.params, model, cfg, mesh, specs=specs, tokenizer=tok)  # pipeline() loads it
if mesh.rank == 0:
    print(f"exported {args.out}")
