"""The plan's step-time model (``funcpar plan --gpu``, :func:`funcpar.cli.planning.estimate_time`) calibrated on the one
GPU measurement funcpar has, and checked against one published multi-GPU figure.

    python benchmarks/multi_gpu_estimate.py

1. Calibration: the Llama-3.2-1B shape (hidden 2048, 16 layers, 32 / 8 heads, vocab 128256, tied), bf16 compute,
   4 x 2048 tokens, one GPU: funcpar's compiled step took 0.156 s on one H100 (issue 44). The traced FLOPs of that
   step over 0.156 s, as a fraction of 989 TFLOP/s, is the efficiency the model assumes
   (``planning.MEASURED_EFFICIENCY``).
2. Check: torchtitan's Llama 3.1 8B on 8 H100s within one NVLink node, FSDP (ZeRO-3 here), local batch 2 x 8192,
   bf16, activation checkpointing: 5,762 tokens/s per GPU eager, 6,667 compiled (pytorch/torchtitan
   docs/performance.md, Table 1; selective checkpointing there, every layer recomputed here, so the estimate
   counts more FLOPs than that run did). The plan traces the step on meta tensors over ``Mesh.abstract(dp=8)``.

A benchmark, not a test: it prints the figures, it asserts nothing. Each trace takes a minute or two on the CPU.
"""

from __future__ import annotations

import time

import torch

import funcpar as fp
from funcpar.models import llama
from funcpar.cli.planning import GPUS, MEASURED_EFFICIENCY, estimate_time, trace_plan

SHAPES = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def traced(shape: str, axes: dict, rows: int, seq: int, zero: int, remat: bool) -> dict:
    mesh = fp.Mesh.abstract(device="cpu", **axes)
    n = SHAPES[shape]["num_hidden_layers"]
    cfg = llama.Config(**SHAPES[shape], max_position_embeddings=seq, sliding_windows=(None,) * n).with_mesh(mesh)
    step = fp.compile_step(llama.MODEL.loss_fn(cfg, mesh, remat=remat), llama.specs(cfg, mesh), mesh=mesh,
                           optimizer=fp.optim.adamw(1e-4), zero=zero, param_dtype=torch.bfloat16, check=False)
    return trace_plan(llama.MODEL, cfg, step, rows, seq)


def main() -> None:
    t0 = time.time()
    one = traced("1b", {}, 4, 2048, 0, False)
    eff = one["flops"] / 0.156 / GPUS["h100"]["bf16"]
    print(f"1B shape, 4 x 2048 tokens on one GPU: {one['flops'] / 1e12:.1f} TFLOP traced; at the measured 0.156 s "
          f"that is {eff:.1%} of 989 TFLOP/s (planning.MEASURED_EFFICIENCY = {MEASURED_EFFICIENCY})")
    eight = traced("8b", {"dp": 8}, 2, 8192, 3, True)
    e = estimate_time(eight, {"dp": 8}, "h100", ("nvlink", "ib400"), 8, torch.bfloat16)
    tps = 2 * 8192 / e["step"]
    print(f"8B, dp=8 ZeRO-3, 2 x 8192 tokens per GPU, remat: {eight['flops'] / 1e12:.1f} TFLOP and "
          f"{sum(eight['traffic'].values()) / 2**30:.1f} GiB sent per GPU per step; estimated {e['step']:.2f} s "
          f"(compute {e['compute']:.2f} s, dp {e['comm'].get('dp', 0):.2f} s) = {tps:,.0f} tokens/s per GPU, "
          f"against torchtitan's 5,762 eager / 6,667 compiled ({tps / 5762 - 1:+.0%} / {tps / 6667 - 1:+.0%}); "
          f"peak {eight['peak'] / 2**30:.1f} GiB per GPU planned")
    print(f"assumed: {e['assumptions']}  ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
