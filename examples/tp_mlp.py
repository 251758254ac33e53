"""The foundation demo: a tensor-parallel MLP trained on ``Mesh(tp=2, dp=2)`` over 4 local CPU processes.

    python examples/tp_mlp.py                                   # starts its own 4 ranks (torch.distributed.run)
    torchrun --nproc-per-node 4 examples/tp_mlp.py              # the same, under torchrun
    python examples/tp_mlp.py --tp 1 --dp 1                     # one process, Mesh(dp=1, tp=1)

The model is written once, per shard: a column-parallel layer (weights split over ``tp`` along the hidden
dimension) feeding a row-parallel one, with Megatron's f/g collectives between. Each dp rank trains on its own
share of the global batch; gradients of replicated leaves are averaged over dp. The loss printed by rank 0 falls as
the MLP learns a fixed random teacher network.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import funcpar as fp
from funcpar import collectives as C


def mlp_init(d: int, h: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Global (unsharded) parameters of a 2-layer MLP ``d -> h -> d``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(d, h, generator=g) / d**0.5,
        "b1": torch.zeros(h),
        "w2": torch.randn(h, d, generator=g) / h**0.5,
        "b2": torch.zeros(d),
    }


def mlp_specs() -> dict[str, fp.P]:
    return {"w1": fp.P(None, "tp"), "b1": fp.P("tp"), "w2": fp.P("tp", None), "b2": fp.P()}


def mlp_forward(params: dict[str, torch.Tensor], x: torch.Tensor, mesh: fp.Mesh) -> torch.Tensor:
    """Per-shard forward; ``x`` (B, d) is replicated over tp. At ``Mesh()`` this is the plain MLP."""
    x = C.copy_to_region(x, mesh, "tp")
    h = torch.nn.functional.gelu(x @ params["w1"] + params["b1"])  # (B, d) @ (d, h/tp) -> (B, h/tp)
    y = h @ params["w2"]  # (B, h/tp) @ (h/tp, d) -> (B, d), partial over tp
    return C.reduce_from_region(y, mesh, "tp") + params["b2"]


def mlp_loss(params, batch, mesh: fp.Mesh) -> torch.Tensor:
    x, y = batch
    return ((mlp_forward(params, x, mesh) - y) ** 2).mean()


def train(steps: int, d: int, h: int, global_batch: int, lr: float, tp: int, dp: int) -> list[float]:
    """Plain SGD on this rank's shards; returns the dp-averaged loss of every step."""
    mesh = fp.Mesh(tp=tp, dp=dp)
    specs = mlp_specs()
    params = fp.shard(mlp_init(d, h, seed=0), specs, mesh)
    teacher = mlp_init(d, 4 * d, seed=1)
    local_b = global_batch // dp
    grad_fn = torch.func.grad_and_value(mlp_loss)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)  # the same global batch on every rank
        x = torch.randn(global_batch, d, generator=g)
        y = mlp_forward(teacher, x, fp.Mesh())
        lo = mesh.coord("dp") * local_b
        grads, loss = grad_fn(params, (x[lo : lo + local_b], y[lo : lo + local_b]), mesh)
        # the leaves are replicated over dp: average their gradients (and the loss, for the report)
        grads = {k: C.all_reduce(v, mesh, "dp", "avg") for k, v in grads.items()}
        loss = C.all_reduce(loss, mesh, "dp", "avg")
        params = {k: params[k] - lr * grads[k] for k in params}
        losses.append(loss.item())
        if mesh.rank == 0 and (step % 20 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args(argv)
    world = args.tp * args.dp
    if "RANK" not in os.environ and world > 1:
        # not under torchrun: start the ranks through torch's own launcher, each running this file
        from torch.distributed.run import main as torchrun

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torchrun(["--standalone", f"--nproc-per-node={world}", os.path.abspath(__file__), *argv])
        return
    torch.set_num_threads(1)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(f"funcpar demo: tensor-parallel MLP on Mesh(tp={args.tp}, dp={args.dp}), {world} process(es)", flush=True)
    losses = train(args.steps, d=32, h=128, global_batch=64, lr=args.lr, tp=args.tp, dp=args.dp)
    if rank0:
        print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f} ({losses[-1] / losses[0]:.1%} of the first step)", flush=True)


if __name__ == "__main__":
    main()
