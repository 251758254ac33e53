"""Pipeline stages (``pp``) training on real gloo meshes, against the single-process run.

Every mesh runs every schedule (GPipe, 1F1B, interleaved 1F1B) at 4 and 8 micro-batches, for an untied Llama, a
tied-embedding Llama and GPT-2 (tied), and zero bubble (plain and interleaved) on two of them: per-step losses and
the gathered parameters after 3 AdamW steps (with clipping) must equal the single-process run's. (The measured
bubble against the planned one is a wall-clock figure: benchmarks/pipeline_bubble.py.)
"""

import dataclasses
import functools
import math

import pytest
import torch

import funcpar as fp
import harness
import hf_fixtures
from funcpar.models import gpt2, llama

V, B, T, LAYERS = 96, 16, 8, 8
SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb", None), ("zb", 2)]


def config(name):
    """``"llama"``, ``"llama-tied"`` or ``"gpt2"``, with ``LAYERS`` layers or, as ``"gpt2:4"``, another count."""
    name, _, n = name.partition(":")
    n = int(n or LAYERS)
    if name == "gpt2":
        return gpt2.Config(vocab_size=V, n_embd=32, n_layer=n, n_head=4, n_positions=T)
    return llama.Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=n,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_windows=(None,) * n,
                        tie_word_embeddings=name == "llama-tied")


def batches(n=3):
    return harness.token_batches(n, V, B, T, seed=70, masked=5)


local = harness.dp_share


def make(name, mesh, micro, pipeline="1f1b", chunks=None, **kw):
    cfg = config(name)
    model = fp.get_model("gpt2" if name.startswith("gpt2") else "llama")
    specs = model.specs(cfg, mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh, remat=kw.pop("remat", False)), specs, mesh=mesh,
                           optimizer=fp.optim.adamw(1e-3, weight_decay=0.1), accum_steps=micro, clip_norm=0.5,
                           pipeline=pipeline, chunks=chunks, **kw)
    return step, specs, model, cfg


def train(name, mesh, micro, pipeline="1f1b", chunks=None, steps=3, **kw):
    step, specs, model, cfg = make(name, mesh, micro, pipeline, chunks, **kw)
    state = step.init(fp.shard(model.init(cfg, seed=0), specs, mesh))
    losses, metrics = [], []
    for b in batches(steps):
        state, m = step(state, local(b, mesh))
        losses.append(m["loss"])
        metrics.append(m)
    return losses, fp.gather(step.gather_params(state), specs, mesh), metrics


@functools.lru_cache(maxsize=None)
def reference(name, micro):
    losses, params, _ = train(name, fp.Mesh(), micro)
    return losses, params


def assert_equal_runs(got, ref, what):
    (losses, params), (ref_losses, ref_params) = got, ref
    for k, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {k + 1} loss {a} vs {b}"
    pairs = list(zip(fp.tree.leaves_with_path(params), fp.tree.leaves_with_path(ref_params), strict=True))
    assert [p for (p, _), _ in pairs] == [p for _, (p, _) in pairs]
    # relative to the whole model (a leaf whose true gradient is zero, as GPT-2's key bias, holds Adam's steps on
    # round-off, which no two summation orders share)
    diff = math.sqrt(sum((x - y).pow(2).sum().item() for (_, x), (_, y) in pairs))
    norm = math.sqrt(sum(y.pow(2).sum().item() for _, (_, y) in pairs))
    assert diff <= 1e-5 * norm, f"{what}: parameters differ by {diff / norm:.2e} of their norm"


def _matrix(sizes, runs):
    mesh = harness.mesh(**sizes)
    out = []
    for name, micro, pipeline, chunks in runs:
        losses, params, metrics = train(name, mesh, micro, pipeline, chunks)
        out.append((losses, params if mesh.rank == 0 else None, [m["in_flight"] for m in metrics],
                    [m["bubble"] for m in metrics]))
    return out


MESHES = [{"pp": 2}, {"pp": 4}, {"pp": 2, "dp": 2}, {"pp": 2, "tp": 2}, {"pp": 2, "tp": 2, "dp": 2}]


@pytest.mark.parametrize("sizes", MESHES, ids=lambda s: "-".join(f"{a}{n}" for a, n in s.items()))
def test_every_schedule_trains_as_the_single_process_run(sizes):
    layers = 2 * sizes["pp"]  # the fewest interleaving (2 chunks per rank) can take: the 8-rank mesh's runs are slow
    # the schedules' whole matrix on pp=2; on pp=4 and beside tp or dp, each schedule once per model (a tied and an
    # untied embedding): what those axes add is the same for every schedule; on the 8-rank mesh, the tied model's
    # 1F1B and interleaved runs and GPT-2's interleaved zero bubble (eight ranks on this machine's cores are slow)
    alone = sizes == {"pp": 2}
    plans = [(micro, p, c) for micro in ((4, 8) if alone else (8,)) for p, c in SCHEDULES if p != "zb"]
    runs = [(f"{name}:{layers}", micro, pipeline, chunks)
            for name in (("llama", "llama-tied", "gpt2") if alone else ("llama-tied", "gpt2"))
            for micro, pipeline, chunks in plans]
    # zero bubble, plain and interleaved, on a tied embedding (summed over the first and last stage) and on GPT-2
    runs += [(f"llama-tied:{layers}", 4, "zb", None), (f"gpt2:{layers}", 8, "zb", 2)]
    if math.prod(sizes.values()) == 8:
        runs = [r for r in runs if (r[0].startswith("llama-tied") and r[2] in ("1f1b", "interleaved"))
                or (r[0].startswith("gpt2") and r[2] == "zb")]
    results = harness.run(math.prod(sizes.values()), _matrix, sizes, runs)
    pp = sizes["pp"]
    for k, (name, micro, pipeline, chunks) in enumerate(runs):
        what = f"{sizes} {name} {pipeline} x{micro}"
        losses, params, _, bubbles = results[0][k]
        assert_equal_runs((losses, params), reference(name, micro), what)
        # what each rank held at once: 1F1B at most pp - r micro-batches, GPipe all of them
        held = [max(results[r][k][2]) for r in range(len(results))]
        stage = [fp.Mesh.abstract(**sizes).coords_of(r)["pp"] for r in range(len(results))]
        planned = fp.pipeline.make_schedule(pipeline, pp, micro, chunks or 1).simulate()["max_in_flight"]
        assert held == [planned[s] for s in stage], f"{what}: micro-batches held per rank {held}"
        if pipeline == "1f1b":
            assert max(held) <= pp
        if pipeline == "gpipe":
            assert min(held) == micro
        assert all(0.0 <= b < 1.0 for b in bubbles), f"{what}: bubble {bubbles}"


def _variants(runs):
    mesh = harness.mesh(pp=2, dp=2)
    out = []
    for kw in runs:
        kw = dict(kw)
        losses, params, metrics = train(kw.pop("name", "llama"), mesh, kw.pop("micro", 4), kw.pop("pipeline", "1f1b"),
                                        kw.pop("chunks", None), **kw)
        out.append((losses, params, metrics[-1]))
    return out if mesh.rank == 0 else None


VARIANTS = [
    {"zero": 0}, {"zero": 2}, {"remat": True}, {"name": "llama-tied", "remat": True, "pipeline": "interleaved", "chunks": 2},
    {"parts": [1, 7]}, {"parts": [5, 3], "name": "llama-tied"}, {"parts": [2.5, 5.5], "remat": True},
    {"parts": [3.5, 4.5], "name": "gpt2"}, {"pipeline": "interleaved", "chunks": 2, "parts": [0.5, 3, 4, 0.5]},
    {"pipeline": "interleaved", "chunks": 2, "parts": [1, 3, 3, 1]}, {"pipeline": "interleaved", "chunks": 4},
    {"offload": "cpu"}, {"pipeline": "zb", "zero": 2, "parts": [2.5, 5.5]},
    {"pipeline": "zb", "chunks": 2, "name": "llama-tied", "parts": [0.5, 3, 4, 0.5]},
    # ZeRO-3 on each stage: its units 1/dp per rank, gathered as the executor reaches them; halves of a layer on two
    # stages, a tied embedding (its own unit on the first and last stage), interleaving, GPT-2
    {"zero": 3, "offload": "cpu"}, {"zero": 3, "name": "llama-tied", "pipeline": "interleaved", "chunks": 2},
    {"zero": 3, "name": "gpt2", "parts": [3.5, 4.5]},
]


def test_zero_stages_remat_offload_and_uneven_parts_train_as_the_single_process_run():
    results = harness.run(4, _variants, VARIANTS)[0]
    for kw, (losses, params, _) in zip(VARIANTS, results, strict=True):
        ref = reference(kw.get("name", "llama"), kw.get("micro", 4))
        assert_equal_runs((losses, params), ref, f"pp=2 dp=2 {kw}")


MIXED = [{"param_dtype": torch.bfloat16}, {"param_dtype": torch.float16, "pipeline": "zb"}]


def test_mixed_precision_through_the_pipeline_tracks_the_single_process_run():
    results = harness.run(4, _variants, MIXED)[0]
    for kw, (losses, _, last) in zip(MIXED, results, strict=True):
        single, _, ms = train("llama", fp.Mesh(), 4, **kw)
        for a, b in zip(losses, single, strict=True):
            assert abs(a - b) <= 5e-3 * b, (kw, losses, single)  # low-precision round-off, nothing more
        assert "loss_scale" in last and (kw["param_dtype"] != torch.float16 or last["loss_scale"] > 1)


def test_stage_plans_name_the_numbers_that_do_not_fit():
    mesh = fp.Mesh.abstract(pp=2)
    with pytest.raises(fp.StepError, match=r"parts \[3, 3\] sum to 6 but the model has 8 layers"):
        make("llama", mesh, 4, parts=[3, 3])
    with pytest.raises(fp.StepError, match=r"parts has 3 entries for 2 stages"):
        make("llama", mesh, 4, parts=[3, 3, 2])
    with pytest.raises(fp.StepError, match=r"stage 1 needs at least one layer"):
        make("llama", mesh, 4, parts=[8, 0])
    with pytest.raises(fp.StepError, match=r"18 pipeline stages but the model has only 8 layers \(16 halves\)"):
        make("llama", mesh, 4, pipeline="interleaved", chunks=9)
    with pytest.raises(fp.StepError, match=r"parts\[0\] is 4.25: a stage holds whole layers or halves of them"):
        make("llama", mesh, 4, parts=[4.25, 3.75])
    with pytest.raises(fp.StepError, match=r"n_micro=3 is not a multiple of pp=2"):
        make("llama", mesh, 3, pipeline="interleaved", chunks=2)
    with pytest.raises(fp.StepError, match=r"unknown pipeline schedule 'zbv'"):
        make("llama", mesh, 4, pipeline="zbv")
    with pytest.raises(fp.StepError, match=r"pipeline='zb' splits each backward .* use remat=False with 'zb'"):
        make("llama", mesh, 4, pipeline="zb", remat=True)
    with pytest.raises(fp.StepError, match=r"pipeline='zb' .* zero=3 recomputes each block"):
        make("llama", mesh, 4, zero=3, pipeline="zb")
    step, *_ = make("llama", fp.Mesh.abstract(pp=4), 4, parts=[1, 1, 1, 5])
    assert step.executor.plan.describe().splitlines() == [
        "pp rank 0: stage 0: embed + layer 0", "pp rank 1: stage 1: layer 1", "pp rank 2: stage 2: layer 2",
        "pp rank 3: stage 3: layers 3-7 + head"]
    step, *_ = make("llama", fp.Mesh.abstract(pp=2), 4, pipeline="interleaved", chunks=2, parts=[1.5, 3, 0.5, 3])
    assert step.executor.plan.describe().splitlines() == [
        "pp rank 0: stage 0: embed + layer 0 + layer 1 attention; stage 2: layer 4 mlp",
        "pp rank 1: stage 1: layer 1 mlp + layers 2-3 + layer 4 attention; stage 3: layers 5-7 + head"]
    # a lone half runs alone (with only its leaves); both halves of a layer run as one block
    assert step.executor.plan.pieces(range(1, 5)) == [(0, 1), (1, None), (2, 0)]
    st = fp.get_model("llama").stages
    with pytest.raises(fp.ModelError, match="give halves and first_leaves together"):
        dataclasses.replace(st, first_leaves=None)
    meta = fp.get_model("llama").init(config("llama"), device="meta")
    held = {p for p, _ in fp.tree.leaves_with_path(step.executor.plan.select(meta))}  # pp rank 0's
    assert {"layers.1.wq", "layers.1.attn_norm", "layers.4.w_down", "layers.0.w_up"} <= held
    assert not {"layers.1.w_up", "layers.1.mlp_norm", "layers.4.wo", "layers.2.wq"} & held


def _reshard(folder, first, then, pipeline, chunks):
    """Train 3 steps on mesh ``first`` (saving after step 2 and exporting to HF at the end); resume step 3 on each
    mesh of ``then`` from the checkpoint."""
    mesh = harness.mesh(**first)
    step, specs, model, cfg = make("llama-tied", mesh, 4, pipeline if first.get("pp", 1) > 1 else "1f1b",
                                   chunks if first.get("pp", 1) > 1 else None)
    state = step.init(fp.shard(model.init(cfg, seed=0), specs, mesh))
    state, losses = harness.train_saving(step, state, batches(3), mesh, folder)
    fp.hf.save(folder + "-hf", state.params, model, cfg, mesh)
    out = {"uninterrupted": losses[-1], "whole": fp.gather(state.params, specs, mesh)}
    for sizes in then:
        m2 = harness.mesh(**sizes)
        staged = sizes.get("pp", 1) > 1
        s2, specs2, _, _ = make("llama-tied", m2, 4, pipeline if staged else "1f1b", chunks if staged else None)
        s2.init(fp.shard(model.init(cfg, seed=1), specs2, m2))
        st, _ = s2.load(folder)
        st, m = s2(st, local(batches(3)[2], m2))
        out[str(sizes)] = (m["loss"], fp.gather(st.params, specs2, m2))
    return out


RESHARD = [({"pp": 2, "dp": 2}, [{"dp": 4}, {"pp": 4}], "1f1b", None),
           ({"dp": 4}, [{"pp": 2, "dp": 2}], "interleaved", 2),
           ({"pp": 4}, [{"pp": 2, "dp": 2}, {"pp": 2, "tp": 2}], "gpipe", None)]


@pytest.mark.parametrize("first, then, pipeline, chunks", RESHARD, ids=lambda x: str(x))
def test_checkpoints_reshard_across_pipeline_stages_and_export_to_hf(tmp_path, first, then, pipeline, chunks):
    folder = str(tmp_path / "ckpt")
    out = harness.run(4, _reshard, folder, first, then, pipeline, chunks)[0]
    _, ref_after = reference("llama-tied", 4)
    for sizes in then:
        loss, params = out[str(sizes)]
        assert abs(loss - out["uninterrupted"]) <= 1e-5 * out["uninterrupted"], sizes
        assert_equal_runs(([loss], params), ([out["uninterrupted"]], ref_after), f"{first} -> {sizes}")
    back, _ = fp.hf.load(folder + "-hf", llama)
    for (p, x), (_, y) in zip(fp.tree.leaves_with_path(back), fp.tree.leaves_with_path(out["whole"]), strict=True):
        assert torch.equal(x, y), p


def _hf_stage(folder, kind):
    import json
    import pathlib

    mesh = harness.mesh(pp=2)
    model = fp.get_model("gpt2" if kind == "gpt2" else "llama")
    cfg = model.config(json.loads((pathlib.Path(folder) / "config.json").read_text()), mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh), model.specs(cfg, mesh), mesh=mesh, accum_steps=2)
    stats = {}
    params, _ = fp.hf.load(folder, model, mesh, keep=step.holds, stats=stats)
    held = [p for p, _ in fp.tree.leaves_with_path(params)]
    state = step.init(params)
    return step.loss(state, hf_fixtures.batch()).item(), stats["bytes_read"], held


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_stage_reads_only_its_tensors_of_an_hf_checkpoint(tmp_path, kind):
    folder = str(tmp_path / kind)
    ref = hf_fixtures.make_checkpoint(kind, folder)
    b = hf_fixtures.batch()
    with torch.no_grad():
        want = ref(input_ids=b["input_ids"], labels=b["labels"]).loss.item()
    total = sum(p.numel() * 4 for p in ref.state_dict().values() if p.is_floating_point()) - (
        ref.lm_head.weight.numel() * 4 if ref.config.tie_word_embeddings else 0)
    (l0, read0, held0), (l1, read1, held1) = harness.run(2, _hf_stage, folder, kind)
    assert abs(l0 - want) <= 1e-5 * want and l0 == l1  # the loss through both stages, on both
    assert not set(held0) & set(held1) - {"wte", "embed"}  # disjoint but for a tied embedding
    assert read0 < 0.7 * total and read1 < 0.7 * total, (read0, read1, total)


def _mismatched_batches():
    mesh = harness.mesh(pp=2)
    step, specs, model, cfg = make("llama", mesh, 2, check=True)
    state = step.init(fp.shard(model.init(cfg), specs, mesh))
    b = batches(2)[mesh.coord("pp")]  # each stage fed another batch
    with pytest.raises(fp.StepError) as e:
        step(state, b)
    return str(e.value)


def test_check_names_stages_fed_different_batches():
    for msg in harness.run(2, _mismatched_batches):
        assert "differs across mesh axis 'pp'" in msg and "feed every pp rank the same batch" in msg
