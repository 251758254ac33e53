"""`funcpar plan --devices N`'s layout search (funcpar/cli/search.py): what it enumerates, how a layout is traced in
bounded time (one step; two shallow depths of a deep model; two short micro-batch counts), and the floors that let
it leave layouts out untraced without leaving out a faster one."""

from __future__ import annotations

import json
import math
import time
import types

import pytest
import torch

from funcpar.cli import main as cli
from funcpar.cli import planning
from funcpar.cli.search import Search, covers, layouts, micro_counts, stage_depth, trace_layout


def _folder(tmp_path, layers: int, hidden: int = 64) -> str:
    """A small Llama config folder of ``layers`` alike layers."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}))
    return str(tmp_path)


def _planner(model: str, mesh: str, *extra: str):
    ranking, opts, build, estimate = cli.planner(["--model", model, "--mesh", mesh, "--global-batch", "8",
                                                  "--seq-len", "32", "--gpu", "h100", "--precision", "bf16", *extra])
    return cli.parse_mesh(opts["mesh"]), opts, build, estimate


def test_the_layouts_cover_each_zero_stage_remat_schedule_and_micro_batch_count():
    """Every mesh at ZeRO 0-3, remat off and on, and on pipelines every schedule, at the micro-batch counts that
    split a dp rank's rows (on pp stages: pp times a power of two, and a row each)."""
    assert micro_counts(16) == [1, 2, 4, 8, 16]
    assert micro_counts(128, 8) == [8, 16, 32, 64, 128]
    assert micro_counts(24, 4) == [4, 8, 24]
    assert micro_counts(16, 1, 4) == [4] and micro_counts(16, 1, 3) == []
    rows = layouts(8, 128, pipeline=True, zeros=(0, 1, 2, 3), remats=(False, True),
                   schedules=("1f1b", "gpipe", "interleaved", "zb"), search_micro=True)
    keys = {(tuple(r["axes"].items()), r["zero"], r["remat"], r["schedule"], r["micro"]) for r in rows}
    assert len(keys) == len(rows)
    assert ((("pp", 8), ("dp", 1), ("tp", 1)), 0, True, "zb", 128) in keys
    assert ((("pp", 2), ("dp", 4), ("tp", 1)), 3, False, "interleaved", 4) in keys
    assert {m for (axes, z, remat, s, m) in keys if axes == (("dp", 8), ("tp", 1))} == {1, 2, 4, 8, 16}
    assert {s for (axes, *_, s, m) in keys if axes == (("dp", 8), ("tp", 1))} == {None}  # (no schedule off pp)
    # 4 pp=1 meshes x 4 zeros x 2 remats x their counts; 6 pipeline meshes x 4 x 2 x 4 schedules x their counts
    plain = sum(len(micro_counts(128 // (8 // tp))) for tp in (1, 2, 4, 8))
    pipelines = sum(len(micro_counts(128 // (8 // pp // tp), pp)) for pp, tp in
                    ((2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)))
    assert (plain, pipelines) == (5 + 6 + 7 + 8, 34) and len(rows) == 4 * 2 * plain + 4 * 2 * 4 * pipelines


def test_one_traced_step_gives_every_steps_figures():
    """trace_plan traces one step after init: a second step's FLOPs, operators, bytes sent and peak are the
    first's, at ZeRO 3, on a zero-bubble pipeline, and with remat over tp."""
    for mesh, extra in (("dp=2", ("--zero", "3")), ("pp=2,dp=2", ("--pipeline", "zb", "--micro-batches", "4")),
                        ("tp=2", ("--remat",))):
        axes, opts, build, _ = _planner("llama-micro", mesh, *extra)
        model, cfg, step, rows, seq = build(axes, opts["zero"])
        params = planning.local_params(planning.params_like(model, cfg), step.specs, step.mesh)
        ids = torch.zeros(rows, seq, dtype=torch.long, device="meta")
        one, two = (planning.trace_step(step, params, {"input_ids": ids, "labels": ids}, steps=n) for n in (1, 2))
        for k in ("flops", "ops", "traffic", "peak", "step_peak", "state"):
            assert one[k] == two[k], (mesh, k)


@pytest.mark.parametrize("layers,mesh,extra,depths", [
    (8, "dp=2", ("--zero", "3"), (2, 3, 8.0)),
    (12, "pp=2", ("--pipeline", "1f1b", "--micro-batches", "4"), (2.5, 3.5, 6.5)),  # (stage 0: 13 half-layers)
])
def test_a_deep_model_of_alike_layers_is_traced_at_two_depths_and_extrapolated(tmp_path, layers, mesh, extra,
                                                                               depths):
    """A model whose layers are alike is traced at two and three layers a stage (and a half more where the stage
    ends on half a layer) and extrapolated: the FLOPs, memory, bytes sent, operators and the estimate are those of
    tracing it whole."""
    axes, opts, build, estimate = _planner(_folder(tmp_path, layers), mesh, *extra)
    fast = trace_layout(build, axes, opts["zero"], True)
    assert fast["extrapolated"] == {"layers": depths}
    model, cfg, step, rows, seq = build(axes, opts["zero"])
    full = planning.trace_plan(model, cfg, step, rows, seq, gpu=True)
    for k in ("flops", "state", "step_peak", "peak", "activations"):
        assert fast[k] == pytest.approx(full[k], rel=1e-9), k
    assert fast["traffic"] == pytest.approx(full["traffic"], rel=1e-9)
    assert sum(fast["ops"].values()) == pytest.approx(sum(full["ops"].values()), rel=1e-9)
    assert estimate(fast, axes, step)["step"] == pytest.approx(estimate(full, axes, step)["step"], rel=1e-9)


def test_a_model_whose_layers_differ_is_traced_whole():
    """stage_depth: the layers' leaves and shapes alike and every per-layer setting the same, else None."""
    def model(shapes):
        return types.SimpleNamespace(stages=types.SimpleNamespace(layers="layers"), init=lambda cfg, device: {
            "layers": [{"w": torch.empty(*s, device="meta")} for s in shapes]})
    plain = types.SimpleNamespace(executor=None)
    cfg = types.SimpleNamespace(layer_types=["full", "full"])
    assert stage_depth(model([(2, 2), (2, 2)]), cfg, plain) == 2.0
    assert stage_depth(model([(2, 2), (2, 3)]), cfg, plain) is None
    assert stage_depth(model([(2, 2), (2, 2)]), types.SimpleNamespace(layer_types=["full", "sliding"]), plain) is None
    assert stage_depth(types.SimpleNamespace(stages=None), cfg, plain) is None


def test_the_floors_bound_every_judged_layout_and_leave_out_slower_ones(tmp_path):
    """Search.floor is never above a judged layout's estimate (its matmuls and kernels at the reached rates, its
    operators' dispatch and its tp bytes are in the estimate), and the search leaves out, untraced, the layouts
    whose floor is above the best found (``shown=1``; a step bound by its matmuls, slow links): its first is what judging
    every layout gives, and nothing faster than its best few was left out unless a judged layout covers it."""
    ranking, opts, build, estimate = cli.planner(["--model", _folder(tmp_path, 4, hidden=1024), "--global-batch", "8",
                                                  "--seq-len", "256", "--gpu", "a100", "--precision", "fp32",
                                                  "--links", "eth100,eth100"])  # (bound by its matmuls)
    space = dict(zeros=(1, 3), remats=(False,), schedules=("1f1b", "gpipe"), search_micro=True)
    search = Search(build, float("inf"), estimate, gpu=True, layers=4, global_batch=8)
    ranked = search.run(layouts(4, 8, pipeline=True, **space), shown=1)
    judged = [r for r in ranked if "time" in r]
    assert judged and all(r["floor"] <= r["time"]["step"] * (1 + 1e-9) for r in judged)
    assert search.said["floor"] > 0, search.said
    every = Search(build, float("inf"), estimate, gpu=True, layers=4, global_batch=8)
    # (off pipelines more micro-batches than the fewest that fit only add work: the search judges m=1 there)
    rows = [every.judge(r) for r in layouts(4, 8, pipeline=True, **space) if r["axes"].get("pp", 1) > 1
            or r["micro"] == 1]
    assert len(rows) > len(judged) and all(r["floor"] <= r["time"]["step"] * (1 + 1e-9) for r in rows
                                           if "time" in r and "floor" in r)
    assert min(r["time"]["step"] for r in rows if "time" in r) == pytest.approx(judged[0]["time"]["step"], rel=1e-9)

    def key(r):
        return tuple(r["axes"].items()), r["zero"], r["remat"], r["schedule"], r["micro"]
    seen = {key(r) for r in ranked}
    for r in (r for r in rows if "time" in r and r["time"]["step"] < judged[0]["time"]["step"] * (1 - 1e-9)):
        assert key(r) in seen or any(covers(a, r) for a in ranked), key(r)  # (judged, or covered by one judged)


def test_each_knob_the_search_skips_is_no_faster_than_the_value_before_it():
    """What `covers` relies on, on traced steps: ZeRO 1 no slower than 2, and 2 no slower than 3; ZeRO 0 holds more
    than 1 (but it can be faster: no flattening); remat off no slower than on; off pipelines one micro-batch no
    slower than two; GPipe as fast as 1F1B and holding at least as much."""
    _, opts, build, estimate = _planner("llama-micro", "dp=2")
    search = Search(build, float("inf"), estimate, gpu=True)

    def judged(axes, zero, remat=False, micro=1, schedule=None):
        r = search.judge({"axes": axes, "zero": zero, "remat": remat, "schedule": schedule, "micro": micro})
        return r["time"]["step"], r["need"]

    dp = {"dp": 2, "tp": 1}
    z = {k: judged(dp, k, micro=2) for k in (0, 1, 2, 3)}
    assert z[1][1] <= z[0][1]
    assert z[1][0] <= z[2][0] <= z[3][0], z
    assert judged(dp, 1)[0] <= judged(dp, 1, remat=True)[0]
    assert judged(dp, 1)[0] <= judged(dp, 1, micro=2)[0]
    pp = {"pp": 2, "dp": 1, "tp": 1}
    one, gpipe = judged(pp, 1, micro=8, schedule="1f1b"), judged(pp, 1, micro=8, schedule="gpipe")
    assert one[0] == pytest.approx(gpipe[0], rel=1e-9) and one[1] <= gpipe[1]


def test_the_search_stops_at_its_time_limit_and_says_what_it_left(capsys):
    """--search-seconds: after the limit (one layout judged at least) the rest are left unjudged, counted, with the
    least time any of them could take, and the table says whether the first layout is then known fastest."""
    cli.plan(["--model", "llama-micro", "--devices", "2", "--memory", "64", "--global-batch", "8", "--seq-len", "32",
              "--gpu", "h100", "--precision", "bf16", "--search-seconds", "1e-9", "--zero", "1", "--no-remat"])
    out = capsys.readouterr().out
    assert "the time limit (--search-seconds) left " in out and "unjudged; none could take less than " in out, out
    line = next(x for x in out.splitlines() if x.startswith("searched "))
    assert line.startswith("searched ") and " 1 judged (" in line and " by the time limit" in line, line
    with pytest.raises(SystemExit, match="--search-seconds 0: expected seconds to search, above 0"):
        cli.plan(["--model", "llama-micro", "--devices", "2", "--search-seconds", "0"])


def test_the_time_limit_counts_the_floors_traces(tmp_path, monkeypatch):
    """The limit counts the floors' traces too: floors whose traces (here made slow) take longer than the limit
    leave one layout judged and the rest counted as left by the time limit, with the least time any could take."""
    ranking, opts, build, estimate = cli.planner(["--model", _folder(tmp_path, 4), "--global-batch", "8",
                                                  "--seq-len", "32", "--gpu", "h100", "--precision", "bf16"])
    unit = Search._unit

    def slow(self, tp, cp):
        if (tp, cp) not in self._units:
            time.sleep(2.0)
        return unit(self, tp, cp)

    monkeypatch.setattr(Search, "_unit", slow)
    search = Search(build, float("inf"), estimate, gpu=True, layers=4, global_batch=8, budget=3.0)
    rows = layouts(4, 8, pipeline=True, zeros=(1, 3), remats=(False,), schedules=("1f1b",), search_micro=True)
    judged = search.run(rows)
    assert len(judged) == 1 and search.said["budget"] == len(rows) - 1 - search.said["covered"], search.said
    assert 0 < search.unjudged_floor < math.inf


def test_a_cp_mesh_planned_for_gpus_traces(capsys):
    """On CUDA a cp chunk attends with torch's lower-right causal bias, a tensor subclass the trace's dispatch mode
    cannot make: the trace uses a stand-in, so a cp mesh planned for GPUs is traced (it was 'not traced on meta
    tensors')."""
    cli.plan(["--model", "llama-micro", "--mesh", "dp=1,cp=2", "--global-batch", "8", "--seq-len", "32",
              "--gpu", "h100", "--precision", "bf16"])
    out = capsys.readouterr().out
    assert "sends cp " in out and "estimated step: " in out, out
