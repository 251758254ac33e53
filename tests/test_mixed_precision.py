"""Mixed precision: low-precision compute copies, fp32 master weights as ZeRO parts, dynamic loss scaling that
skips an overflowing step on every rank at once, and checkpoints that carry all of it."""

import functools

import optree
import torch

import funcpar as fp
import harness
from fixtures import CLIP, LR, batches, config
from funcpar.models import llama


def make(mesh, dtype, **kw):
    cfg = config()
    specs = llama.specs(cfg, mesh)
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), specs, mesh=mesh,
                           optimizer=fp.optim.adamw(LR, weight_decay=0.1), zero=1, accum_steps=2, clip_norm=CLIP,
                           param_dtype=dtype, **kw)
    return step, specs, fp.shard(llama.init(cfg, seed=0), specs, mesh)


def train(mesh, dtype, steps=4, **kw):
    step, specs, params = make(mesh, dtype, **kw)
    state = step.init(params)
    dp, c = mesh.axis_size("dp"), mesh.coord("dp")
    out = []
    for b in batches()[:steps]:
        state, m = step(state, {k: v.chunk(dp)[c] for k, v in b.items()})
        out.append(m)
    return state, out, specs


def _bf16(sizes):
    mesh = harness.mesh(**sizes)
    state, ms, specs = train(mesh, torch.bfloat16)
    dtypes = {x.dtype for _, x in fp.tree.leaves_with_path(state.params)}
    masters = {x.dtype for _, x in fp.tree.leaves_with_path(state.opt_state.master)}
    return [m["loss"] for m in ms], dtypes, masters, fp.gather(state.params, specs, mesh, dst=0)


def test_bf16_on_a_mesh_tracks_single_process_and_fp32():
    _, single, _ = train(fp.Mesh(), torch.bfloat16)
    _, full, _ = train(fp.Mesh(), None)
    single, full = [m["loss"] for m in single], [m["loss"] for m in full]
    losses, dtypes, masters, params = harness.run(4, _bf16, {"tp": 2, "dp": 2})[0]
    assert dtypes == {torch.bfloat16} and masters == {torch.float32}
    for a, b, c in zip(losses, single, full, strict=True):
        assert abs(a - b) <= 5e-3 * b  # bf16 round-off differs with the reduction order, nothing more
        assert abs(a - c) <= 2e-2 * c  # and bf16 training follows fp32 training
    assert abs(losses[-1] - losses[0]) > 1e-3  # it trains


def _fp16_overflow(sizes):
    mesh = harness.mesh(**sizes)
    step, specs, params = make(mesh, torch.float16, growth_interval=2)
    state = step.init(params)
    scaled = state.opt_state.inner._replace(scale=torch.tensor(2.0**24))  # the apply_if_finite state: overflows in fp16
    state = state._replace(opt_state=state.opt_state._replace(inner=scaled))
    dp, c = mesh.axis_size("dp"), mesh.coord("dp")
    log = []
    for b in batches() * 2:
        before = state.params["norm"].clone()
        state, m = step(state, {k: v.chunk(dp)[c] for k, v in b.items()})
        log.append((m.get("skipped", False), m["loss_scale"], torch.equal(before, state.params["norm"]), m["step"]))
    return log


def test_fp16_dynamic_loss_scaling_skips_overflows_on_every_rank():
    logs = harness.run(2, _fp16_overflow, {"dp": 2})
    assert logs[0] == logs[1]  # both ranks skip the same steps
    log = logs[0]
    assert [entry[0] for entry in log[:4]] == [True] * 4  # 2**24 .. 2**21 overflow fp16 gradients
    assert not all(entry[0] for entry in log)  # then training runs
    # replay the rule: overflow -> skip, halve, reset; 2 clean steps in a row -> double
    scale, good, updates = 2.0**24, 0, 0
    for skipped, got_scale, unchanged, step_count in log:
        if skipped:
            scale, good = scale / 2, 0
        else:
            updates, good = updates + 1, good + 1
            if good == 2:
                scale, good = scale * 2, 0
        assert got_scale == scale and step_count == updates
        assert unchanged == skipped  # a skipped step leaves the parameters untouched, a clean one updates them


def test_mixed_state_resumes_bit_exact(tmp_path):
    mesh = fp.Mesh()
    full, ms, _ = train(mesh, torch.bfloat16, steps=4)
    step, specs, params = make(mesh, torch.bfloat16)
    state = step.init(params)
    for b in batches()[:2]:
        state, _ = step(state, b)
    step.save(tmp_path / "c", state)
    step2, _, params2 = make(mesh, torch.bfloat16)
    step2.init(params2)
    state2, _ = step2.load(tmp_path / "c")
    assert state2.opt_state.master["embed"].dtype == torch.float32 and state2.params["embed"].dtype == torch.bfloat16
    for b in batches()[2:4]:
        state2, m = step2(state2, b)
    assert m["loss"] == ms[-1]["loss"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fp.tree.leaves_with_path(state2.params), fp.tree.leaves_with_path(full.params), strict=True))


def _masters(sizes):
    """bf16 at each ZeRO stage: the gathered masters before a step (the float32 initial weights, exactly) and after
    one (the compute copies are their bf16 roundings, and they hold more than bf16 does)."""
    mesh = harness.mesh(**sizes)
    cfg = config()
    specs = llama.specs(cfg, mesh)
    params = fp.shard(llama.init(cfg, seed=0), specs, mesh)
    dp, c = mesh.axis_size("dp"), mesh.coord("dp")
    out = {}
    for zero in (0, 1, 2, 3):
        step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), specs, mesh=mesh,
                               optimizer=fp.optim.adamw(LR), zero=zero, param_dtype=torch.bfloat16)
        state = step.init(params)
        first = step.gather_masters(state)
        state, _ = step(state, {k: v.chunk(dp)[c] for k, v in batches()[0].items()})
        masters, compute = optree.tree_leaves(step.gather_masters(state)), optree.tree_leaves(step.gather_params(state))
        out[zero] = (all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(first), optree.tree_leaves(params),
                                                           strict=True)),
                     all(m.dtype == torch.float32 and torch.equal(m.to(torch.bfloat16), p)
                         for m, p in zip(masters, compute, strict=True)),
                     any(not torch.equal(m, p.float()) for m, p in zip(masters, compute, strict=True)))
    return out


def test_the_float32_masters_gather_whole_at_every_zero_stage():
    """`step.gather_masters` (what `--export-dtype fp32` writes from a bf16 run): every rank's parts of the float32
    masters, assembled into whole local leaves on tp=2 x dp=2, at ZeRO 0 to 3."""
    assert harness.run(4, _masters, {"tp": 2, "dp": 2}) == [{z: (True, True, True) for z in range(4)}] * 4
