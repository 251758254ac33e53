"""Every differentiable collective: forward value and gradient under torch.func.grad, .backward() and vmap, on real
gloo groups, against an unsharded reference computed here in one process (float32, <= 1e-6 relative).

Objective convention (funcpar.parallel.collectives): the sum over ranks of partial values, replicated values counted once.
Each case below builds global tensors from a seed; rank r of an axis of size n sees its share of them.
"""

import pytest
import torch

import harness
from funcpar.parallel import collectives as C
from funcpar.parallel import p2p as P2P
from funcpar.parallel import transport as T

NAMES = ["copy_to_region", "reduce_from_region", "reduce_from_region_", "all_gather", "reduce_scatter", "scatter_to_region", "gather_from_region"]
# (mesh sizes, axis, world): tp=2 and tp=4 on their own, and both axes of Mesh(tp=4, dp=2)
MESHES = [({"tp": 2}, "tp", 2), ({"tp": 4}, "tp", 4), ({"tp": 4, "dp": 2}, "tp", 8), ({"tp": 4, "dp": 2}, "dp", 8)]


def problem(n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    shape = [3, 5]
    shape[dim] = 2 * n
    return {
        "X": torch.randn(*shape, generator=g),  # a replicated/global input
        "Ps": torch.randn(n, *shape, generator=g),  # partial inputs, one per rank
        "Cs": torch.randn(n, *shape, generator=g),  # rank-specific coefficients of partial objectives
        "CC": torch.randn(*shape, generator=g),  # replicated coefficients
    }


def chunk(t, n, r, dim):
    return t.chunk(n, dim)[r]


def local_case(name, pr, n, r, dim, coll):
    """(local input, local objective) for rank r: what a sharded program computes."""
    X, Ps, Cs, CC = pr["X"], pr["Ps"], pr["Cs"], pr["CC"]
    if name == "copy_to_region":
        return X, lambda x: (Cs[r] * coll(x).sin()).sum()
    if name in ("reduce_from_region", "reduce_from_region_"):
        return Ps[r], lambda p: (CC * coll(p).sin()).sum()
    if name == "all_gather":
        return chunk(X, n, r, dim), lambda x: (Cs[r] * coll(x).sin()).sum()
    if name == "reduce_scatter":
        return Ps[r], lambda p: (chunk(CC, n, r, dim) * coll(p).sin()).sum()
    if name == "scatter_to_region":
        return X, lambda x: (chunk(CC, n, r, dim) * coll(x).sin()).sum()
    if name == "gather_from_region":
        return chunk(X, n, r, dim), lambda x: (CC * coll(x).sin()).sum()
    raise AssertionError(name)


def reference(name, pr, n, r, dim):
    """(forward value, gradient) rank r must see, from the global objective computed in this one process."""
    X, Ps, Cs, CC = pr["X"], pr["Ps"], pr["Cs"], pr["CC"]
    if name in ("copy_to_region", "all_gather", "gather_from_region", "scatter_to_region"):
        if name in ("copy_to_region", "all_gather"):
            objective = lambda x: sum((Cs[k] * x.sin()).sum() for k in range(n))  # noqa: E731
        else:
            objective = lambda x: (CC * x.sin()).sum()  # noqa: E731
        gX = torch.func.grad(objective)(X)
        fwd = chunk(X, n, r, dim) if name == "scatter_to_region" else X
        grad = gX if name in ("copy_to_region", "scatter_to_region") else chunk(gX, n, r, dim)
        return fwd, grad
    gP = torch.func.grad(lambda P: (CC * P.sum(0).sin()).sum())(Ps)
    total = Ps.sum(0)
    return (total if name.startswith("reduce_from_region") else chunk(total, n, r, dim)), gP[r]


def _run(name, sizes, axis, dim, seed):
    m = harness.mesh(**sizes)
    n, r = m.axis_size(axis), m.coord(axis)
    fn = getattr(C, name)
    coll = (lambda t: fn(t, m, axis)) if name in ("copy_to_region", "reduce_from_region") else (lambda t: fn(t, m, axis, dim))
    if name == "reduce_from_region_":  # sums its argument in place: give it a temporary (clone keeps the strides,
        coll = lambda t: fn(t.clone(), m, axis)  # noqa: E731  so in_dims=1 below takes its non-contiguous path)
    pr = problem(n, dim, seed)
    x, objective = local_case(name, pr, n, r, dim, coll)
    fwd = coll(x)
    grad_func = torch.func.grad(objective)(x)
    # classic autograd: the gradient must not be summed once per rank
    xb = x.clone().requires_grad_(True)
    objective(xb).backward()
    # vmap over a batch of two inputs equals two separate calls, values and gradients
    batch = torch.stack([x, 0.5 * x])
    vfwd = torch.func.vmap(coll)(batch)
    vgrad = torch.func.grad(lambda b: torch.func.vmap(objective)(b).sum())(batch)
    sep_fwd = torch.stack([coll(x), coll(0.5 * x)])
    sep_grad = torch.stack([torch.func.grad(objective)(x), torch.func.grad(objective)(0.5 * x)])
    # vmap with the batch dimension not in front
    vfwd1 = torch.func.vmap(coll, in_dims=1, out_dims=1)(batch.movedim(0, 1))
    return {"r": r, "n": n, "fwd": fwd, "grad": grad_func, "grad_bw": xb.grad, "vmap": (vfwd, vgrad, sep_fwd, sep_grad, vfwd1)}


def assert_rel(got, want, tol=1e-6, what=""):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-30)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


@pytest.mark.parametrize("sizes, axis, world", MESHES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", NAMES)
def test_collective_value_and_gradient_match_reference(name, sizes, axis, world):
    for dim, seed in ((0, 1), (1, 2)):
        results = harness.run(world, _run, name, sizes, axis, dim, seed)
        for res in results:
            n, r = res["n"], res["r"]
            fwd, grad = reference(name, problem(n, dim, seed), n, r, dim)
            where = f"{name} axis={axis} n={n} rank-coord={r} dim={dim}"
            assert_rel(res["fwd"], fwd, what=f"{where} forward")
            assert_rel(res["grad"], grad, what=f"{where} grad (torch.func.grad)")
            assert_rel(res["grad_bw"], grad, what=f"{where} grad (.backward)")
            vfwd, vgrad, sep_fwd, sep_grad, vfwd1 = res["vmap"]
            assert_rel(vfwd, sep_fwd, what=f"{where} vmap forward")
            assert_rel(vgrad, sep_grad, what=f"{where} vmap grad")
            assert_rel(vfwd1, sep_fwd.movedim(0, 1), what=f"{where} vmap in_dims=1")


def _second_order(sizes):
    m = harness.mesh(**sizes)
    r = m.coord("tp")
    x = torch.linspace(-1, 1, 6) + r  # partial per rank
    # objective: sum_r of (sum_k x_k)^3 pieces, through g then f; its Hessian-vector product needs conjugates of conjugates
    f = lambda x: (C.copy_to_region(C.reduce_from_region(x, m, "tp"), m, "tp") ** 3).sum() * (r + 1)  # noqa: E731
    hvp = torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(x)
    f_ = lambda x: (C.copy_to_region(C.reduce_from_region_(x.clone(), m, "tp"), m, "tp") ** 3).sum() * (r + 1)  # noqa: E731
    hvp_ = torch.func.grad(lambda x: torch.func.grad(f_)(x).sum())(x)
    # reduce_from_region_ on a tensor another op saved for its backward (exp saves its result): that backward raises
    saved = x.clone().requires_grad_(True).exp()
    C.reduce_from_region_(saved, m, "tp")
    try:
        saved.sum().backward()
        dirty = None
    except RuntimeError as e:
        dirty = str(e)
    return r, m.axis_size("tp"), hvp, hvp_, dirty


def test_second_order_gradients_through_collectives():
    for res in harness.run(4, _second_order, {"tp": 4}):
        r, n, hvp, hvp_, dirty = res
        assert dirty is not None and "modified by an inplace operation" in dirty, dirty
        X = torch.stack([torch.linspace(-1, 1, 6) + k for k in range(n)])
        # global objective: sum_k (k+1) * sum((sum_j X_j)^3)
        F = lambda X: sum((k + 1) * (X.sum(0) ** 3).sum() for k in range(n))  # noqa: E731
        want = torch.func.grad(lambda X: torch.func.grad(F)(X).sum())(X)[r]
        assert_rel(hvp, want, what="second order")
        assert_rel(hvp_, want, what="second order, reduce_from_region_")


def _stats(sizes):
    m = harness.mesh(**sizes)
    v = torch.tensor([float(m.rank), -float(m.rank), 1.0])
    out = {op: C.all_reduce(v, m, ("dp", "tp"), op) for op in ("sum", "max", "min", "avg")}
    out["tp_only"] = C.all_reduce(v, m, "tp")
    out["bcast"] = C.broadcast(v, m, "dp", src=1)
    out["untouched"] = v
    return m.rank, m.coords, out


def test_non_differentiable_reductions_and_broadcast():
    for rank, coords, out in harness.run(8, _stats, {"tp": 4, "dp": 2}):
        ranks = torch.arange(8.0)
        assert torch.equal(out["sum"], torch.tensor([ranks.sum(), -ranks.sum(), 8.0]))
        assert torch.equal(out["max"], torch.tensor([7.0, 0.0, 1.0]))
        assert torch.equal(out["min"], torch.tensor([0.0, -7.0, 1.0]))
        assert torch.allclose(out["avg"], torch.tensor([3.5, -3.5, 1.0]))
        tp_ranks = torch.arange(4.0) + 4 * coords["dp"]
        assert torch.equal(out["tp_only"], torch.tensor([tp_ranks.sum(), -tp_ranks.sum(), 4.0]))
        src = 4 + coords["tp"]  # dp coordinate 1 of this rank's dp group
        assert torch.equal(out["bcast"], torch.tensor([float(src), -float(src), 1.0]))
        assert torch.equal(out["untouched"], torch.tensor([float(rank), -float(rank), 1.0]))


def _p2p(sizes):
    m = harness.mesh(**sizes)
    s, n = m.coord("dp"), m.axis_size("dp")
    nxt, prv = (s + 1) % n, (s - 1) % n
    got = torch.empty(3)
    P2P.sendrecv(m, "dp", sends=[(torch.full((3,), float(m.rank)), nxt)], recvs=[(got, prv)])
    single = torch.empty(2)
    if s == 0:
        P2P.send(torch.tensor([1.0, 2.0]) * m.rank, m, "dp", dst=1)
    elif s == 1:
        P2P.recv(single, m, "dp", src=0)
    errs = []
    for bad in (lambda: P2P.send(got, m, "dp", dst=n), lambda: P2P.send(got, m, "dp", dst=s)):
        try:
            bad()
        except C.CollectiveError as e:
            errs.append(str(e))
    return m.rank, got, single if s == 1 else None, errs, m.group_ranks("dp")


def test_point_to_point_ring_along_an_axis():
    for rank, got, single, errs, dp_ranks in harness.run(8, _p2p, {"tp": 2, "dp": 4}):
        s = dp_ranks.index(rank)
        assert torch.equal(got, torch.full((3,), float(dp_ranks[(s - 1) % 4])))
        if single is not None:
            assert torch.equal(single, torch.tensor([1.0, 2.0]) * dp_ranks[0])
        assert "coordinate 4 is outside mesh axis 'dp' of size 4" in errs[0]
        assert "cannot exchange with itself along 'dp'" in errs[1]


def _rings(sizes, message_bytes=None):
    """reduce_scatter_nograd and all_gather_nograd over dp, on host tensors: funcpar's send/recv rings (their messages
    cut at ``message_bytes`` when given)."""
    m = harness.mesh(**sizes)
    n, s = m.axis_size("dp"), m.coord("dp")
    xs = torch.randn(n, 4 * n, 3, generator=torch.Generator().manual_seed(7))
    native = []
    saved = C._reduce_scatter_flat, C._all_gather_flat
    C._reduce_scatter_flat = C._all_gather_flat = lambda *a, **k: native.append(1)
    before = dict(m.traffic)
    cut = T.MESSAGE_BYTES
    try:
        T.MESSAGE_BYTES = message_bytes or cut
        part = C.reduce_scatter_nograd(xs[s], m, "dp", 0)
        whole = C.all_gather_nograd(part, m, "dp", 0)
        cols = C.all_gather_nograd(xs[s][:, :1].contiguous(), m, "dp", 1)  # a gather along dim 1
        sent = m.traffic["dp"] - before.get("dp", 0)
        # the same reduce-scatter from segments of a flat range, zeros between them (the step's gradient leaves), and
        # the all-gather in place (the input is this rank's block of the output)
        flat = xs[s].reshape(-1).clone()
        flat[17:20] = 0.0
        segs = [(0, flat[0:5].clone()), (5, flat[5:17].clone()), (20, flat[20:].clone())]
        seg_part = C.reduce_scatter_segments(segs, flat.numel(), m, "dp")
        flat_part = C.reduce_scatter_nograd(flat, m, "dp", 0)
        in_place = torch.full((4 * n, 3), float("nan"))
        in_place[4 * s : 4 * s + 4] = part
        C.all_gather_nograd(in_place[4 * s : 4 * s + 4], m, "dp", 0, out=in_place)
    finally:
        C._reduce_scatter_flat, C._all_gather_flat = saved
        T.MESSAGE_BYTES = cut
    return m.rank, xs, s, part, whole, cols, native, sent, (seg_part, flat_part, in_place)


@pytest.mark.parametrize("sizes", [{"dp": 2}, {"tp": 2, "dp": 4}])
def test_host_reduce_scatter_and_all_gather_rings(sizes):
    outs = harness.run(2 if len(sizes) == 1 else 8, _rings, sizes)
    # the same collectives with every tensor a ring sends cut into messages of 5 floats (the cut falls inside the
    # segments, and the 3-float columns go whole): bit for bit the same results, the same bytes counted
    cut = harness.run(2 if len(sizes) == 1 else 8, _rings, sizes, 20)
    for a, b in zip(outs, cut, strict=True):
        assert a[7] == b[7] and b[6] == []
        assert all(torch.equal(x, y) for x, y in zip([*a[3:6], *a[8]], [*b[3:6], *b[8]], strict=True))
    n = sizes["dp"]
    for rank, xs, s, part, whole, cols, native, sent, (seg_part, flat_part, in_place) in outs:
        assert torch.equal(seg_part, flat_part) and torch.equal(in_place, whole)
        mod = xs.reshape(n, -1).double()
        mod[:, 17:20] = 0.0  # the gap between the segments
        k = mod.shape[1] // n
        assert torch.allclose(seg_part.double(), mod.sum(0)[k * s : k * s + k], rtol=1e-6, atol=1e-6)
        total = xs.double().sum(0)
        assert part.shape == (4, 3) and native == []  # gloo's own reduce-scatter and all-gather were not called
        assert torch.allclose(part.double(), total[4 * s : 4 * s + 4], rtol=1e-6, atol=1e-6)
        if n == 2:  # two terms: the same sum in either order
            assert torch.equal(part, xs[0][4 * s : 4 * s + 4] + xs[1][4 * s : 4 * s + 4])
        assert torch.equal(whole[4 * s : 4 * s + 4], part)
        assert torch.equal(cols, torch.cat([x[:, :1] for x in xs], 1))
        nbytes = xs[0].numel() * 4 * 2 + cols.numel() * 4  # reduce-scatter in, all-gather out, the column gather
        assert abs(sent - nbytes * (n - 1) / n) < 1e-6, (sent, nbytes)
    wholes = [o[4] for o in outs]
    assert all(torch.equal(w, wholes[0]) for w in wholes)  # every rank: the same sum, bit for bit


def _bad_shape(sizes):
    m = harness.mesh(**sizes)
    try:
        C.reduce_scatter(torch.ones(3, 5), m, "tp", 0)
    except C.CollectiveError as e:
        return str(e)


def test_collective_shape_error_names_axis_and_size():
    for msg in harness.run(2, _bad_shape, {"tp": 2}):
        assert "dimension 0 of a tensor of shape (3, 5) (size 3) is not divisible by mesh axis 'tp' of size 2" in msg
