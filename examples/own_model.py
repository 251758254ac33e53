"""Your own model: a pure function over a parameter tree, its specs, fp.verify, then compile_step.

    torchrun --nproc-per-node 2 examples/own_model.py     # Mesh(tp=2); python examples/own_model.py: one process

The README's "Your own model" section is this file.
"""

import os

import torch

import funcpar as fp
from funcpar import collectives as C

mesh = fp.Mesh(tp=int(os.environ.get("WORLD_SIZE", "1")))       # every rank of the job on tp
torch.manual_seed(0)                                          # global leaves, the same on every rank:
params = {"w1": torch.randn(16, 64) / 4, "w2": torch.randn(64, 16) / 8}
specs = {"w1": fp.P(None, "tp"), "w2": fp.P("tp", None)}      # w1 split by columns, w2 by rows


def loss_for(mesh):
    def loss(p, batch):                                       # this rank's shards; x replicated over tp
        h = torch.tanh(C.copy_to_region(batch["x"], mesh, "tp") @ p["w1"])        # (B, 64/tp)
        y = C.reduce_from_region(h @ p["w2"], mesh, "tp")                         # (B, 16), summed over tp
        return ((y - batch["y"]) ** 2).mean()
    return loss


g = torch.Generator().manual_seed(0)
batches = [{"x": torch.randn(8, 16, generator=g), "y": torch.randn(8, 16, generator=g)} for _ in range(3)]
report = fp.verify(loss_for, specs, params, batches, mesh)  # this mesh against one process: losses, grads, updates
assert report.ok, report
step = fp.compile_step(loss_for(mesh), specs, mesh=mesh, optimizer=fp.optim.adamw(1e-2))
state = step.init(fp.shard(params, specs, mesh))
for batch in batches * 10:
    state, metrics = step(state, batch)
if mesh.rank == 0:
    print(f"verified on {mesh!r}; loss {metrics['loss']:.4f} after {state.step} steps")
