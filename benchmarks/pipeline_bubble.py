"""The pipeline's measured bubble against its schedule's planned one, on a model whose blocks take a fixed time.

    python benchmarks/pipeline_bubble.py                 # pp=2, 4 and 8 micro-batches, every schedule

Each block holds its rank for a fixed time (6 ms forward, 12 ms backward: half the input's gradient, half the
weights', so a zero-bubble schedule's split passes take half each), so the bubble the step measures (its metric
``bubble``: 1 - busy / (pp x the longest rank's walk)) depends on the schedule alone, not on the model's arithmetic.
Prints, per schedule and micro-batch count, the median measured bubble over three steps (after one warm-up) beside
:meth:`funcpar.pipeline.schedule.Schedule.simulate`'s. Wall-clock figures: a loaded machine moves them (they were a test until
issue 41, and failed under load). A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import funcpar as fp  # noqa: E402
import harness  # noqa: E402
import tinylm  # noqa: E402

V, T, LAYERS, BUSY_S = 96, 8, 8, 0.006
SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb", None), ("zb", 2)]


class _Busy(torch.autograd.Function):
    """Holds its rank for ``BUSY_S`` forward and twice that backward (half for the input's gradient, half for the
    weight's, a zero: each pass of a split backward narrows ``needs_input_grad``), as a block's compute would."""

    @staticmethod
    def forward(x, w):
        time.sleep(BUSY_S)
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.w_shape = inputs[1].shape

    @staticmethod
    def backward(ctx, g):
        need = ctx.needs_input_grad
        time.sleep(BUSY_S * sum(need))
        return g if need[0] else None, g.new_zeros(ctx.w_shape) if need[1] else None


def _busy_block(lp, x, i, cfg, mesh):
    # the norm's weight given to _Busy alone (the block gets a copy outside autograd): used once, its gradient is
    # _Busy's alone, so the weight pass runs _Busy's backward and nothing above it
    return _Busy.apply(tinylm._block({**lp, "norm": lp["norm"].detach()}, x, i, cfg, mesh), lp["norm"])


def bubbles(micro: int) -> dict:
    """On each rank of a pp=2 gloo mesh: the median measured bubble of every schedule at ``micro`` micro-batches."""
    mesh = harness.mesh(pp=2)
    model = dataclasses.replace(tinylm.MODEL, name="busy", stages=dataclasses.replace(tinylm.MODEL.stages,
                                                                                      block=_busy_block))
    cfg = tinylm.Config(vocab_size=V, d_model=16, d_hidden=32, n_layers=LAYERS)
    specs = model.specs(cfg, mesh)
    ids = torch.randint(0, V, (micro, T), generator=torch.Generator().manual_seed(0))
    out = {}
    for pipeline, chunks in SCHEDULES:
        stages = 2 * (chunks or 1)  # equal layers a stage: equal busy time (the default cut would weigh the head)
        step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, accum_steps=micro, pipeline=pipeline,
                               chunks=chunks, parts=[LAYERS // stages] * stages)
        state = step.init(fp.shard(model.init(cfg), specs, mesh))
        measured = []
        for _ in range(4):
            state, m = step(state, {"input_ids": ids})
            measured.append(m["bubble"])
        out[(pipeline, chunks)] = statistics.median(measured[1:])
    return out


def main() -> None:
    print("| micro-batches | schedule | measured bubble | planned | difference |")
    print("|---|---|---|---|---|")
    for micro in (4, 8):
        measured = harness.run(2, bubbles, micro)[0]
        for pipeline, chunks in SCHEDULES:
            planned = fp.pipeline.make_schedule(pipeline, 2, micro, chunks or 1).simulate()["bubble"]
            got = measured[(pipeline, chunks)]
            name = pipeline + (f" x{chunks}" if chunks else "")
            print(f"| {micro} | {name} | {got:.3f} | {planned:.3f} | {got - planned:+.3f} |", flush=True)


if __name__ == "__main__":
    main()
