"""Issue 53, item 1: every metric a run reports is the one-process run's, on every mesh.

`funcpar train`'s held-out loss once summed only this cp rank's pieces of each row while counting the targets of the
whole row (eval 1.6562 at cp=2 where every other mesh gave 3.5236), and its `tokens` counted each row once per cp
rank. Each case here builds the run `funcpar train` builds (`cli._setup_run`) on a real gloo mesh and on `Mesh()`
with the same options, and compares the held-out loss (pooled and per source) before and after a step, and the
step's loss, gradient norm and tokens.
"""

import json

import pytest

import harness

SOURCES = ("a.jsonl", "b.txt")
BASE = ["--model", "llama-micro", "--seq-len", "32", "--global-batch", "8", "--eval-fraction", "0.25",
        "--schedule", "constant", "--lr", "1e-2", "--device", "cpu"]


def _write_sources(folder) -> str:
    """Two sources: instruct samples (only the answers are targets, so cp pieces hold uneven targets) and text."""
    rows = [{"type": "instruct", "instruct": f"Add {a} and {b}.", "output": str(a + b)} for a in range(12) for b in range(6)]
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "b.txt").write_text("".join(f"the sum of {a} and {b} is {a + b}; " * 2 + "\n\n"
                                          for a in range(9) for b in range(5)))
    return ",".join(f"{folder / s}:0.5" for s in SOURCES)


def _metrics(sizes: dict, extra: list[str], data: str) -> dict:
    """The run's metrics on ``harness.mesh(**sizes)``: held-out before and after one step, and the step's."""
    from funcpar.cli import main as cli
    from funcpar.cli import options

    argv = [*BASE, "--data", data, *extra]
    opts = options.run_options(options.read_options(argv, "train"), argv)
    run = cli._setup_run(opts, harness.mesh(**sizes))
    before = cli._evaluate(run, run.eval_data, opts["global_batch"])
    run.state, m = run.step(run.state, next(run.loader))
    after = cli._evaluate(run, run.eval_data, opts["global_batch"])
    again = cli._evaluate(run, run.eval_data, opts["global_batch"])  # (evaluating changes nothing: no dropout)
    return {"eval_before": before, "eval_after": after, "eval_again": again,
            **{k: m[k] for k in ("loss", "grad_norm", "tokens")}}


def _close(got: dict, want: dict, where: str) -> None:
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (where, key, got[key], want[key])
    assert got["tokens"] == want["tokens"], (where, got["tokens"], want["tokens"])
    for key in ("eval_before", "eval_after"):
        (pooled, each), (pooled_ref, each_ref) = got[key], want[key]
        assert pooled == pytest.approx(pooled_ref, rel=1e-5), (where, key, pooled, pooled_ref)
        assert set(each) == set(SOURCES) == set(each_ref), (where, each)
        for name in SOURCES:
            assert each[name] == pytest.approx(each_ref[name], rel=1e-5), (where, key, name, each, each_ref)
    assert got["eval_again"] == got["eval_after"], where


CASES = [  # (world, mesh sizes, extra options)
    (2, {"cp": 2}, []),
    (2, {"cp": 2}, ["--cp-layout", "contiguous", "--micro-batches", "2"]),
    (2, {"pp": 2}, ["--micro-batches", "2"]),
    (2, {"tp": 2}, ["--sequence-parallel"]),
    (2, {"dp": 2}, ["--zero", "3"]),
    (2, {"pp": 2}, ["--micro-batches", "2", "--zero", "3"]),
    (4, {"cp": 2, "tp": 2}, []),
    (4, {"dp": 2, "cp": 2}, []),
]


def test_held_out_loss_tokens_and_grad_norm_equal_one_process_on_every_mesh(tmp_path):
    data = _write_sources(tmp_path)
    want = harness.run(1, _metrics, {}, [], data)[0]
    assert want["tokens"] == 8 * 32
    for world, sizes, extra in CASES:
        got = harness.run(world, _metrics, sizes, extra, data)
        for r, g in enumerate(got):
            _close(g, want, f"{sizes} {extra} rank {r}")


LORA = ["--lora", "r=4,alpha=8,targets=q,v,o"]


def test_a_lora_runs_held_out_loss_equals_one_process_and_draws_no_dropout(tmp_path):
    """LoRA on cp=2 and at ZeRO-3 (the base 1/dp per rank) against LoRA on one process; with dropout, evaluating
    twice gives the same loss (the adapters' dropout is off when no gradient is formed)."""
    data = _write_sources(tmp_path)
    want = harness.run(1, _metrics, {}, LORA, data)[0]
    for world, sizes, extra in [(2, {"cp": 2}, LORA), (2, {"dp": 2}, [*LORA, "--zero", "3"])]:
        for r, g in enumerate(harness.run(world, _metrics, sizes, extra, data)):
            _close(g, want, f"{sizes} {extra} rank {r}")
    dropout = harness.run(1, _metrics, {}, ["--lora", "r=4,alpha=8,targets=q,v,o,dropout=0.2"], data)[0]
    assert dropout["eval_again"] == dropout["eval_after"]
