"""ZeRO's reduce-scatter overlapped with the backward (funcpar.overlap): same numbers as reducing after it, buckets
started from the backward's hooks on the worker thread over the lane group, in one order on every rank whatever
each rank's graph does, and a failure there raised by the step."""

import threading

import optree
import pytest
import torch

import funcpar as fp
import harness
from funcpar import P
from funcpar import collectives as C


def _init():
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (8, 8), "b": (8, 4), "c": (4,), "d": (4, 4), "aa": (3,)}
    return {k: torch.randn(s, generator=g) * 0.5 for k, s in shapes.items()}


def _specs(mesh):
    tp = "tp" in mesh.axis_names
    return {"a": P(None, "tp") if tp else P(), "b": P("tp", None) if tp else P(), "c": P(), "d": P(), "aa": P()}


def _local(params, mesh):
    out = dict(params)
    if "tp" in mesh.axis_names:
        n, i = mesh.axis_size("tp"), mesh.coord("tp")
        out["a"] = params["a"].chunk(n, 1)[i].contiguous()
        out["b"] = params["b"].chunk(n, 0)[i].contiguous()
    return out


def _loss(mesh):
    tp = "tp" if "tp" in mesh.axis_names else None

    def loss(p, batch):
        x = batch["x"].to(p["a"].dtype)  # (R, 8), in the compute dtype
        x = C.copy_to_region(x, mesh, tp) if tp else x
        h = torch.tanh(x @ p["a"])  # (R, 8/tp)
        y = h @ p["b"]  # (R, 4), partial over tp
        y = C.reduce_from_region(y, mesh, tp) if tp else y
        y = C.copy_to_region(torch.tanh(y + p["c"]) @ p["d"], mesh, "dp")  # its backward: an all-reduce over dp
        out = ((y.float() - batch["t"]) ** 2).mean()
        if mesh.coord("dp") == 0:  # leaf aa has a gradient on one data rank only
            out = out + (p["aa"] ** 2).sum()
        return out

    return loss


def _batches(mesh, steps=3):
    g = torch.Generator().manual_seed(1)
    full = [{"x": torch.randn(8, 8, generator=g), "t": torch.randn(8, 4, generator=g)} for _ in range(steps)]
    dp, i = mesh.axis_size("dp"), mesh.coord("dp")
    return [{k: v.chunk(dp)[i] for k, v in b.items()} for b in full]


def _train(sizes, zero, overlap, accum=1, param_dtype=None):
    from funcpar import layout, overlap as O

    mesh = harness.mesh(**sizes)
    step = fp.compile_step(_loss(mesh), _specs(mesh), mesh=mesh, optimizer=fp.optim.adamw(1e-2), zero=zero,
                           clip_norm=1.0, bucket_mb=1e-6, overlap=overlap, accum_steps=accum,
                           param_dtype=param_dtype)  # every leaf its own bucket
    seen, early = [], []
    reduce_leaves, finish = layout.ZeroLayout.reduce_leaves, O.BucketReducer.finish

    def spy_reduce(self, b, leaves, mesh=None):
        seen.append((threading.current_thread().name, isinstance(mesh, O._Lane), b.leaves))
        return reduce_leaves(self, b, leaves, mesh)

    def spy_finish(self, grads):
        early.append(self.next)  # buckets started from the backward's hooks
        return finish(self, grads)

    layout.ZeroLayout.reduce_leaves, O.BucketReducer.finish = spy_reduce, spy_finish
    try:
        state = step.init(_local(_init(), mesh))
        losses = []
        for batch in _batches(mesh):
            state, m = step(state, batch)
            losses.append(m["loss"])
    finally:
        layout.ZeroLayout.reduce_leaves, O.BucketReducer.finish = reduce_leaves, finish
    return losses, [t.clone() for t in optree.tree_leaves(state.params)], seen, early


@pytest.mark.parametrize("sizes,world,zero,accum", [({"dp": 2}, 2, 1, 1), ({"dp": 2}, 2, 2, 2),
                                                     ({"tp": 2, "dp": 2}, 4, 1, 1), ({"tp": 2, "dp": 2}, 4, 2, 1)])
def test_overlapped_reduction_is_bit_exact_and_starts_inside_the_backward(sizes, world, zero, accum):
    on = harness.run(world, _train, sizes, zero, True, accum)
    off = harness.run(world, _train, sizes, zero, False, accum)
    lanes = {(0,), (2,)}  # the buckets of the tp-sharded leaves a and b (leaves a, aa, b, c, d; one per bucket)
    for (l1, p1, seen, early), (l0, p0, seen0, early0) in zip(on, off):
        assert l1 == l0
        for a, b in zip(p1, p0):
            assert torch.equal(a, b)
        assert early0 == [] and all(name == threading.main_thread().name or not lane for name, lane, _ in seen0)
        # with overlap, buckets go to the worker thread, those reduced over dp alone on the lane group, and at
        # least one of them is started from the backward's hooks, before it ends
        assert len(early) == 3 * accum and all(k >= 1 for k in early), early  # per micro-batch of each step
        assert all(name.startswith("funcpar-reduce") for name, _, _ in seen), seen
        # the lane for the buckets reduced over dp alone (tp-sharded a, b), the mesh's groups for the others
        assert all(lane == (sizes == {"dp": 2} or leaves in lanes) for _, lane, leaves in seen), seen
    orders = [[leaves for _, _, leaves in seen] for _, _, seen, _ in on]
    assert all(o == orders[0] for o in orders)  # the same order on every rank, whatever its graph


def test_mixed_precision_reduces_after_the_backward_as_without_overlap():
    on = harness.run(2, _train, {"dp": 2}, 1, True, 1, torch.bfloat16)
    off = harness.run(2, _train, {"dp": 2}, 1, False, 1, torch.bfloat16)
    for (l1, p1, seen, early), (l0, p0, _, _) in zip(on, off):
        assert l1 == l0 and all(torch.equal(a, b) for a, b in zip(p1, p0))
        assert early == [] and seen and not any(lane for _, lane, _ in seen)  # bf16 gradients, fp32 buckets


def _failing_worker():
    from funcpar import layout

    mesh = harness.mesh(dp=2)
    step = fp.compile_step(_loss(mesh), _specs(mesh), mesh=mesh, optimizer=fp.optim.adamw(1e-2), bucket_mb=1e-6,
                           overlap=True)
    state = step.init(_local(_init(), mesh))
    reduce_leaves = layout.ZeroLayout.reduce_leaves

    def boom(self, b, leaves, mesh=None):
        raise RuntimeError(f"injected failure reducing bucket {b.leaves} on {threading.current_thread().name}")

    layout.ZeroLayout.reduce_leaves = boom
    try:
        step(state, _batches(mesh)[0])
    except RuntimeError as e:
        return str(e)
    finally:
        layout.ZeroLayout.reduce_leaves = reduce_leaves
    return None


def test_a_failure_on_the_worker_thread_is_raised_by_the_step():
    for msg in harness.run(2, _failing_worker):
        assert msg is not None and "injected failure reducing bucket" in msg and "on funcpar-reduce" in msg, msg


@pytest.mark.parametrize("options, reason", [
    (dict(zero=0), "zero=0"), (dict(zero=1, accum_steps=2), "accum_steps=2"), (dict(compile=True), "compile=True"),
    (dict(param_dtype=torch.bfloat16), "param_dtype"), (dict(zero=1), None), (dict(zero=2, accum_steps=2), None)])
def test_overlap_says_when_it_cannot_apply(options, reason):
    import warnings

    mesh = fp.Mesh()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fp.compile_step(_loss(mesh), _specs(mesh), mesh=mesh, overlap=True, **options)
    said = [str(w.message) for w in seen if "overlap=True" in str(w.message)]
    if reason is None:
        assert not said, said
    else:
        assert len(said) == 1 and reason in said[0] and "has no effect" in said[0], said
