"""funcpar.optim: the chained optimizers against torch.optim and plain references; composability; frozen and
empty leaves; purity (the caller's tensors are never written); the reported schedule; the plain pair and its subclass
for the step, ABSENT and WRITTEN; the step's norm kernel (funcpar.train.norms). Single process."""

import optree
import pytest
import torch

import funcpar as fp

STEPS = 6


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.randn(3, generator=g),
        "t": torch.randn(2, 3, 2, generator=g),
    }


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return optree.tree_map(lambda p: torch.randn(p.shape, generator=g), params)


def _run(opt, params, steps=STEPS):
    """``steps`` updates of ``opt`` on ``params`` with the seeded gradients; returns the final params."""
    state = opt.init(params)
    for k in range(steps):
        updates, state = opt.update(_grads(params, k), state, params)
        params = fp.optim.apply_updates(params, updates)
    return params


def _run_torch(make, params, groups_of, schedule=None, steps=STEPS):
    """The same with a torch.optim optimizer over the groups ``groups_of(tensors)``, lr set per step if scheduled."""
    ts = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    o = make(groups_of(ts))
    for k in range(steps):
        for name, g in _grads(params, k).items():
            ts[name].grad = g
        if schedule is not None:
            for group in o.param_groups:
                group["lr"] = schedule(k)
        o.step()
    return {k: v.detach() for k, v in ts.items()}


def _decay_groups(wd):
    return lambda ts: [
        {"params": [v for v in ts.values() if v.ndim >= 2], "weight_decay": wd},
        {"params": [v for v in ts.values() if v.ndim < 2], "weight_decay": 0.0},
    ]


def _assert_close(a, b, rtol=1e-6, atol=1e-7):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def _state_types(state):
    from funcpar.io.checkpoint import _state_types as types  # the names a checkpoint records for an optimizer

    return types(state)


# ------------------------------------------------------------------------------------------ against torch.optim


def test_adamw_with_decay_mask_equals_torch_adamw_two_groups():
    params = _params()
    mask = fp.optim.decay_mask(params)
    ours = _run(fp.optim.adamw(1e-2, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3, mask=mask), params)
    ref = _run_torch(lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.8, 0.95), eps=1e-6), params, _decay_groups(0.3))
    _assert_close(ours, ref)
    decay_all = _run(fp.optim.adamw(1e-2, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3), params)
    assert not torch.equal(ours["b"], decay_all["b"])  # the mask mattered


def test_adamw_with_schedule_equals_torch_adamw_lr_per_step():
    params = _params(1)
    sched = fp.optim.warmup_cosine(2e-2, warmup=2, total=STEPS, end=1e-3, start=1e-3)
    ours = _run(fp.optim.adamw(sched, weight_decay=0.1, mask=fp.optim.decay_mask(params)), params)
    ref = _run_torch(lambda g: torch.optim.AdamW(g, lr=0.0), params, _decay_groups(0.1), schedule=sched)
    _assert_close(ours, ref)


def _run_fused(opt, params, steps=STEPS, clip=None):
    """The train step's path: ``update_with(..., inplace=EVERYTHING)`` writes each update into (copies of) the params
    through ``fused_of(opt)`` and says so (``WRITTEN``); the final params and state. ``clip``: with
    ``clip_by_global_norm(clip)`` in front, as ``compile_step(clip_norm=)`` builds it."""
    if clip is not None:
        opt = fp.optim.chain(fp.optim.clip_by_global_norm(clip), opt)
    params = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    for k in range(steps):
        grads = _grads(params, k)
        assert fp.optim.fused_of(opt).can(grads, params)
        updates, state = fp.optim.update_with(opt, grads, state, params, inplace=fp.optim.EVERYTHING,
                                              global_norm=fp.optim.global_norm(grads))
        assert updates is fp.optim.WRITTEN
    return params, state


def test_fused_adamw_equals_the_chain_and_torch_adamw():
    params = {**_params(2), "empty": torch.zeros(0)}  # ZeRO hands some ranks empty slices
    mask = {**fp.optim.decay_mask(params), "empty": True}
    sched = fp.optim.warmup_cosine(2e-2, warmup=2, total=STEPS, end=1e-3, start=1e-3)
    opt = fp.optim.adamw(sched, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3, mask=mask)
    calls = []
    real = torch._fused_adamw_
    torch._fused_adamw_ = lambda *a, **k: calls.append(k["weight_decay"]) or real(*a, **k)
    try:
        fused, state = _run_fused(opt, params)
    finally:
        torch._fused_adamw_ = real
    assert calls == [0.3, 0.0] * STEPS  # torch's kernel, once per decay group per step
    chained = _run(opt, params)
    _assert_close(fused, chained)
    ref = _run_torch(lambda g: torch.optim.AdamW(g, lr=0.0, betas=(0.8, 0.95), eps=1e-6),
                     {k: v for k, v in params.items() if k != "empty"}, _decay_groups(0.3), schedule=sched)
    _assert_close({k: v for k, v in fused.items() if k != "empty"}, ref)
    chain_state = opt.init(params)
    for k in range(STEPS):
        chain_state = opt.update(_grads(params, k), chain_state, _run(opt, params, k))[1]
    assert [x.tolist() for x in optree.tree_leaves(state) if x.ndim == 0] == [STEPS, STEPS]  # the counts
    for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(chain_state), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the moments: the same state, a checkpoint's too
    assert _state_types(state) == _state_types(chain_state)


def test_fused_adamw_after_clipping_and_what_has_no_fused_path():
    params = _params(3)
    opt = fp.optim.adamw(1e-2, weight_decay=0.1)
    clipped, _ = _run_fused(opt, params, clip=0.5)
    chained = _run(fp.optim.chain(fp.optim.clip_by_global_norm(0.5), opt), params)
    _assert_close(clipped, chained)
    assert not torch.allclose(clipped["w"], _run_fused(opt, params)[0]["w"])  # the clipping mattered
    fused_of = fp.optim.fused_of
    assert fused_of(fp.optim.lion(1e-3)) is None and fused_of(fp.optim.sgd(1e-2)) is None
    assert fused_of(fp.optim.masked(opt, {"w": True, "b": False, "t": True})) is None
    assert fused_of(fp.optim.chain(opt, fp.optim.scale(0.5))) is None  # a stage after AdamW's: not fused
    half = {k: v.half() for k, v in params.items()}
    assert not fused_of(opt).can(half, half) and not fused_of(opt).can({}, {})


def test_scalar_stages_fold_into_the_fused_kernel():
    """Clipping and scaling ahead of AdamW cost no pass over the gradients: their product reaches torch's kernel as
    its grad_scale; a stage between them that is not a scalar gets the product applied first."""
    params = _params(3)
    opt = fp.optim.adamw(1e-2, weight_decay=0.1)
    folded = fp.optim.chain(fp.optim.scale(0.5), fp.optim.clip_by_global_norm(0.5), opt)
    assert fp.optim.fused_of(folded).scales
    seen, muls = [], []
    real_adam, real_mul = torch._fused_adamw_, torch._foreach_mul_
    torch._fused_adamw_ = lambda *a, **k: seen.append(k["grad_scale"]) or real_adam(*a, **k)
    torch._foreach_mul_ = lambda *a: muls.append(a) or real_mul(*a)
    try:
        ours, _ = _run_fused(folded, params)
    finally:
        torch._fused_adamw_, torch._foreach_mul_ = real_adam, real_mul
    assert muls == [] and len(seen) == STEPS and all(s is not None and s.item() > 2.0 for s in seen)
    _assert_close(ours, _run(folded, params))  # the unfused chain: every stage a pass of its own

    def shift(grads, state, params=None, *, inplace=fp.optim.NOTHING, **extra):  # not a scalar: sees them scaled
        return {k: v + 1e-3 for k, v in grads.items()}, state

    mixed = fp.optim.chain(fp.optim.clip_by_global_norm(0.5), fp.optim.InPlaceTransformation(
        lambda p: (), shift, fresh=lambda fresh: True), fp.optim.scale(2.0), opt)
    _assert_close(_run_fused(mixed, params)[0], _run(mixed, params))
    assert not torch.allclose(_run(mixed, params)["w"], _run(folded, params)["w"])


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_weight_decay_equals_torch_sgd(nesterov):
    params = _params(2)
    ours = _run(fp.optim.sgd(0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.01), params)
    ref = _run_torch(lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.01),
                     params, lambda ts: list(ts.values()))
    _assert_close(ours, ref)


def test_sgd_masked_decay_and_without_momentum_equal_torch_sgd():
    params = _params(3)
    mask = fp.optim.decay_mask(params)
    ours = _run(fp.optim.sgd(0.05, momentum=0.5, nesterov=True, weight_decay=0.2, mask=mask), params)
    ref = _run_torch(lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.5, nesterov=True), params, _decay_groups(0.2))
    _assert_close(ours, ref)
    for wd in (0.0, 0.2):
        ours = _run(fp.optim.sgd(0.05, weight_decay=wd), params)
        ref = _run_torch(lambda g: torch.optim.SGD(g, lr=0.05, weight_decay=wd), params, lambda ts: list(ts.values()))
        _assert_close(ours, ref)


def test_sgd_nesterov_needs_momentum():
    with pytest.raises(ValueError, match="nesterov"):
        fp.optim.sgd(0.1, nesterov=True)


def test_lion_equals_the_update_rule_written_out():
    params = _params(4)
    lr, b1, b2, wd = 3e-3, 0.9, 0.99, 0.5
    mask = fp.optim.decay_mask(params)
    ours = _run(fp.optim.lion(lr, b1=b1, b2=b2, weight_decay=wd, mask=mask), params)
    ref = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    for step in range(STEPS):
        for k, g in _grads(params, step).items():
            direction = torch.sign(b1 * m[k] + (1 - b1) * g)
            decay = wd * ref[k] if mask[k] else 0.0
            ref[k] = ref[k] - lr * (direction + decay)
            m[k] = b2 * m[k] + (1 - b2) * g
    _assert_close(ours, ref)


# ------------------------------------------------------------------------------------------ composability


def test_hand_built_chain_is_bitwise_adamw():
    params = _params(5)
    mask = fp.optim.decay_mask(params)
    ours = fp.optim.chain(fp.optim.scale_by_adam(), fp.optim.add_decayed_weights(0.1, mask),
                          fp.optim.scale_by_learning_rate(1e-2))
    ref = fp.optim.adamw(1e-2, weight_decay=0.1, mask=mask)
    s_ours, s_ref = ours.init(params), ref.init(params)
    for k in range(3):
        grads = _grads(params, k)
        u_ours, s_ours = ours.update(grads, s_ours, params)
        u_ref, s_ref = ref.update(grads, s_ref, params)
        assert all(torch.equal(u_ours[n], u_ref[n]) for n in params)
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(s_ours), optree.tree_leaves(s_ref), strict=True))
        params = fp.optim.apply_updates(params, u_ours)


def test_custom_chain_clip_lion_learning_rate():
    params = _params(6)
    opt = fp.optim.chain(fp.optim.clip_by_global_norm(0.5), fp.optim.scale_by_lion(b1=0.8, b2=0.9),
                         fp.optim.scale_by_learning_rate(1e-2))
    state = opt.init(params)
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    for step in range(3):
        grads = _grads(params, step)
        updates, state = opt.update(grads, state, params)
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()]))
        coef = min(1.0, 0.5 / (float(norm) + 1e-6))
        for k, g in grads.items():
            g = g * coef
            torch.testing.assert_close(updates[k], -1e-2 * torch.sign(0.8 * m[k] + 0.2 * g), rtol=0, atol=0)
            m[k] = 0.9 * m[k] + 0.1 * g
        assert all(torch.allclose(state[1].mu[k], m[k], rtol=1e-6, atol=1e-7) for k in params)
        params = fp.optim.apply_updates(params, updates)


def test_clip_first_in_a_chain_uses_the_global_norm_passed_in():
    params = _params(7)
    grads = _grads(params, 0)
    opt = fp.optim.chain(fp.optim.clip_by_global_norm(1.0), fp.optim.adamw(1e-2, weight_decay=0.1))
    updates, _ = opt.update(grads, opt.init(params), params, global_norm=torch.tensor(4.0), other_key="passed on")
    inner = fp.optim.adamw(1e-2, weight_decay=0.1)
    clipped = {k: g * (1.0 / (4.0 + 1e-6)) for k, g in grads.items()}
    expected, _ = inner.update(clipped, inner.init(params), params)
    assert all(torch.equal(updates[k], expected[k]) for k in params)


def test_state_structure_and_no_decay_stage_without_weight_decay():
    params = _params()
    assert _state_types(fp.optim.adamw(1e-3, weight_decay=0.1).init(params)) == [
        "ScaleByAdamState", "AddDecayedWeightsState", "ScaleByLearningRateState"]
    assert _state_types(fp.optim.adamw(1e-3).init(params)) == ["ScaleByAdamState", "ScaleByLearningRateState"]
    assert _state_types(fp.optim.lion(1e-3).init(params)) == ["ScaleByLionState", "ScaleByLearningRateState"]
    assert _state_types(fp.optim.sgd(0.1, momentum=0.9, weight_decay=0.1).init(params)) == [
        "AddDecayedWeightsState", "TraceState", "ScaleByLearningRateState"]
    assert _state_types(fp.optim.sgd(0.1).init(params)) == ["ScaleByLearningRateState"]
    state = fp.optim.adamw(1e-3).init(params)
    updates, state = fp.optim.adamw(1e-3).update(_grads(params, 0), state, params)
    for count in (state[0].count, state[1].count):
        assert count.dtype == torch.int64 and count.shape == () and int(count) == 1
    assert all(isinstance(x, torch.Tensor) for x in optree.tree_leaves(state))


def test_momentum_state_is_not_overwritten_by_the_learning_rate_stage():
    params = _params(8)
    grads = _grads(params, 0)
    opt = fp.optim.sgd(0.1, momentum=0.9)  # the trace stage's update is its new state itself
    updates, state = opt.update(grads, opt.init(params), params)
    assert all(torch.equal(state[0].trace[k], grads[k]) for k in params)
    assert all(torch.equal(updates[k], grads[k] * -0.1) for k in params)


# ------------------------------------------------------------------------------------------ frozen and empty leaves


def test_masked_frozen_leaf_gets_no_update_and_no_state():
    params = _params(9)
    frozen = {"w": True, "b": False, "t": True}
    opt = fp.optim.masked(fp.optim.adamw(1e-2, weight_decay=0.1, mask=fp.optim.decay_mask(params)), frozen)
    state = opt.init(params)
    assert state[0].mu["b"] is None and state[0].nu["b"] is None
    assert sum(x.numel() for x in optree.tree_leaves(state[0].mu)) == 12 + 12
    updates, state = opt.update(_grads(params, 0), state, params)
    assert updates["b"] is None and state[0].mu["b"] is None
    whole = fp.optim.adamw(1e-2, weight_decay=0.1, mask=fp.optim.decay_mask(params))
    expected, _ = whole.update(_grads(params, 0), whole.init(params), params)
    assert torch.equal(updates["w"], expected["w"]) and torch.equal(updates["t"], expected["t"])
    new = fp.optim.apply_updates(params, updates)
    assert new["b"] is params["b"] and not torch.equal(new["w"], params["w"])


@pytest.mark.parametrize("make", [
    lambda m: fp.optim.adamw(1e-2, weight_decay=0.1, mask=m),
    lambda m: fp.optim.lion(1e-2, weight_decay=0.1, mask=m),
    lambda m: fp.optim.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, mask=m),
    lambda m: fp.optim.chain(fp.optim.clip_by_global_norm(1.0), fp.optim.sgd(1e-2)),
])
def test_empty_leaves_and_all_frozen(make):
    params = {"w": torch.randn(6), "empty": torch.zeros(0), "b": torch.randn(2)}
    mask = {"w": True, "empty": True, "b": False}  # as ZeRO slices of a matrix, an empty one, and a vector
    grads = {"w": torch.randn(6), "empty": torch.zeros(0), "b": torch.randn(2)}
    opt = make(mask)
    updates, state = opt.update(grads, opt.init(params), params)
    assert updates["empty"].shape == (0,)
    dense = make({"w": True, "b": False})
    p2, g2 = {"w": params["w"], "b": params["b"]}, {"w": grads["w"], "b": grads["b"]}
    expected, _ = dense.update(g2, dense.init(p2), p2)
    assert torch.equal(updates["w"], expected["w"]) and torch.equal(updates["b"], expected["b"])
    frozen = fp.optim.masked(make(mask), {"w": False, "empty": False, "b": False})
    updates, state = frozen.update(grads, frozen.init(params), params)
    assert updates == {"w": None, "empty": None, "b": None}
    updates, state = frozen.update(grads, state, params)  # and again from the state it returned


# ------------------------------------------------------------------------------------------ purity


def _identity():
    return fp.optim.GradientTransformation(lambda p: (), lambda g, s, p=None, **extra: (g, s))


@pytest.mark.parametrize("make", [
    lambda m: fp.optim.adamw(1e-2, weight_decay=0.1, mask=m),
    lambda m: fp.optim.adamw(1e-2, weight_decay=0.1),
    lambda m: fp.optim.lion(1e-2, weight_decay=0.1, mask=m),
    lambda m: fp.optim.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
    lambda m: fp.optim.sgd(1e-2, momentum=0.9, weight_decay=0.1, mask=m),
    lambda m: fp.optim.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, mask=m),
    lambda m: fp.optim.sgd(1e-2, weight_decay=0.1, mask=m),
    lambda m: fp.optim.sgd(1e-2),
    lambda m: fp.optim.chain(_identity(), fp.optim.add_decayed_weights(0.1), fp.optim.scale(-1e-2)),
    lambda m: fp.optim.chain(fp.optim.clip_by_global_norm(0.1), fp.optim.masked(fp.optim.sgd(1e-2), m)),
    lambda m: fp.optim.masked(fp.optim.sgd(1e-2), m),
])
def test_callers_grads_params_and_state_are_not_written(make):
    params = _params(10)
    opt = make(fp.optim.decay_mask(params))
    state = opt.init(params)
    for k in range(3):
        grads = _grads(params, k)
        before = optree.tree_map(torch.clone, (grads, params, state))
        updates, new_state = opt.update(grads, state, params)
        after = (grads, params, state)
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(before), optree.tree_leaves(after), strict=True))
        assert optree.tree_structure(new_state) == optree.tree_structure(state)
        params, state = fp.optim.apply_updates(params, updates), new_state


def test_inplace_reaches_only_stages_that_declare_it():
    """``inplace`` is one typed argument, given to the stages that declare ``fresh`` and never to a stage written
    without the protocol, whose inputs stay intact; the declared stages then work in place, so the caller's own
    gradient tensors hold the update. A plain pair gets neither ``inplace`` nor the keyword values."""
    seen = []

    def plain(grads, state, params=None, **extra):  # no ``fresh``: must never see ``inplace``
        seen.append(sorted(extra))
        return {k: v * 1.0 for k, v in grads.items()}, state

    own = fp.optim.InPlace(updates=True, state=True)  # the gradients and the state, not the params
    stage = fp.optim.InPlaceTransformation(lambda p: (), plain)
    opt = fp.optim.chain(fp.optim.clip_by_global_norm(1e9), stage, fp.optim.scale(-0.5))
    assert opt.fresh is not None and opt.fresh(False) and fp.optim.fused_of(opt) is None
    params = _params(5)
    grads = _grads(params, 0)
    mine = optree.tree_map(torch.clone, grads)
    updates, _ = fp.optim.update_with(opt, mine, opt.init(params), params, inplace=own, global_norm=torch.tensor(1.0))
    assert seen == [["global_norm"]]  # an InPlaceTransformation without ``fresh``: the keyword values, no inplace
    assert all(torch.equal(mine[k], grads[k]) for k in grads)  # the plain stage made new tensors: nothing written
    assert all(torch.equal(updates[k], -0.5 * grads[k]) for k in grads)
    fp.optim.chain(fp.optim.GradientTransformation(lambda p: (), plain), fp.optim.scale(1.0)).update(
        grads, ((), fp.optim.ScaleState()), params, inplace=own, global_norm=torch.tensor(1.0))
    assert seen[-1] == []  # a plain pair: (grads, state, params) only
    adam = fp.optim.adamw(1e-2)
    mine = optree.tree_map(torch.clone, grads)
    state = adam.init(params)
    mu = optree.tree_leaves(state)[1]
    updates, _ = fp.optim.update_with(adam, mine, state, params, inplace=own)
    assert updates["w"] is mine["w"] and mu.abs().sum() > 0  # the gradients and the moments, in place
    fp.optim.update_with(fp.optim.InPlaceTransformation(lambda p: (), plain, fresh=lambda f: f), grads, (),
                         inplace=fp.optim.EVERYTHING)
    assert seen[-1] == ["inplace"]  # declared: given it


# ------------------------------------------------------------------------------------------ schedule


def test_schedule_is_reported_and_used_from_step_zero():
    sched = fp.optim.warmup_cosine(1e-2, warmup=3, total=10, end=1e-4)
    for opt in (fp.optim.adamw(sched, weight_decay=0.1), fp.optim.lion(sched), fp.optim.sgd(sched, momentum=0.9),
                fp.optim.chain(fp.optim.clip_by_global_norm(1.0), fp.optim.adamw(sched)),
                fp.optim.masked(fp.optim.adamw(sched), {"w": True})):
        assert [fp.optim.schedule_of(opt)(k) for k in range(12)] == [sched(k) for k in range(12)]
    assert fp.optim.schedule_of(fp.optim.sgd(0.25))(7) == 0.25
    assert fp.optim.schedule_of(fp.optim.clip_by_global_norm(1.0)) is None
    assert fp.optim.schedule_of(fp.optim.GradientTransformation(lambda p: (), lambda g, s, p=None: (g, s))) is None
    seen = []
    opt = fp.optim.scale_by_learning_rate(lambda k: seen.append(k) or 2.0)
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    for _ in range(3):
        updates, state = opt.update({"w": torch.ones(3)}, state, params)
    assert seen == [0, 1, 2] and torch.equal(updates["w"], torch.full((3,), -2.0))


# ------------------------------------------------------------------------------------------ the norms


def test_the_steps_sum_of_squares_is_float64_accurate_on_host_with_its_fallbacks():
    """The step's kernel (funcpar.train.norms), host float32: row norms summed in float64, within a float32 rounding
    (2.4e-7 relative) of the float64 sum, and 1e-8 for millions of elements (each row's rounding averages out; a plain
    float32 norm is off by ~1e-4 there), whatever the length's remainder or stride; past float32's range (inf), below
    it (0) and NaN the float64 path answers."""
    from funcpar.train.norms import sums_of_squares

    def one(x):
        return sums_of_squares([x])[0]

    g = torch.Generator().manual_seed(0)
    for n in (1, 127, 128, 1000, 3 << 20):
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
        exact = (x.double() ** 2).sum()
        got = one(x)
        assert got.dtype == torch.float64 and abs(got - exact) <= (1e-8 if n > 1 << 20 else 2.4e-7) * exact, n
    assert abs((torch.linalg.vector_norm(x) ** 2).double() - exact) > 1e-6 * exact  # float32 alone is not enough
    strided = x[: 1 << 20 : 3]  # (a 1-D view with a stride: its rows are strided views too)
    assert abs(one(strided) - (strided.double() ** 2).sum()) <= 2.4e-7 * (strided.double() ** 2).sum()
    for x in (torch.full((300,), 1e20), torch.full((300,), 1e-25)):  # float32 squares: inf, 0
        assert one(x).item() == pytest.approx((x.double() ** 2).sum().item(), rel=1e-12)
    assert one(torch.zeros(0)).item() == 0 and one(torch.zeros(500)).item() == 0
    assert one(torch.tensor([1.0, float("nan")] * 200)).isnan()
    assert one(torch.tensor([1.0, float("inf")] * 200)).isinf()


def test_sums_of_squares_batches_many_tensors_with_one_copy_to_the_host(monkeypatch):
    """The step's norm: every bucket's float64 sum of squares, equal to each tensor's own, in one tensor on the host
    after one device-to-host copy for the row path and one for the exact path (on a GPU one sync each: float64 chunks
    of a million elements launched ~1,700 kernels for a 0.87B model's gradients); bf16 takes the row path too, the
    out-of-range and subnormal sums the exact one, NaN stays NaN without it, empty tensors count zero."""
    from funcpar.train.norms import sums_of_squares

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, generator=g) for n in (1000, 129, 1 << 16)]
    xs += [torch.randn(300, generator=g).bfloat16(), torch.zeros(0), torch.full((300,), 1e20),
           torch.full((1024,), 1e-21), torch.tensor([1.0, float("nan")] * 100), torch.randn(50).double()]
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies.append(tuple(t.shape)) or real_cpu(t, *a, **k))
    got = sums_of_squares(xs)
    monkeypatch.setattr(torch.Tensor, "cpu", real_cpu)
    # the seven float ones (row path) at once; then the 1e20 (inf), the 1e-21 (subnormal) and the float64 one
    assert copies == [(7,), (3,)]
    assert got.dtype == torch.float64 and got.device.type == "cpu" and got.shape == (9,)
    for x, s in zip(xs, got, strict=True):
        exact = (x.double() ** 2).sum()
        if exact.isnan():
            assert s.isnan()
            continue
        assert abs(s - exact) <= 2.4e-7 * exact, (x[:2], s, exact)
        assert s == sums_of_squares([x])[0]
    assert sums_of_squares([]).shape == (0,)


def test_a_bare_optimizers_norm_is_plain_float64_and_stays_on_its_device():
    """Clipping without a ``global_norm`` passed (a bare optimizer): optim's own plain kernel, float64 chunks, exact
    to float64 rounding on the host; on a non-host device on that device, nothing copied to the host (checked on the
    meta device, which refuses every copy to the host)."""
    from funcpar.optim.transforms import global_norm, sum_of_squares

    g = torch.Generator().manual_seed(2)
    for x in (torch.randn(3 << 20, generator=g), torch.randn(1000, generator=g).bfloat16(), torch.full((300,), 1e20),
              torch.full((300,), 1e-25), torch.randn(7, generator=g)[::2]):
        got = sum_of_squares(x)
        assert got.dtype == torch.float64 and got.item() == pytest.approx((x.double() ** 2).sum().item(), rel=1e-12)
    assert sum_of_squares(torch.zeros(0)).item() == 0
    assert sum_of_squares(torch.tensor([1.0, float("nan")] * 200)).isnan()
    x = torch.empty(3 << 20, device="meta")
    assert sum_of_squares(x).device.type == "meta" and sum_of_squares(x).dtype == torch.float64
    assert global_norm({"a": x, "b": torch.empty(7, device="meta")}).device.type == "meta"


# ------------------------------------------------------------------------------------------ the pair and its subclass


def _heavy_ball(lr, beta):
    """An optax-style pair of one's own: ``update(updates, state, params=None)``, no keyword values, no ``inplace``."""

    def init(params):
        return optree.tree_map(torch.zeros_like, params)

    def update(updates, state, params=None):
        m = optree.tree_map(lambda m, g: beta * m + g, state, updates)
        return optree.tree_map(lambda m: -lr * m, m), m

    return fp.optim.GradientTransformation(init, update)


def test_the_pair_is_optaxs_and_what_the_step_uses_is_a_subclass():
    pair, GT, IPT = _heavy_ball(0.1, 0.9), fp.optim.GradientTransformation, fp.optim.InPlaceTransformation
    assert GT._fields == ("init", "update") and len(pair) == 2 and type(pair) is GT
    adam = fp.optim.adamw(1e-2)
    init, update = adam  # ours are still the pair, a subclass of it
    assert isinstance(adam, IPT) and isinstance(adam, GT) and init is adam.init and len(adam) == 2
    assert fp.optim.schedule_of(pair) is None and fp.optim.fused_of(pair) is None
    assert fp.optim.schedule_of(adam)(0) == 1e-2 and fp.optim.fused_of(adam) is adam.fused
    # compositions: the subclass where a part is one, the plain pair otherwise; wrappers that read the step's values
    # (the norm, finiteness) always
    assert type(fp.optim.chain(pair, pair)) is GT and type(fp.optim.masked(pair, {"w": True})) is GT
    assert type(fp.optim.chain(pair, fp.optim.scale(2.0))) is IPT and type(fp.optim.masked(adam, {"w": True})) is IPT
    assert type(fp.optim.apply_if_finite(pair)) is IPT and type(fp.optim.clip_by_global_norm(1.0)) is IPT
    # immutable as the pair; _replace keeps the fields it is not given
    with pytest.raises(AttributeError, match="immutable"):
        adam.fused = None
    bare = adam._replace(fused=None)
    assert type(bare) is IPT and fp.optim.fused_of(bare) is None and bare.schedule is adam.schedule
    assert bare.fresh is adam.fresh and bare.update is adam.update
    with pytest.raises(ValueError, match="no field"):
        adam._replace(momentum=0.9)
    # a plain pair is called as optax calls one: (grads, state, params), whatever the caller passes besides
    params = _params(12)
    grads = _grads(params, 0)
    for opt in (pair, fp.optim.chain(fp.optim.clip_by_global_norm(1e9), pair), fp.optim.apply_if_finite(pair)):
        updates, _ = fp.optim.update_with(opt, grads, opt.init(params), params, inplace=fp.optim.EVERYTHING,
                                          global_norm=torch.tensor(1.0), finite=True)
        assert all(torch.equal(updates[k], -0.1 * grads[k]) for k in params)


def test_absent_and_written_each_mean_one_thing():
    """``ABSENT`` (``None``): no leaf here, so no update (a frozen leaf; every leaf of a skipped step). ``WRITTEN``:
    the updates ``update_with`` already wrote into the params (a fused kernel under ``EVERYTHING``); where no kernel
    may write them (none, or a wrapper that must see the updates), the updates themselves."""
    ABSENT, WRITTEN = fp.optim.ABSENT, fp.optim.WRITTEN
    assert ABSENT is None and repr(WRITTEN) == "WRITTEN"
    params = _params(11)
    grads = _grads(params, 0)
    frozen = fp.optim.masked(fp.optim.sgd(0.1), {"w": True, "b": False, "t": True})
    updates, _ = frozen.update(grads, frozen.init(params), params)
    assert updates["b"] is ABSENT and fp.optim.apply_updates(params, updates)["b"] is params["b"]
    skipping = fp.optim.apply_if_finite(fp.optim.sgd(0.1))
    updates, _ = skipping.update(grads, skipping.init(params), params, finite=False)
    assert updates == {k: ABSENT for k in params}
    assert all(fp.optim.apply_updates(params, updates)[k] is params[k] for k in params)

    adam = fp.optim.adamw(1e-2, weight_decay=0.1)
    expected = fp.optim.apply_updates(params, adam.update(grads, adam.init(params), params)[0])
    mine = optree.tree_map(torch.clone, params)
    updates, _ = fp.optim.update_with(adam, optree.tree_map(torch.clone, grads), adam.init(mine), mine,
                                      inplace=fp.optim.EVERYTHING)
    assert updates is WRITTEN and fp.optim.apply_updates(mine, WRITTEN) is mine
    _assert_close(mine, expected)
    everything = {"w": True, "b": True, "t": True}
    for opt, same in ((fp.optim.apply_if_finite(adam), True), (fp.optim.masked(adam, everything), True),
                      (fp.optim.lion(1e-2), False)):
        mine = optree.tree_map(torch.clone, params)
        updates, _ = fp.optim.update_with(opt, optree.tree_map(torch.clone, grads), opt.init(mine), mine,
                                          inplace=fp.optim.EVERYTHING, finite=True)
        assert updates is not WRITTEN and all(torch.equal(mine[k], params[k]) for k in params)  # params untouched
        if same:  # adamw's update, wrapped
            _assert_close(fp.optim.apply_updates(params, updates), expected)


def test_a_plain_pair_trains_in_compile_step_as_by_hand():
    """An optax-style pair of one's own in the train step (its generic, out-of-place path): the parameters after
    each step are the ones its update gives by hand, from torch.func's gradient of the same loss. Float32,
    ``Mesh()``."""

    def loss(p, b):
        return ((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2).mean()

    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(5, 2, generator=g), "b": torch.zeros(2)}
    batches = [{"x": torch.randn(8, 5, generator=g), "y": torch.randn(8, 2, generator=g)} for _ in range(4)]
    pair = _heavy_ball(0.05, 0.9)
    step = fp.compile_step(loss, {"w": fp.P(), "b": fp.P()}, mesh=fp.Mesh(), optimizer=pair, compile=False)
    state = step.init(optree.tree_map(torch.clone, params))
    ref, ref_state = params, pair.init(params)
    for b in batches:
        state, metrics = step(state, b)
        updates, ref_state = pair.update(torch.func.grad(loss)(ref, b), ref_state, ref)
        ref = fp.optim.apply_updates(ref, updates)
        assert metrics["lr"] != metrics["lr"]  # the pair reports no schedule: NaN
        _assert_close(dict(state.params), ref, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(ref["w"], params["w"])
