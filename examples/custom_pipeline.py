"""A model of your own on pipeline stages with ZeRO-3: no Hugging Face form, no ModelSpec, no registry.

    torchrun --nproc-per-node 4 examples/custom_pipeline.py     # Mesh(pp=2, dp=2), zero=3

The model is written as its staged form, ``loss = head(blocks(embed(batch)))`` (fp.Stages), and
``fp.Loss(stages=, init=, mesh=)`` is all ZeRO-3 and pipeline stages read: the stages to cut and gather block by
block, ``init(cfg, device="meta")`` for the shapes the stage plan weighs. fp.verify checks it on the mesh against one
process (losses, gradients, updated parameters), then it trains. tests/test_custom_pipeline.py runs it.
"""

import torch
import torch.nn.functional as F

import funcpar as fp

D, H, N_LAYERS = 16, 64, 4
mesh = fp.Mesh(pp=2, dp=2)                                    # 2 pipeline stages x 2 data-parallel ranks


def init(cfg=None, device=None):                              # the global tree; device="meta": shapes only
    g = torch.Generator().manual_seed(0)

    def w(rows, cols):
        return torch.empty(rows, cols, device="meta") if device == "meta" else torch.randn(rows, cols, generator=g) / cols**0.5
    return {"w_in": w(H, D), "layers": [{"w1": w(H, H), "w2": w(H, H)} for _ in range(N_LAYERS)], "w_out": w(D, H)}


stages = fp.Stages(                                           # a residual MLP; the blocks are params["layers"]
    embed=lambda p, batch, cfg, mesh: F.linear(batch["x"], p["w_in"]),                          # (B, D) -> (B, H)
    block=lambda lp, x, i, cfg, mesh: x + F.linear(torch.tanh(F.linear(x, lp["w1"])), lp["w2"]),  # (B, H)
    head=lambda p, x, batch, cfg, mesh, reduction="mean": F.mse_loss(F.linear(x, p["w_out"]), batch["y"],
                                                                     reduction=reduction),
    embed_leaves=lambda cfg: ["w_in"], head_leaves=lambda cfg: ["w_out"])


def loss_for(mesh):                                           # the loss is stages.loss on this mesh
    return fp.Loss(stages=stages, init=init, mesh=mesh)


g = torch.Generator().manual_seed(1)
target = torch.randn(D, D, generator=g) / D**0.5
batches = [{"x": (x := torch.randn(16, D, generator=g)), "y": torch.sin(x @ target)} for _ in range(4)]
params, specs = init(), fp.P()                                # global leaves, alike on every rank; none split
report = fp.verify(loss_for, specs, params, batches, mesh, zero=3, accum_steps=2)  # this mesh against one process
assert report.ok, report
step = fp.compile_step(loss_for(mesh), specs, mesh=mesh, zero=3, accum_steps=2, optimizer=fp.optim.adamw(3e-3))
state, losses = step.init(fp.shard(params, specs, mesh)), []
for batch in batches * 10:
    state, metrics = step(state, {k: v.chunk(2)[mesh.coord("dp")] for k, v in batch.items()})  # this dp rank's rows
    losses.append(metrics["loss"])
if mesh.rank == 0:
    print(f"verified on {mesh!r}; loss {losses[0]:.4f} -> {losses[-1]:.4f} after {state.step} steps")
