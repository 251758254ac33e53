"""Context parallelism on a ``cp`` mesh axis: each cp rank holds its pieces of every sequence (zig-zag by default:
pieces ``c`` and ``2cp-1-c`` of ``2cp``; or chunk ``c`` of ``cp``, contiguous); attention gathers the keys and values
of every piece over cp and runs each query piece against the positions up to its end (the earlier ones unmasked, its
own causally, merged by log-sum-exp), rotary positions are global, and the loss is each rank's targets weighted by
their count (``cp`` is a data axis to the step: its gradients are summed over it). Three AdamW steps against one
process, in float32, on cp=2, cp=4 (both layouts), cp=2 x tp=2, cp=2 x dp=2 and cp=2 x pp=2 for Llama with GQA, and
cp=2 for Qwen2 (q/k/v biases), GLM (partial rotary) and Baichuan2 (NormHead)."""

import math

import pytest
import torch

import funcpar as fp
import harness
from hf_fixtures import CONFIGS, config_dict

B, T = 4, 16


def _train(name, sizes, micro=1, layout="zigzag"):
    mesh = (harness.mesh(**sizes) if sizes else fp.Mesh()).with_context_layout(layout)
    model = fp.get_model(name)
    cfg = model.config(config_dict(name), mesh)
    specs = model.specs(cfg, mesh)
    data_axes = ("dp", "cp") if "cp" in mesh.axis_names else ("dp",)
    step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, optimizer=fp.optim.adamw(1e-3, weight_decay=0.1),
                           clip_norm=1.0, data_axes=data_axes, accum_steps=micro)
    params = fp.shard(model.init(cfg, seed=5), specs, mesh)
    state = step.init(step.executor.plan.select(params) if step.executor is not None else params)
    losses = []
    for b in harness.token_batches(3, cfg.vocab_size, B, T, seed=41, masked=5):
        state, m = step(state, harness.dp_share(b, mesh))  # every cp rank: the same rows, the whole sequence
        losses.append(m["loss"])
    return losses, fp.gather(step.gather_params(state), specs, mesh)


MESHES = [({"cp": 2}, 1, "zigzag"), ({"cp": 4}, 1, "zigzag"), ({"cp": 4}, 1, "contiguous"),
          ({"cp": 2, "tp": 2}, 1, "zigzag"), ({"cp": 2, "dp": 2}, 1, "contiguous"), ({"pp": 2, "cp": 2}, 2, "zigzag")]


CASES = [("llama", *m) for m in MESHES] + [  # (qwen2: its biases; glm: partial rotary; baichuan: NormHead)
    (name, {"cp": 2}, 1, "zigzag") for name in ("qwen2", "glm", "baichuan")]


@pytest.mark.parametrize("name, sizes, micro, layout", CASES,
                         ids=lambda v: "-".join(f"{a}{n}" for a, n in v.items()) if isinstance(v, dict) else str(v))
def test_context_parallel_training_equals_one_process(name, sizes, micro, layout):
    ref_losses, ref = _train(name, {}, micro)
    got = harness.run(math.prod(sizes.values()), _train, name, sizes, micro, layout)[0]
    harness.assert_same_training(got, (ref_losses, ref))


def test_what_context_parallelism_refuses_it_names():
    mesh = fp.Mesh.abstract(cp=2)
    llama = fp.get_model("llama")
    cfg = llama.config(CONFIGS["llama"]().to_dict())
    with pytest.raises(fp.StepError, match=r"each cp rank holds a chunk of every sequence.*data_axes=\('dp', 'cp'\)"):
        fp.compile_step(llama.loss_fn(cfg, mesh), llama.specs(cfg, mesh), mesh=mesh)
    gpt2 = fp.get_model("gpt2")
    with pytest.raises(fp.ModelError, match="model 'gpt2' does not support context parallelism"):
        gpt2.loss_fn(gpt2.config(CONFIGS["gpt2"]().to_dict()), mesh)
    with pytest.raises(ValueError, match=r"over cp=2: a sequence of 14 positions does not split evenly into 2\*cp=4 "
                                         r"pieces \(the zig-zag layout\); make the sequence length a multiple of 4"):
        fp.layers.context_chunk(torch.zeros(1, 14), mesh)
    with pytest.raises(ValueError, match=r"a sequence of 7 positions does not split evenly into cp=2 chunks"):
        fp.layers.context_chunk(torch.zeros(1, 7), mesh.with_context_layout("contiguous"))
    with pytest.raises(fp.MeshError, match=r"context layout 'ring' is not one of zigzag, contiguous"):
        mesh.with_context_layout("ring")


def _pieces(layout):
    mesh = harness.mesh(cp=4).with_context_layout(layout)
    held = fp.layers.context_chunk(torch.arange(16)[None], mesh)
    return held[0].tolist(), fp.layers.context_whole(held, mesh, 1)[0].tolist()


def test_the_zigzag_layout_gives_each_rank_a_piece_from_each_end():
    """Rank c of cp=n holds pieces c and 2n-1-c of 2n (zig-zag) or chunk c (contiguous), and gathering every rank's
    pieces puts the sequence back in order."""
    for layout, want in (("zigzag", [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]),
                         ("contiguous", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]])):
        got = harness.run(4, _pieces, layout)
        assert [held for held, _ in got] == want, (layout, got)
        assert all(whole == list(range(16)) for _, whole in got), got
