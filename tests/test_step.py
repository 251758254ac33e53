"""compile_step on real gloo meshes against a single-process run and against transformers + torch.optim."""

import functools
import math
import os
import tempfile

import optree
import pytest
import torch

import funcpar as fp
import harness
from fixtures import B, CLIP, LR, STEPS, T, WD, batches, config
from funcpar.models import llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")

def make_opt(kind):
    if kind == "adamw":
        return fp.optim.adamw(LR, weight_decay=WD)
    if kind == "lion":
        return fp.optim.lion(1e-3, weight_decay=WD)
    return fp.optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01)


def train(mesh, zero, accum, opt="adamw", layers=2, clip=CLIP, steps=STEPS):
    cfg = config(layers)
    specs = llama.specs(cfg, mesh)
    params = fp.shard(llama.init(cfg, seed=0), specs, mesh)
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), specs, mesh=mesh,
                           optimizer=make_opt(opt), zero=zero, accum_steps=accum, clip_norm=clip)
    state = step.init(params)
    dp, c = mesh.axis_size("dp"), mesh.coord("dp")
    losses, norms = [], []
    for b in batches()[:steps]:
        local = {k: v.chunk(dp)[c] for k, v in b.items()}
        state, m = step(state, local)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    return losses, norms, fp.gather(state.params, specs, mesh, dst=0), state


def _sharded_runs(sizes, runs, opt="adamw"):
    mesh = harness.mesh(**sizes)
    out = {}
    for zero, accum in runs:
        losses, norms, params, state = train(mesh, zero, accum, opt)
        nbytes = sum(x.numel() * x.element_size() for x in fp.tree.leaves_with_path(state.opt_state) for x in [x[1]])
        out[(zero, accum)] = (losses, norms, params, nbytes)
    return out


@functools.lru_cache(maxsize=None)
def single(opt="adamw"):
    losses, norms, params, _ = train(fp.Mesh(), 0, 1, opt)
    return losses, norms, params


@functools.lru_cache(maxsize=None)
def peer(opt="adamw"):
    """transformers' Llama + torch.optim + clip_grad_norm_ on the same weights and global batches."""
    tf = pytest.importorskip("transformers")

    cfg = config()
    init = llama.init(cfg, seed=0)
    with tempfile.TemporaryDirectory() as d:
        fp.hf.save(d, init, llama, cfg)
        model = tf.AutoModelForCausalLM.from_pretrained(d)
        if opt == "adamw":
            o = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        else:
            o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
        losses, norms = [], []
        for b in batches():
            o.zero_grad()
            out = model(**b)
            out.loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            o.step()
            losses.append(out.loss.item())
        model.save_pretrained(d + "/out")
        params, _ = fp.hf.load(d + "/out", llama)
    return losses, norms, params


def update_ratio(p, ref, init):
    num = sum((a - b).double().pow(2).sum() for (_, a), (_, b) in zip(fp.tree.leaves_with_path(p), fp.tree.leaves_with_path(ref), strict=True))
    den = sum((a - b).double().pow(2).sum() for (_, a), (_, b) in zip(fp.tree.leaves_with_path(ref), fp.tree.leaves_with_path(init), strict=True))
    return math.sqrt(num / den)


def rel(a, b):
    return abs(a - b) / abs(b)


MESHES = [({"tp": 2, "dp": 2}, 4), ({"tp": 4, "dp": 2}, 8), ({"dp": 4}, 4), ({"tp": 2}, 2)]
RUNS = [(z, a) for z in (0, 1, 2) for a in (1, 2)]


@pytest.mark.parametrize("sizes, world", MESHES, ids=lambda v: str(v))
def test_adamw_steps_match_single_process_and_transformers(sizes, world):
    s_losses, s_norms, s_params = single()
    p_losses, p_norms, p_params = peer()
    init = llama.init(config(), seed=0)
    # the single-process funcpar run is itself the peer's run
    for a, b in zip(s_losses, p_losses, strict=True):
        assert rel(a, b) <= 1e-5
    for a, b in zip(s_norms, p_norms, strict=True):
        assert rel(a, b) <= 1e-5 and b > CLIP  # clipping is active on every step
    assert update_ratio(s_params, p_params, init) <= 1e-4
    per_rank = harness.run(world, _sharded_runs, sizes, RUNS)
    results = per_rank[0]
    tp, dp = sizes.get("tp", 1), sizes.get("dp", 1)
    total_state = 2 * sum(x.numel() * 4 for _, x in fp.tree.leaves_with_path(init))
    for (zero, accum), (losses, norms, params, nbytes) in results.items():
        what = f"{sizes} zero={zero} accum={accum}"
        for k in range(STEPS):
            assert rel(losses[k], s_losses[k]) <= 1e-5, (what, k, losses[k], s_losses[k])
            assert rel(losses[k], p_losses[k]) <= 1e-5, (what, k)
            assert rel(norms[k], s_norms[k]) <= 1e-5, (what, k, norms[k], s_norms[k])  # the global norm
        assert update_ratio(params, s_params, init) <= 1e-4, what
        assert update_ratio(params, p_params, init) <= 1e-4, what
        if zero >= 1:  # every rank's optimizer state is its 1/(tp*dp) share
            for rank, res in enumerate(per_rank):
                nb = res[(zero, accum)][3]
                assert abs(nb - total_state / (tp * dp)) <= 0.01 * total_state / (tp * dp), (what, rank, nb, total_state)


def _other_opts(sizes):
    mesh = harness.mesh(**sizes)
    return {opt: train(mesh, 1, 2, opt)[:3] for opt in ("sgd", "lion")}


def test_sgd_and_lion_match_single_process_and_peers():
    res = harness.run(4, _other_opts, {"tp": 2, "dp": 2})[0]
    init = llama.init(config(), seed=0)
    # SGD: element-wise agreement with the single-process run and with torch.optim.SGD
    s_losses, _, s_params = single("sgd")
    p_losses, _, p_params = peer("sgd")
    losses, _, params = res["sgd"]
    for a, b, c in zip(losses, s_losses, p_losses, strict=True):
        assert rel(a, b) <= 1e-5 and rel(a, c) <= 1e-5
    for (name, x), (_, y), (_, z) in zip(fp.tree.leaves_with_path(params), fp.tree.leaves_with_path(s_params), fp.tree.leaves_with_path(p_params), strict=True):
        assert (x - y).abs().max() <= 1e-5 and (x - z).abs().max() <= 1e-5, name
    # Lion against the single-process run and against Lion written out by hand on transformers' gradients
    s_losses, _, s_params = single("lion")
    losses, _, params = res["lion"]
    for a, b, c in zip(losses, s_losses, lion_by_hand(), strict=True):
        assert rel(a, b) <= 1e-5 and rel(a, c) <= 1e-5
    assert update_ratio(params, s_params, init) <= 1e-4


def lion_by_hand():
    tf = pytest.importorskip("transformers")

    cfg = config()
    with tempfile.TemporaryDirectory() as d:
        fp.hf.save(d, llama.init(cfg, seed=0), llama, cfg)
        model = tf.AutoModelForCausalLM.from_pretrained(d)
    ps = list(model.parameters())
    mom = [torch.zeros_like(p) for p in ps]
    losses = []
    for b in batches():
        model.zero_grad()
        out = model(**b)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(ps, CLIP)
        with torch.no_grad():
            for p, m in zip(ps, mom, strict=True):
                c = 0.9 * m + 0.1 * p.grad
                p.add_(torch.sign(c) + WD * p, alpha=-1e-3)
                m.mul_(0.99).add_(p.grad, alpha=0.01)
        losses.append(out.loss.item())
    return losses


def _count_collectives(layers):
    import torch.distributed as dist

    from funcpar.parallel import collectives as C

    mesh = harness.mesh(dp=4)
    cfg = config(layers)
    specs = llama.specs(cfg, mesh)
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), specs, mesh=mesh,
                           optimizer=fp.optim.adamw(LR), zero=1, accum_steps=2, clip_norm=CLIP)
    state = step.init(fp.shard(llama.init(cfg), specs, mesh))
    b = {k: v.chunk(4)[mesh.coord("dp")] for k, v in batches()[0].items()}
    state, _ = step(state, b)
    calls = []
    names = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_gather", "reduce_scatter")
    saved = (dist.all_reduce, C._all_gather_flat, C._reduce_scatter_flat, dist.broadcast, dist.batch_isend_irecv,
             C.ring_all_gather, C.ring_reduce_scatter)

    def spy(name, f):
        return lambda *a, **k: (calls.append(name), f(*a, **k))[1]

    (dist.all_reduce, C._all_gather_flat, C._reduce_scatter_flat, dist.broadcast, dist.batch_isend_irecv,
     C.ring_all_gather, C.ring_reduce_scatter) = [spy(n, f) for n, f in zip(names, saved, strict=True)]
    try:
        step(state, b)
    finally:
        (dist.all_reduce, C._all_gather_flat, C._reduce_scatter_flat, dist.broadcast, dist.batch_isend_irecv,
         C.ring_all_gather, C.ring_reduce_scatter) = saved
    return len(fp.tree.leaves_with_path(state.params)), sorted(calls)


def test_collectives_per_step_do_not_grow_with_leaves():
    n2, calls2 = harness.run(4, _count_collectives, 2)[0]
    n6, calls6 = harness.run(4, _count_collectives, 6)[0]
    assert n6 > 2 * n2
    assert calls2 == calls6  # the same collectives for 3x the leaves
    # token count, one reduce-scatter and one all-gather per bucket, one for loss and norm; on gloo the
    # reduce-scatter and the all-gather are rings of dp-1 = 3 send/recv exchanges each
    assert calls2 == sorted(["all_gather", "all_reduce", "all_reduce", "reduce_scatter"] + ["p2p"] * 6), calls2


# --------------------------------------------------------------------------------------------- errors, check


def _errors():
    mesh = harness.mesh(dp=2)
    cfg = config()
    specs = llama.specs(cfg, mesh)
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), specs, mesh=mesh,
                           optimizer=fp.optim.adamw(LR), accum_steps=4)
    state = step.init(fp.shard(llama.init(cfg), specs, mesh))
    try:
        step(state, {k: v[:3] for k, v in batches()[0].items()})
    except fp.StepError as e:
        return str(e)


def test_batch_not_divisible_by_dp_times_accum():
    for msg in harness.run(2, _errors):
        assert msg == ("the global batch of 6 rows (3 on this dp rank x dp=2) is not divisible by dp x accum_steps = 8: "
                       "make it a multiple of 8")


def test_specs_params_mismatch_and_non_scalar_loss():
    cfg = config()
    mesh = fp.Mesh()
    specs = llama.specs(cfg)
    params = llama.init(cfg)
    bad_specs = dict(specs)
    del bad_specs["norm"]
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), bad_specs, mesh=mesh, optimizer=fp.optim.sgd(0.1))
    with pytest.raises(fp.SpecError, match=r"specs do not match params at '<root>': missing in specs: norm"):
        step.init(params)
    step = fp.compile_step(lambda p, b: llama.forward(p, b["input_ids"], cfg, mesh).mean(-1), specs, mesh=mesh, optimizer=fp.optim.sgd(0.1))
    state = step.init(params)
    with pytest.raises(fp.StepError, match=r"loss_fn must return a scalar tensor \(use .mean\(\) or .sum\(\)\); it returned \(8, 16\)"):
        step(state, batches()[0])
    step = fp.compile_step(lambda p, b: 0.0, {"w": fp.P("dp")}, mesh=mesh, optimizer=fp.optim.sgd(0.1))
    with pytest.raises(fp.SpecError, match=r"leaf 'w': spec P\('dp'\) shards over 'dp'"):
        step.init({"w": torch.zeros(4)})


def _inconsistent(what):
    mesh = harness.mesh(tp=2)
    cfg = config()
    specs = llama.specs(cfg, mesh)
    params = fp.shard(llama.init(cfg), specs, mesh)
    b = batches()[0]
    if mesh.coord("tp") == 1:
        if what == "batch":
            b = {**b, "input_ids": b["input_ids"].flip(0)}
        else:
            params = {**params, "norm": params["norm"] + 1e-3}
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), specs, mesh=mesh,
                           optimizer=fp.optim.adamw(LR), check=True)
    try:
        step(step.init(params), b)
    except fp.StepError as e:
        return str(e)


def test_check_names_inconsistent_batch_and_replicated_leaf():
    for msg in harness.run(2, _inconsistent, "batch"):
        assert msg.startswith("Data inconsistency within the TP group: batch['input_ids'] differs across mesh axis 'tp' (group ranks [0, 1])")
    for msg in harness.run(2, _inconsistent, "leaf"):
        assert msg.startswith("Data inconsistency within the TP group: leaf 'norm' differs across mesh axis 'tp'")


def test_schedules_match_their_formulas():
    f = fp.optim.warmup_cosine(1.0, warmup=10, total=110, end=0.1)
    assert f(0) == 0.0 and f(5) == 0.5 and f(10) == 1.0
    assert abs(f(60) - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))) < 1e-12 and abs(f(110) - 0.1) < 1e-12
    assert abs(f(500) - 0.1) < 1e-12
    g = fp.optim.warmup_linear_decay(2.0, warmup=10, total=110)  # DeepSpeed WarmupDecayLR, log warm-up
    assert g(0) == 0.0 and abs(g(4) - 2.0 * math.log(5) / math.log(10)) < 1e-12
    assert g(10) == 2.0 and abs(g(60) - 1.0) < 1e-12 and g(110) == 0.0 and g(200) == 0.0
    h = fp.optim.warmup_linear_decay(1.0, warmup=4, total=8, min_lr=0.5, warmup_type="linear")
    assert [h(s) for s in range(9)] == [0.5, 0.625, 0.75, 0.875, 1.0, 0.875, 0.75, 0.625, 0.5]
    assert fp.optim.constant(3e-4)(10**6) == 3e-4


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_step_is_functional_with_donate_false(zero):
    cfg = config()
    mesh = fp.Mesh()
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), llama.specs(cfg), mesh=mesh,
                           optimizer=fp.optim.adamw(LR, weight_decay=WD), zero=zero, accum_steps=2, clip_norm=CLIP,
                           donate=False)
    state = step.init(llama.init(cfg))
    state, _ = step(state, batches()[0])
    tensors = lambda s: [x for _, x in fp.tree.leaves_with_path(s) if isinstance(x, torch.Tensor)]  # noqa: E731
    snapshot = [x.clone() for x in tensors(state)]
    new, m = step(state, batches()[1])
    assert all(torch.equal(a, b) for a, b in zip(snapshot, tensors(state), strict=True))  # the old state is intact
    assert new.step == state.step + 1 == 2 and m["step"] == 2 and m["lr"] == LR and m["tokens"] == B * T
    assert not torch.equal(new.params["norm"], state.params["norm"])
    again, _ = step(state, batches()[1])  # and usable again: the same step from the same state
    assert all(torch.equal(a, b) for a, b in zip(tensors(new), tensors(again), strict=True))


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_a_consumed_state_raises_and_donation_changes_no_number(zero):
    cfg = config()
    mesh = fp.Mesh()
    runs = {}
    for donate in (True, False):
        step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), llama.specs(cfg), mesh=mesh,
                               optimizer=fp.optim.adamw(LR, weight_decay=WD), zero=zero, accum_steps=2,
                               clip_norm=CLIP, donate=donate)
        states = [step.init(llama.init(cfg))]
        losses = []
        for b in batches()[:3]:
            state, m = step(states[-1], b)
            states.append(state)
            losses.append(m["loss"])
        runs[donate] = step, states, losses
    step, states, losses = runs[True]
    for old in states[:-1]:  # every state but the last was consumed: using one again is an error, not stale numbers
        with pytest.raises(fp.StepError, match=rf"this train state \(step {old.step}\) was consumed by an earlier "
                                               r"call of the step, which updated its tensors in place: pass the state "
                                               r"the step returned"):
            step(old, batches()[3])
    assert losses == runs[False][2]  # donation changes no number
    last, last_ref = states[-1], runs[False][1][-1]
    for (p, x), (_, y) in zip(fp.tree.leaves_with_path(last[:2]), fp.tree.leaves_with_path(last_ref[:2]), strict=True):
        assert torch.equal(x, y), p
    state, m = step(states[-1], batches()[3])  # the live state goes on
    assert m["step"] == 4


def test_masked_freezes_leaves_and_decay_mask_matches_torch_param_groups(tmp_path):
    tf = pytest.importorskip("transformers")

    cfg = config()
    mesh = fp.Mesh()
    params = llama.init(cfg, seed=0)
    # frozen embedding: no update, no state
    frozen = fp.tree.map_with_path(lambda p, x: p != "embed", params)
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), llama.specs(cfg), mesh=mesh,
                           optimizer=fp.optim.masked(fp.optim.sgd(0.1, momentum=0.9), frozen))
    state = step.init(params)
    trace = state.opt_state[0]  # masked(sgd) = chain(trace, scale_by_learning_rate) on the unfrozen leaves
    assert trace.trace["embed"] is None and trace.trace["norm"] is not None
    for b in batches()[:3]:
        state, _ = step(state, b)
    assert torch.equal(state.params["embed"], params["embed"]) and not torch.equal(state.params["norm"], params["norm"])
    # ... and it survives a checkpoint round trip bit for bit
    step.save(tmp_path / "c", state)
    again, _ = step.load(tmp_path / "c")
    for (n, a), (_, b) in zip(fp.tree.leaves_with_path(again.opt_state), fp.tree.leaves_with_path(state.opt_state), strict=True):
        assert torch.equal(a, b), n
    # decay only on matrices, as torch.optim.AdamW with two parameter groups does it
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), llama.specs(cfg), mesh=mesh,
                           optimizer=fp.optim.adamw(LR, weight_decay=0.5, mask=fp.optim.decay_mask(params)))
    state = step.init(params)
    with tempfile.TemporaryDirectory() as d:
        fp.hf.save(d, params, llama, cfg)
        model = tf.AutoModelForCausalLM.from_pretrained(d)
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.5},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    o = torch.optim.AdamW(groups, lr=LR)
    for b in batches()[:3]:
        state, m = step(state, b)
        o.zero_grad()
        out = model(**b)
        out.loss.backward()
        o.step()
        assert rel(m["loss"], out.loss.item()) <= 1e-5
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        ref, _ = fp.hf.load(d, llama)
    assert update_ratio(state.params, ref, params) <= 1e-4
    no_mask = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), llama.specs(cfg), mesh=mesh,
                              optimizer=fp.optim.adamw(LR, weight_decay=0.5))
    s2 = no_mask.init(params)
    for b in batches()[:3]:
        s2, _ = no_mask(s2, b)
    assert update_ratio(s2.params, ref, params) > 1e-3  # the mask matters here


def test_compiled_step_matches_eager():
    cfg = config(layers=1)
    mesh = fp.Mesh()
    losses = {}
    for compiled in (False, True):
        step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), llama.specs(cfg), mesh=mesh,
                               optimizer=fp.optim.adamw(LR), accum_steps=2, clip_norm=CLIP, compile=compiled)
        state = step.init(llama.init(cfg))
        losses[compiled] = []
        for b in batches()[:3]:
            state, m = step(state, b)
            losses[compiled].append(m["loss"])
    assert all(rel(a, b) <= 1e-5 for a, b in zip(losses[True], losses[False], strict=True)), losses


def test_compile_step_names_an_unknown_option_and_the_ones_it_takes():
    # its options are written once, in their typed groups (funcpar.train.config); the error lists them all
    with pytest.raises(TypeError, match=r"compile_step\(\) got unknown option\(s\) overlap: it takes mesh, "
                                        r"optimizer, accum_steps, .*, zero, data_axes, bucket_mb, offload, pipeline, "
                                        r"chunks, parts, param_dtype, .* max_skips, parallel, pipelining, precision, "
                                        r"guards$"):
        fp.compile_step(lambda p, b: 0.0, {}, overlap=True)


def test_options_in_groups_and_as_keywords_are_one_thing():
    """``zero=2, param_dtype=bf16`` flat is the same ``StepOptions`` as the groups given whole; a group's fields are
    checked together, a field set twice is refused, and a group's check names the field."""
    flat = fp.StepOptions.of(zero=2, param_dtype=torch.bfloat16, loss_scale=128.0, pipeline="gpipe", max_skips=3)
    grouped = fp.StepOptions(parallel=fp.Parallel(zero=2), pipelining=fp.Pipelining(schedule="gpipe"),
                             precision=fp.Precision(param_dtype=torch.bfloat16, loss_scale=128.0),
                             guards=fp.Guards(max_skips=3))
    assert flat == grouped and fp.StepOptions.of(grouped, accum_steps=2).parallel.zero == 2
    assert fp.Precision(param_dtype=torch.float16).scaling == "dynamic" and fp.Precision().scaling is None
    with pytest.raises(TypeError, match="zero= and parallel= together"):
        fp.StepOptions.of(zero=2, parallel=fp.Parallel())
    with pytest.raises(fp.StepError, match="loss_scale needs mixed precision"):
        fp.StepOptions.of(loss_scale="dynamic")
    with pytest.raises(fp.StepError, match="bucket_mb must be a number > 0, got 0"):
        fp.Parallel(bucket_mb=0)
    with pytest.raises(TypeError, match="precision= takes a funcpar.Precision, got dict"):
        fp.StepOptions(precision={"param_dtype": torch.bfloat16})
    step = fp.compile_step(lambda p, b: p["w"].sum(), {"w": fp.P()}, fp.StepOptions(guards=fp.Guards(check=False)),
                           mesh=fp.Mesh(), clip_norm=1.0)
    assert step.options.guards.check is False and step.options.clip_norm == 1.0 and step.options.parallel.zero == 1


def test_a_handoff_frees_the_parameters_once_copied_and_is_taken_once():
    """step.init(fp.Handoff(params)): the state equals init(params); the handed leaves are freed when init has copied
    them into its buffers (a weak reference to one is dead by the time the optimizer state is made); a handoff
    taken twice is an error that says so."""
    import weakref

    cfg, mesh = config(), fp.Mesh()
    step = fp.compile_step(functools.partial(llama.loss, cfg=cfg, mesh=mesh), llama.specs(cfg), mesh=mesh)
    direct = step.init(llama.init(cfg))
    seen = {}
    optimizer_init = step.optimizer.init

    def init_state(tree):  # (the optimizer state is made after the parameters are in the buffers)
        seen["alive"] = watch() is not None
        return optimizer_init(tree)

    params = llama.init(cfg)
    watch = weakref.ref(params["norm"])
    handed = fp.Handoff(params)
    del params
    step.optimizer = step.optimizer._replace(init=init_state)
    state = step.init(handed)
    assert seen == {"alive": False}
    for a, b in zip(optree.tree_leaves(state.params), optree.tree_leaves(direct.params), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(fp.StepError, match="this Handoff was taken already: hand each init a new one"):
        step.init(handed)
