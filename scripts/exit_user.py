"""A user's training script, the way torchtitan's and most are written, in one of several start-up and tear-down
orders (issue 56): scripts/exit_stress.py runs it under torchrun, many times, and counts the ranks that abort.

    torchrun --nproc-per-node 4 scripts/exit_user.py ORDER MESH OUT     # e.g. user-destroy tp=2,dp=2 /tmp/out

ORDER: ``user`` (the script calls ``dist.init_process_group`` before the mesh) or ``funcpar`` (the mesh starts
the world), then ``-destroy`` (``dist.barrier(); dist.destroy_process_group()`` at the end), ``-raise`` (rank 1 raises
after the steps) or nothing (the interpreter exits with the groups alive).
"""

import sys

import torch
import torch.distributed as dist

import funcpar as fp

order, mesh_text, out = sys.argv[1], sys.argv[2], sys.argv[3]
if order.startswith("user"):
    dist.init_process_group("gloo")
mesh = fp.Mesh(**{k: int(v) for k, v in (kv.split("=") for kv in mesh_text.split(","))})
model = fp.get_model("llama")
cfg = model.config(dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), mesh)
specs = model.specs(cfg, mesh)
pipe = {"accum_steps": 2} if mesh.axis_size("pp") > 1 else {}
step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, optimizer=fp.optim.adamw(1e-3), zero=1,
                       clip_norm=1.0, **pipe)
state = step.init(fp.shard(model.init(cfg, seed=0), specs, mesh))
g = torch.Generator().manual_seed(0)
for _ in range(3):
    ids = torch.randint(0, 128, (8 // mesh.axis_size("dp"), 16), generator=g)
    state, _ = step(state, {"input_ids": ids, "labels": ids})
if order.endswith("-raise") and mesh.rank == 1:
    raise RuntimeError("the user's own error on rank 1")
fp.hf.save(out, step.gather_params(state), model, cfg, mesh, overwrite=True)
if order.endswith("-destroy"):
    dist.barrier()
    dist.destroy_process_group()
print(f"rank {mesh.rank} done", flush=True)
