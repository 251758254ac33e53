"""shard/gather round trips on real meshes: random shapes and specs (hypothesis) on Mesh(tp=2, dp=2) and
Mesh(tp=4, dp=2); local shapes as spec.py predicts; gather onto one rank moves only distinct blocks."""

import pytest
import torch

pytest.importorskip("hypothesis")  # (in the test extra)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import funcpar as fp
import harness
from funcpar import P

MESHES = {4: {"tp": 2, "dp": 2}, 8: {"tp": 4, "dp": 2}}
ENTRIES = [None, "tp", "dp", ("dp", "tp"), ("tp", "dp"), "pp", ("pp", "tp")]


@st.composite
def cases(draw, sizes):
    ndim = draw(st.integers(1, 3))
    entries, used = [], set()
    for _ in range(draw(st.integers(0, ndim))):
        e = draw(st.sampled_from(ENTRIES))
        axes = () if e is None else ((e,) if isinstance(e, str) else e)
        if used & set(axes):
            e, axes = None, ()
        used |= set(axes)
        entries.append(e)
    shape = []
    for i in range(ndim):
        e = entries[i] if i < len(entries) else None
        axes = () if e is None else ((e,) if isinstance(e, str) else e)
        parts = 1
        for a in axes:
            parts *= sizes.get(a, 1)
        shape.append(parts * draw(st.integers(1, 3)))
    dst = draw(st.integers(0, 2 * sizes["tp"] * sizes["dp"] - 1)) % (sizes["tp"] * sizes["dp"])
    return tuple(shape), entries, dst, draw(st.integers(0, 2**31 - 1))


def _roundtrip(sizes, shape, entries, dst, seed):
    m = harness.mesh(**sizes)
    spec = P(*entries)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    tree = {"a": [x, x[..., :1].clone()], "b": x.double()}
    specs = {"a": [spec, P()], "b": spec}
    local = fp.shard(tree, specs, m)
    full = fp.gather(local, specs, m)
    on_dst = fp.gather(local, specs, m, dst=dst)
    return {
        "coords": m.coords,
        "local_shape": tuple(local["a"][0].shape),
        "predicted": fp.local_shape(spec, shape, m),
        "block": local["a"][0],
        "ok_all": all(torch.equal(a, b) for a, b in ((full["a"][0], x), (full["a"][1], tree["a"][1]), (full["b"], tree["b"]))),
        "dtype": full["b"].dtype,
        "on_dst": None if on_dst is None else all(torch.equal(a, b) for a, b in ((on_dst["a"][0], x), (on_dst["b"], tree["b"]))),
    }


def expected_block(x, entries, sizes, coords):
    """Rank block computed independently of funcpar.spec: nested chunking, major axis first."""
    for dim, e in enumerate(entries):
        for a in (() if e is None else ((e,) if isinstance(e, str) else e)):
            x = x.chunk(sizes.get(a, 1), dim)[coords[a]]
    return x


@pytest.mark.parametrize("world", [4, 8])
def test_gather_of_shard_is_identity(world):
    sizes = MESHES[world]

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases(sizes))
    def check(case):
        shape, entries, dst, seed = case
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        for rank, res in enumerate(harness.run(world, _roundtrip, sizes, shape, entries, dst, seed)):
            assert res["ok_all"], (shape, entries)
            assert res["dtype"] == torch.float64
            assert res["local_shape"] == res["predicted"]
            assert torch.equal(res["block"], expected_block(x, entries, sizes, res["coords"])), (shape, entries, rank)
            assert res["on_dst"] is (None if rank != dst else True), (rank, dst, res["on_dst"])

    check()


def _gather_traffic(sizes):
    """gather(dst=0) of a leaf replicated over dp: only the dp=0 ranks may send."""
    import torch.distributed as dist

    m = harness.mesh(**sizes)
    sent = []
    orig = dist.batch_isend_irecv

    def spy(ops):
        sent.extend(op.peer for op in ops if op.op is dist.isend)
        return orig(ops)

    dist.batch_isend_irecv = spy
    try:
        w = fp.shard({"w": torch.arange(32.0).reshape(4, 8)}, {"w": P(None, "tp")}, m)
        out = fp.gather(w, {"w": P(None, "tp")}, m, dst=0)
    finally:
        dist.batch_isend_irecv = orig
    return m.coords, sent, None if out is None else out["w"]


def test_gather_to_one_rank_sends_each_block_once():
    for coords, sent, out in harness.run(8, _gather_traffic, MESHES[8]):
        if coords == {"pp": 0, "dp": 0, "tp": 0}:
            assert torch.equal(out, torch.arange(32.0).reshape(4, 8)) and sent == []
        elif coords["dp"] == 0:
            assert sent == [0] and out is None
        else:
            assert sent == [] and out is None


def _bad_gather(sizes):
    m = harness.mesh(**sizes)
    errs = []
    for bad in (
        lambda: fp.gather({"w": torch.zeros(2, 3)}, {"w": P(None, None, "tp")}, m),
        lambda: fp.gather({"w": torch.zeros(2, 3)}, {"w": P()}, m, dst=9),
    ):
        try:
            bad()
        except ValueError as e:
            errs.append(str(e))
    return errs


def test_gather_errors():
    for errs in harness.run(4, _bad_gather, MESHES[4]):
        assert "leaf 'w' with shape (2, 3) has rank 2, but its spec P(None, None, 'tp') has 3 entries" in errs[0]
        assert "dst=9 is not a rank of Mesh(pp=1, dp=2, tp=2)" in errs[1]
