"""zero=3 (fully sharded parameters, gathered block by block) on real gloo meshes against the single-process run."""

import math

import pytest
import torch

import funcpar as fp
import harness
from funcpar.models import llama

V, B, T = 128, 8, 16
LR, WD, CLIP = 1e-2, 0.1, 0.5


def config():
    return llama.Config(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, sliding_windows=(None,) * 3)


def batches(n=3):
    return harness.token_batches(n, V, B, T, seed=90, masked=6)


def make(mesh, zero, remat=False, **options):
    cfg = config()
    model = fp.get_model("llama")
    specs = model.specs(cfg, mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh, remat=remat), specs, mesh=mesh,
                           optimizer=fp.optim.adamw(LR, weight_decay=WD), zero=zero, accum_steps=2, clip_norm=CLIP,
                           **options)
    return step, specs, cfg


local = harness.dp_share


def train(mesh, zero, steps=3, **options):
    step, specs, cfg = make(mesh, zero, **options)
    state = step.init(fp.shard(llama.init(cfg, seed=0), specs, mesh))
    losses, norms = [], []
    for b in batches(steps):
        state, m = step(state, local(b, mesh))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    held = sum(x.numel() for _, x in fp.tree.leaves_with_path(state.params))
    return losses, norms, fp.gather(step.gather_params(state), specs, mesh), held


def _on(sizes):
    mesh = harness.mesh(**sizes)
    losses, norms, params, held = train(mesh, 3)
    return losses, norms, params, held, mesh.axis_size("tp") * mesh.axis_size("dp")


@pytest.mark.parametrize("sizes", [{"dp": 2}, {"tp": 2, "dp": 2}, {"dp": 4}])
def test_zero3_equals_the_single_process_run_and_holds_a_share_of_the_parameters(sizes):
    ref_losses, ref_norms, ref, _ = train(fp.Mesh(), 0)
    init = llama.init(config(), seed=0)
    total = sum(x.numel() for _, x in fp.tree.leaves_with_path(init))
    for losses, norms, params, held, parts in harness.run(math.prod(sizes.values()), _on, sizes):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses, strict=True))
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(norms, ref_norms, strict=True))
        moved = math.sqrt(sum((r - i).pow(2).sum().item() for (_, r), (_, i) in
                              zip(fp.tree.leaves_with_path(ref), fp.tree.leaves_with_path(init), strict=True)))
        diff = math.sqrt(sum((p - r).pow(2).sum().item() for (_, p), (_, r) in
                             zip(fp.tree.leaves_with_path(params), fp.tree.leaves_with_path(ref), strict=True)))
        assert diff <= 1e-4 * moved  # the update equals the single-process one (Adam amplifies round-off: the bar
        # test_step holds ZeRO-1/2 to)
        assert abs(held - total / parts) <= 0.01 * total / parts  # between steps: total/(tp*dp) per rank


def _resume(folder):
    mesh = harness.mesh(tp=2, dp=2)
    step, specs, _ = make(mesh, 3)
    state = step.init(fp.shard(llama.init(config(), seed=0), specs, mesh))
    state, losses = harness.train_saving(step, state, batches(3), mesh, folder)
    fp.hf.save(folder + "-hf", step.gather_params(state), llama, config(), mesh)
    whole = fp.gather(step.gather_params(state), specs, mesh)
    out = {"uninterrupted": losses[-1], "whole": whole}
    for name, sizes, zero in [("zero1", {"tp": 2, "dp": 2}, 1), ("dp4-zero3", {"dp": 4}, 3)]:
        m2 = harness.mesh(**sizes)
        s2, _, _ = make(m2, zero)
        s2.init(fp.shard(llama.init(config(), seed=1), s2.specs, m2))
        st, _ = s2.load(folder)
        st, m = s2(st, local(batches(3)[2], m2))
        out[name] = m["loss"]
    return out


def test_zero3_checkpoints_resume_at_zero1_and_on_another_mesh_and_export_to_hf(tmp_path):
    folder = str(tmp_path / "ckpt")
    out = harness.run(4, _resume, folder)[0]
    assert abs(out["zero1"] - out["uninterrupted"]) <= 1e-6 * out["uninterrupted"]
    assert abs(out["dp4-zero3"] - out["uninterrupted"]) <= 1e-6 * out["uninterrupted"]
    back, _ = fp.hf.load(folder + "-hf", llama)
    for (p, x), (_, y) in zip(fp.tree.leaves_with_path(back), fp.tree.leaves_with_path(out["whole"]), strict=True):
        assert torch.equal(x, y), p


def test_zero3_needs_the_staged_form():
    cfg = config()
    with pytest.raises(fp.StepError, match=r"zero=3 gathers the model block by block through its staged form"):
        fp.compile_step(lambda p, b: 0, llama.specs(cfg), mesh=fp.Mesh(), zero=3)


def _distance(a, b) -> float:
    return math.sqrt(sum((x.float() - y.float()).pow(2).sum().item() for (_, x), (_, y) in
                         zip(fp.tree.leaves_with_path(a), fp.tree.leaves_with_path(b), strict=True)))


def _mixed(remat):
    """zero=1 and zero=3 in bf16 on tp=2 x dp=2 (and zero=3 in fp32 without remat); the bytes each ZeRO-3 run's
    collectives over its dp group move, by operation."""
    from funcpar.parallel import transport

    mesh = harness.mesh(tp=2, dp=2)
    runs = [(1, torch.bfloat16), (3, torch.bfloat16)] + ([] if remat else [(3, None)])
    out = {}
    for zero, dtype in runs:
        with transport.recording() as log:
            out[zero, dtype] = train(mesh, zero, remat=remat, param_dtype=dtype)
        dp = tuple(mesh.group_ranks("dp"))
        out["bytes", zero, dtype] = {op: sum(e[3] for e in log if e[0] == "collective" and e[1] == dp and e[2] == op)
                                     for op in ("all_gather", "reduce_scatter")}
    return out


@pytest.mark.parametrize("remat", [False, True])
def test_zero3_in_bf16_equals_zero1_in_bf16(remat):
    """ZeRO-3 in bfloat16 (blocks gathered in bf16, gradients reduce-scattered in fp32 into fp32 master parts)
    against funcpar's zero=1 bf16 run on the same tp=2 x dp=2 mesh. Both compute each block on the masters rounded
    to bf16 alike and sum the data ranks' gradients in fp32; they differ in one place: zero=1's dense lookup
    backward sums the embedding's gradient rows in bf16, ZeRO-3's lookup on the parts (funcpar.train.zero3.ZeroRows) in
    fp32. The first forward is therefore the same bit for bit; after it the losses agree to 1e-4, the gradient norms
    to bf16's resolution (2**-8 = 3.9e-3) and the weights to 1e-2 of the distance they moved. The gathers move half
    the bytes of the float32 ZeRO-3 run's (to 1%: the lookups' int64 token ids do not halve), the gradients'
    reduce-scatters the same."""
    init = llama.init(config(), seed=0)
    total = sum(x.numel() for _, x in fp.tree.leaves_with_path(init))
    bf16 = torch.bfloat16
    for out in harness.run(4, _mixed, remat):
        (l1, n1, p1, _), (l3, n3, p3, held) = out[1, bf16], out[3, bf16]
        assert l3[0] == l1[0]  # the first forward: the same values
        assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(l3, l1, strict=True)), (l3, l1)
        assert all(abs(a - b) <= 2**-8 * abs(b) for a, b in zip(n3, n1, strict=True)), (n3, n1)
        assert _distance(p3, p1) <= 1e-2 * _distance(p1, init)
        assert all(x.dtype == bf16 for _, x in fp.tree.leaves_with_path(p3))
        assert abs(held - total / 4) <= 0.01 * total / 4  # between steps: a quarter of the parameters
        if not remat:
            half, full = out["bytes", 3, bf16], out["bytes", 3, None]
            assert abs(half["all_gather"] * 2 - full["all_gather"]) <= 0.01 * full["all_gather"]
            # the gradients' reduce-scatters in fp32 in both; only the lookups' (of their bf16 output rows) halve
            assert 0.9 * full["reduce_scatter"] <= half["reduce_scatter"] < full["reduce_scatter"]


def _offload(zero, dtype):
    return train(harness.mesh(dp=2), zero, offload="cpu", param_dtype=dtype)


def test_zero3_with_offload_equals_the_single_process_run():
    """ZeRO-3 with the fp32 masters and AdamW's state on the host (dp=2) against one process at zero=0, in float32:
    the bar the float32 ZeRO-3 test holds (losses 1e-5, weights 1e-4 of their move); and in bf16 against zero=1 with
    offload, the bar of the bf16 test."""
    ref_losses, _, ref, _ = train(fp.Mesh(), 0)
    init = llama.init(config(), seed=0)
    for losses, _, params, _ in harness.run(2, _offload, 3, None):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses, strict=True))
        assert _distance(params, ref) <= 1e-4 * _distance(ref, init)
    ones = harness.run(2, _offload, 1, torch.bfloat16)
    for (l1, _, p1, _), (l3, _, p3, _) in zip(ones, harness.run(2, _offload, 3, torch.bfloat16), strict=True):
        assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(l3, l1, strict=True))
        assert _distance(p3, p1) <= 1e-2 * _distance(p1, init)


def _gpt2(zero):
    mesh = harness.mesh(dp=2)
    model = fp.get_model("gpt2")
    cfg = model.config(dict(model_type="gpt2", vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=32), mesh)
    specs = model.specs(cfg, mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, optimizer=fp.optim.sgd(0.5, momentum=0.9),
                           zero=zero, accum_steps=2, clip_norm=CLIP)
    state = step.init(fp.shard(model.init(cfg, seed=0), specs, mesh))
    losses = []
    for b in batches(3):
        state, m = step(state, local(b, mesh))
        losses.append(m["loss"])
    return losses, fp.gather(step.gather_params(state), specs, mesh)


def _gpt2_both():
    return _gpt2(1), _gpt2(3)


def test_zero3_with_tied_embeddings_equals_zero1():
    # GPT-2's head is its embedding: the embedding unit is gathered at both ends and its gradient sums both uses
    for (l1, p1), (l3, p3) in harness.run(2, _gpt2_both):
        assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(l1, l3, strict=True))
        for (path, x), (_, y) in zip(fp.tree.leaves_with_path(p1), fp.tree.leaves_with_path(p3), strict=True):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), path


def test_step_loss_evaluates_the_state_it_is_given_at_zero3():
    mesh = fp.Mesh()
    for zero in (1, 3):
        cfg = config()
        model = fp.get_model("llama")
        step = fp.compile_step(model.loss_fn(cfg, mesh), model.specs(cfg, mesh), mesh=mesh, zero=zero, donate=False,
                               optimizer=fp.optim.adamw(LR))
        s0 = step.init(llama.init(cfg, seed=0))
        b = batches(1)[0]
        before = step.loss(s0, b).item()
        s1, m = step(s0, b)
        assert step.loss(s0, b).item() == before  # the old state (not donated) still evaluates to its own loss
        assert abs(before - m["loss"]) <= 1e-6 * abs(before) and step.loss(s1, b).item() < before


def _lookups():
    from funcpar.parallel import transport

    mesh = harness.mesh(dp=2)
    step, specs, cfg = make(mesh, 3)
    state = step.init(fp.shard(llama.init(cfg, seed=0), specs, mesh))
    losses = []
    with transport.recording() as log:  # the steps only
        for b in batches(2):
            state, m = step(state, local(b, mesh))
            losses.append(m["loss"])
    table = V * config().hidden_size * 4  # the float32 embedding table's bytes
    gathers = [e[3] for e in log if e[0] == "collective" and e[2] == "all_gather"]
    return losses, fp.gather(step.gather_params(state), specs, mesh), gathers, table


def test_zero3_looks_tokens_up_on_the_parts_without_gathering_the_table():
    """The untied embedding table is never gathered at ZeRO-3 (funcpar.train.zero3.ZeroRows: each rank looks up the ids
    whose rows it holds, for every data rank, and adds their gradients into its own part), and training still equals
    one process (the bar of the float32 ZeRO-3 test)."""
    ref_losses, _, ref, _ = train(fp.Mesh(), 0, steps=2)
    for losses, params, gathers, table in harness.run(2, _lookups):
        assert table not in gathers and max(gathers) > 0
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses, strict=True))
        assert _distance(params, ref) <= 1e-4 * _distance(ref, llama.init(config(), seed=0))
