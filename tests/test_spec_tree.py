"""Single-process tests: P, spec validation and its errors, spec-tree matching, tree helpers, Mesh()."""

from collections import namedtuple

import optree
import pytest
import torch

import funcpar as fp
from funcpar import P, SpecError
from funcpar.spec import broadcast_specs, validate


class FakeMesh(fp.Mesh):
    """Sizes and coordinates of a mesh without processes: spec arithmetic needs nothing else."""

    def __init__(self, coords=None, **sizes):
        super().__init__()
        self._sizes = {"pp": sizes.get("pp", 1), "dp": sizes.get("dp", 1), "tp": sizes.get("tp", 1)}
        self.size = self._sizes["pp"] * self._sizes["dp"] * self._sizes["tp"]
        self._coords = dict(coords or {"pp": 0, "dp": 0, "tp": 0})


def test_p_is_an_opaque_hashable_leaf():
    s = P(None, "tp", ("dp", "tp"))
    assert optree.tree_leaves({"a": s}) == [s]
    assert s == P(None, "tp", ("dp", "tp")) and hash(s) == hash(P(None, "tp", ("dp", "tp")))
    assert s != P(None, "tp")
    assert s.axes_of(0) == () and s.axes_of(1) == ("tp",) and s.axes_of(2) == ("dp", "tp") and s.axes_of(9) == ()
    assert P(("tp",)) == P("tp") and P(()) == P(None)
    assert repr(P(None, "tp")) == "P(None, 'tp')"
    with pytest.raises(AttributeError):
        s._dims = ()
    with pytest.raises(SpecError, match="each entry"):
        P(3)


def test_local_shape_and_slice():
    m = FakeMesh(tp=4, dp=2, coords={"pp": 0, "dp": 1, "tp": 2})
    assert fp.local_shape(P(None, "tp"), (6, 8), m) == (6, 2)
    assert fp.local_shape(P(("dp", "tp")), (16, 3), m) == (2, 3)
    assert fp.local_shape(P(), (5, 7), m) == (5, 7)
    # dp major, tp minor: block 1*4 + 2 = 6 of 8
    assert fp.local_slice(P(("dp", "tp")), (16, 3), m) == (slice(12, 14), slice(0, 3))
    assert fp.local_slice(P(("tp", "dp")), (16, 3), m) == (slice(10, 12), slice(0, 3))
    assert fp.local_slice(P("dp", "tp"), (4, 8), m) == (slice(2, 4), slice(4, 6))


@pytest.mark.parametrize(
    "spec, shape, pattern",
    [
        (P("tq"), (8,), r"leaf 'w' with shape \(8,\): spec P\('tq'\) names axis 'tq', which is not a mesh axis \(the mesh has pp, dp, tp\)"),
        (P("tp", "tp"), (8, 8), r"leaf 'w' with shape \(8, 8\): spec P\('tp', 'tp'\) uses axis 'tp' twice \(dimensions 0 and 1\)"),
        (P(("dp", "dp")), (8,), r"uses axis 'dp' twice"),
        (P(None, None, "tp"), (8, 8), r"leaf 'w' with shape \(8, 8\) has rank 2, but its spec P\(None, None, 'tp'\) has 3 entries"),
        (P(None, "tp"), (8, 6), r"leaf 'w' with shape \(8, 6\): dimension 1 \(size 6\) is not divisible by axis tp=4 of Mesh\(pp=1, dp=2, tp=4\)"),
        (P(("dp", "tp")), (12,), r"dimension 0 \(size 12\) is not divisible by axes dp=2 x tp=4 .* multiple of 8"),
    ],
)
def test_bad_specs_name_leaf_shape_axis_and_size(spec, shape, pattern):
    m = FakeMesh(tp=4, dp=2)
    with pytest.raises(SpecError, match=pattern):
        validate(spec, shape, m, path="w")


def test_spec_prefix_replicates_subtree_and_none_means_replicated():
    params = {"emb": torch.zeros(8, 4), "layers": [{"w": torch.zeros(4, 8), "b": torch.zeros(8)}] * 2, "n": None}
    specs = {"emb": P("tp"), "layers": P(), "n": None}
    got = [(p, s) for p, s, _ in broadcast_specs(specs, params)]
    assert got == [("emb", P("tp")), ("layers.0.b", P()), ("layers.0.w", P()), ("layers.1.b", P()), ("layers.1.w", P())]
    assert [p for p, _, _ in broadcast_specs(None, params)] == [p for p, _ in fp.tree.leaves_with_path(params)]


@pytest.mark.parametrize(
    "specs, pattern",
    [
        ({"emb": P("tp")}, r"specs do not match params at '<root>': missing in specs: layers"),
        ({"emb": P("tp"), "layers": P(), "extra": P()}, r"at '<root>': not in params: extra"),
        ({"emb": P("tp"), "layers": [P(), P(), P()]}, r"at 'layers': params has a list of length 2, specs has a list of length 3"),
        ({"emb": {"w": P()}, "layers": P()}, r"at 'emb': params has a leaf Tensor\(8, 4\) there, specs has a dict"),
        ({"emb": P("tp"), "layers": [{"w": P(), "b": "tp"}, P()]}, r"at 'layers.0.b': specs has 'tp', which is not a P"),
        ({"emb": P("tp"), "layers": ({"w": P(), "b": P()}, P())}, r"at 'layers': params has a list of length 2, specs has a tuple"),
    ],
)
def test_specs_tree_mismatch_names_the_path(specs, pattern):
    params = {"emb": torch.zeros(8, 4), "layers": [{"w": torch.zeros(4, 8), "b": torch.zeros(8)}] * 2}
    with pytest.raises(SpecError, match=pattern):
        broadcast_specs(specs, params)


def test_shard_names_the_leaf_of_a_bad_spec():
    m = FakeMesh(tp=4)
    params = {"layers": [{"w": torch.zeros(4, 6)}]}
    with pytest.raises(SpecError, match=r"leaf 'layers.0.w' with shape \(4, 6\): dimension 1 \(size 6\) is not divisible by axis tp=4"):
        fp.shard(params, {"layers": [{"w": P(None, "tp")}]}, m)


def test_tree_helpers():
    Pair = namedtuple("Pair", "a b")
    t = {"x": Pair(torch.ones(2), torch.zeros(3)), "layers": [torch.ones(1), torch.ones(4)]}
    assert [p for p, _ in fp.tree.leaves_with_path(t)] == ["layers.0", "layers.1", "x.a", "x.b"]
    shapes = fp.tree.map_with_path(lambda p, x: f"{p}:{x.numel()}", t)
    assert shapes["x"].b == "x.b:3" and shapes["layers"][1] == "layers.1:4"
    sel, rest = fp.tree.partition(t, lambda p, x: p.startswith("layers"))
    assert sel["x"].a is None and rest["layers"][0] is None and sel["layers"][1] is t["layers"][1]
    back = fp.tree.combine(sel, rest)
    assert all(a is b for a, b in zip(optree.tree_leaves(back), optree.tree_leaves(t), strict=True))
    assert fp.tree.filter(t, lambda p, x: x.numel() > 2)["x"].b is t["x"].b
    assert fp.tree.path_str(()) == "<root>"


def test_single_process_mesh_needs_no_distributed():
    import torch.distributed as dist

    m = fp.Mesh()
    assert not dist.is_initialized()
    assert (m.size, m.rank, m.coords, m.shape) == (1, 0, {"pp": 0, "dp": 0, "tp": 0}, {"pp": 1, "dp": 1, "tp": 1})
    x = torch.randn(4, 6)
    for f in (fp.collectives.copy_to_region, fp.collectives.reduce_from_region):
        assert f(x, m, "tp") is x
    assert fp.collectives.all_gather(x, m, "tp", 1) is x
    assert torch.equal(fp.gather(fp.shard({"w": x}, {"w": P("tp", "dp")}, m), {"w": P("tp", "dp")}, m)["w"], x)


def test_mesh_errors_in_a_plain_process():
    with pytest.raises(fp.MeshError, match=r"needs 4 processes.*torchrun --nproc-per-node 4"):
        fp.Mesh(tp=2, dp=2)
    with pytest.raises(fp.MeshError, match="axis 'tp' must be a positive int"):
        fp.Mesh(tp=0)
    with pytest.raises(fp.MeshError, match="unknown mesh axis 'sp'"):
        fp.Mesh().axis_size("sp")


def test_shard_places_blocks_on_the_mesh_device():
    # a CPU initialisation sharded for an accelerator mesh lands on the accelerator (here: the meta device)
    m = fp.Mesh(device="meta")
    x = torch.randn(4, 6)
    out = fp.shard({"w": x}, {"w": P()}, m)["w"]
    assert out.device.type == "meta" and out.shape == (4, 6)
    same = fp.shard({"w": x}, {"w": P()}, fp.Mesh())["w"]
    assert same.device.type == "cpu" and torch.equal(same, x) and same.data_ptr() != x.data_ptr()
