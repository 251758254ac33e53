"""Pipeline stages (``pp``) training on real gloo meshes, against the single-process run.

Every mesh runs every schedule (GPipe, 1F1B, interleaved 1F1B) at 4 and 8 micro-batches, for an untied Llama, a
tied-embedding Llama and GPT-2 (tied): per-step losses and the gathered parameters after 3 AdamW steps (with
clipping) must equal the single-process run's.
"""

import functools
import math

import pytest
import torch

import funcpar as fp
import harness
from funcpar.models import gpt2, llama

V, B, T, LAYERS = 96, 16, 8, 8
SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2)]


def config(name):
    if name == "gpt2":
        return gpt2.Config(vocab_size=V, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=T)
    return llama.Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_windows=(None,) * LAYERS,
                        tie_word_embeddings=name == "llama-tied")


def batches(n=3):
    out = []
    for s in range(n):
        ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(70 + s))
        labels = ids.clone()
        labels[s, :5] = -100  # uneven targets over micro-batches and ranks
        out.append({"input_ids": ids, "labels": labels})
    return out


def local(batch, mesh):
    dp, k = mesh.axis_size("dp"), mesh.coord("dp")
    return {n: x.chunk(dp)[k] for n, x in batch.items()}


def make(name, mesh, micro, pipeline="1f1b", chunks=None, **kw):
    cfg = config(name)
    model = fp.get_model("gpt2" if name == "gpt2" else "llama")
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
    return losses, fp.gather(state.params, specs, mesh), metrics


@functools.lru_cache(maxsize=None)
def reference(name, micro):
    losses, params, _ = train(name, fp.Mesh(), micro)
    return losses, params


def assert_equal_runs(got, ref, what):
    (losses, params), (ref_losses, ref_params) = got, ref
    for k, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {k + 1} loss {a} vs {b}"
    pairs = list(zip(fp.tree.leaves_with_path(params), fp.tree.leaves_with_path(ref_params)))
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
    runs = [(name, micro, pipeline, chunks) for name in ("llama", "llama-tied", "gpt2") for micro in (4, 8)
            for pipeline, chunks in SCHEDULES]
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
