"""Tensor-parallel layers written once per shard give, on every shard, the single-process gradients chunked the
same way (float32, <= 1e-6 relative), at tp = 2 and 4; and the tensor-parallel MLP example trains end to end."""

import os
import subprocess
import sys

import einops
import pytest
import torch
import torch.nn.functional as F

import funcpar as fp
import harness
from funcpar import P
from funcpar.parallel import collectives as C

D, H, HEADS, HEAD_DIM, B, T = 16, 32, 4, 8, 3, 5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlp_init(d, h, seed=0):
    """Global parameters of a 2-layer MLP d -> h -> d (the layer of examples/tp_mlp.py)."""
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(d, h, generator=g) / d**0.5, "b1": torch.zeros(h),
            "w2": torch.randn(h, d, generator=g) / h**0.5, "b2": torch.zeros(d)}


def mlp_specs():
    return {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None), "b2": P()}


def mlp_forward(params, x, mesh):
    """Column-parallel then row-parallel, with the f/g collectives between; x is replicated over tp."""
    x = C.copy_to_region(x, mesh, "tp")
    h = torch.nn.functional.gelu(x @ params["w1"] + params["b1"])  # (..., d) @ (d, h/tp) -> (..., h/tp)
    y = h @ params["w2"]  # (..., h/tp) @ (h/tp, d) -> (..., d), partial over tp
    return C.reduce_from_region(y, mesh, "tp") + params["b2"]


def attn_init(seed=0):
    g = torch.Generator().manual_seed(seed)
    hd = HEADS * HEAD_DIM
    return {
        "wq": torch.randn(D, hd, generator=g) / D**0.5,
        "wk": torch.randn(D, hd, generator=g) / D**0.5,
        "wv": torch.randn(D, hd, generator=g) / D**0.5,
        "bq": torch.randn(hd, generator=g) * 0.1,
        "wo": torch.randn(hd, D, generator=g) / hd**0.5,
        "bo": torch.randn(D, generator=g) * 0.1,
    }


def attn_specs():
    col = P(None, "tp")
    return {"wq": col, "wk": col, "wv": col, "bq": P("tp"), "wo": P("tp", None), "bo": P()}


def attn_forward(params, x, mesh):
    """Causal self-attention, heads split over tp; local heads are read from the local weight shapes."""
    x = C.copy_to_region(x, mesh, "tp")
    q = x @ params["wq"] + params["bq"]  # (B, T, D) @ (D, H/tp*hd) -> (B, T, H/tp*hd)
    k = x @ params["wk"]  # (B, T, H/tp*hd)
    v = x @ params["wv"]  # (B, T, H/tp*hd)
    q, k, v = (einops.rearrange(t, "b t (h d) -> b h t d", d=HEAD_DIM) for t in (q, k, v))  # (B, H/tp, T, hd)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H/tp, T, hd)
    o = einops.rearrange(o, "b h t d -> b t (h d)")  # (B, T, H/tp*hd)
    y = o @ params["wo"]  # (B, T, H/tp*hd) @ (H/tp*hd, D) -> (B, T, D), partial over tp
    return C.reduce_from_region(y, mesh, "tp") + params["bo"]


def attn_reference(params, x):
    """The same block written without sharding or SDPA: explicit per-head softmax attention."""
    outs = []
    for h in range(HEADS):
        s = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
        q = x @ params["wq"][:, s] + params["bq"][s]
        k, v = x @ params["wk"][:, s], x @ params["wv"][:, s]
        a = (q @ k.transpose(-1, -2)) / HEAD_DIM**0.5
        a = a.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        outs.append(a @ v)
    return torch.cat(outs, -1) @ params["wo"] + params["bo"]


LAYERS = {
    "mlp": (lambda: mlp_init(D, H, seed=3), mlp_specs, mlp_forward, lambda: torch.randn(B, T, D, generator=torch.Generator().manual_seed(9))),
    "attention": (attn_init, attn_specs, attn_forward, lambda: torch.randn(B, T, D, generator=torch.Generator().manual_seed(9))),
}


def loss_of(forward, params, x, mesh):
    target = torch.linspace(-1, 1, D)
    return ((forward(params, x, mesh) - target) ** 2).mean()


def _sharded(layer, sizes):
    init, specs, forward, data = LAYERS[layer]
    m = harness.mesh(**sizes)
    local = fp.shard(init(), specs(), m)
    x = data()
    # the input's gradient flows back through copy_to_region's all-reduce: it must be the full one
    loss, (g_params, g_x) = torch.func.grad_and_value(lambda p, x: loss_of(forward, p, x, m), argnums=(0, 1))(local, x)[::-1]
    return loss, g_params, g_x, {k: tuple(v.shape) for k, v in local.items()}


def assert_rel(got, want, tol=1e-6, what=""):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), f"{what}: max error {err:.3g}"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layer", ["mlp", "attention"])
def test_per_shard_gradients_equal_single_process_chunks(layer, tp):
    init, specs, forward, data = LAYERS[layer]
    params, x = init(), data()
    single = fp.Mesh()
    loss_ref, (g_ref, gx_ref) = torch.func.grad_and_value(lambda p, x: loss_of(forward, p, x, single), argnums=(0, 1))(params, x)[::-1]
    if layer == "attention":  # the single-process program is itself checked against an independent implementation
        target = torch.linspace(-1, 1, D)
        assert_rel(loss_ref, ((attn_reference(params, x) - target) ** 2).mean(), what="sdpa vs explicit attention")
    for rank, (loss, g_params, g_x, shapes) in enumerate(harness.run(tp, _sharded, layer, {"tp": tp})):
        assert abs(loss.item() - loss_ref.item()) <= 1e-6 * abs(loss_ref.item())
        assert_rel(g_x, gx_ref, what=f"{layer} tp={tp} input grad")
        for name, spec in specs().items():
            want = block(g_ref[name], spec, tp, rank)
            assert shapes[name] == tuple(want.shape)
            assert_rel(g_params[name], want, what=f"{layer} tp={tp} rank {rank} grad of {name} {spec}")


def block(t, spec, n, r):
    """Rank r's block of t under a spec naming at most the tp axis (computed here without funcpar.spec)."""
    for dim in range(len(spec)):
        if spec[dim] == "tp":
            return t.chunk(n, dim)[r]
    return t


@pytest.mark.subprocess
def test_tp_mlp_example_trains_on_four_ranks():
    """``python examples/tp_mlp.py`` starts its own 4 ranks (Mesh(tp=2, dp=2)) and its loss falls."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "examples/tp_mlp.py", "--steps", "20"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "tensor-parallel MLP on Mesh(tp=2, dp=2), 4 process(es)" in p.stdout
    first, last = (float(x) for x in p.stdout.split("\nloss ")[1].split(" (")[0].split(" -> "))
    assert last < 0.8 * first


def _column_parallel_case(tp):
    """column_parallel(x, [w1, w2, w3], biases) on this rank's column shards against the composition
    copy_to_region + F.linear: forward, and gradients through autograd (the overlapped backward), torch.func.grad
    (the composable one), a frozen weight, and vmap over x; plus the order of the overlapped backward's work."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from funcpar.nn import layers as L

    m = harness.mesh(tp=tp)
    g = torch.Generator().manual_seed(3)
    outs = [4 * tp, 2 * tp, 6 * tp]  # global output widths: each rank holds outs/tp rows of each weight
    ws = [torch.randn(o, D, generator=g).chunk(tp)[m.coord("tp")].contiguous() for o in outs]
    bs = [torch.randn(o, generator=g).chunk(tp)[m.coord("tp")].contiguous() for o in outs]
    bs[1] = None  # one linear without a bias
    x = torch.randn(B, T, D, generator=g)
    cs = [torch.randn(B, T, w.shape[0], generator=torch.Generator().manual_seed(10 + m.coord("tp"))) for w in ws]

    def objective(fn, x, *wb):
        return sum((c * y.sin()).sum() for c, y in zip(cs, fn(x, list(wb[:3]), list(wb[3:])), strict=True))

    fused = lambda x, w, b: L.column_parallel(x, w, m, "tp", b)  # noqa: E731
    composed = lambda x, w, b: [F.linear(C.copy_to_region(x, m, "tp"), wi, bi) for wi, bi in zip(w, b, strict=True)]  # noqa: E731
    out = {"fwd": [(a - b).abs().max().item() for a, b in zip(fused(x, ws, bs), composed(x, ws, bs), strict=True)]}
    leaves = [x, *ws, bs[0], bs[2]]
    for name, fn in (("fused", fused), ("composed", composed)):
        args = [t.detach().requires_grad_(t is not ws[2]) for t in leaves]  # ws[2] frozen
        a_x, a_w, a_b0, a_b2 = args[0], args[1:4], args[4], args[5]
        out[name + " autograd"] = torch.autograd.grad(objective(fn, a_x, *a_w, a_b0, None, a_b2),
                                                      [a_x, *a_w[:2], a_b0, a_b2])
        out[name + " func"] = torch.func.grad(lambda x, w0, b0: objective(fn, x, w0, ws[1], ws[2], b0, None, bs[2]),
                                              argnums=(0, 1, 2))(x, ws[0], bs[0])
        per_example = torch.func.vmap(lambda xi: objective(fn, xi[None], *ws, *bs))(x)  # a value per row of x
        out[name + " vmap"] = per_example

    class Log(TorchDispatchMode):  # the overlapped backward: the all-reduce starts before the weight matmuls
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            events.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    events, start = [], C.all_reduce_start

    def logged_start(t, mesh, axis):
        events.append("START")
        wait = start(t, mesh, axis)
        return lambda: (events.append("WAIT"), wait())[1]

    L.C.all_reduce_start = logged_start
    try:
        args = [t.detach().requires_grad_() for t in (x, *ws)]
        loss = objective(fused, args[0], *args[1:], *bs)
        with Log():
            torch.autograd.grad(loss, args)
    finally:
        L.C.all_reduce_start = start
    out["events"] = events[events.index("START"):events.index("WAIT") + 1] if "START" in events else events
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_equals_the_composition_and_overlaps_its_all_reduce(tp):
    for rank, res in enumerate(harness.run(tp, _column_parallel_case, tp)):
        assert max(res["fwd"]) == 0.0, f"rank {rank}: forward differs from copy_to_region + F.linear"
        for path in ("autograd", "func"):
            for got, want in zip(res["fused " + path], res["composed " + path], strict=True):
                assert_rel(got, want, what=f"tp={tp} rank {rank} {path} gradient")
        assert_rel(res["fused vmap"], res["composed vmap"], what=f"tp={tp} rank {rank} vmap")
        ev = res["events"]
        assert ev[0] == "START" and ev[-1] == "WAIT", f"rank {rank}: no overlapped all-reduce in the backward: {ev}"
        assert ev.count("mm") == 3, f"rank {rank}: the 3 weight gradients must run between start and wait: {ev}"


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


FUSED = {  # fused layer, its composition, the shapes of its inputs, which inputs are differentiable
    "rotary": (fp.layers.rotary, lambda x, c, s: x * c + _rotate_half(x) * s, [(3, 4, 6, 8), (6, 8), (6, 8)], 1),
    "swiglu": (fp.layers.swiglu, lambda g, u: F.silu(g) * u, [(3, 5, 7), (3, 5, 7)], 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_elementwise_layers_equal_their_composition(name, dtype):
    fused, ref, shapes, k = FUSED[name]
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    w = torch.randn(shapes[0], generator=gen, dtype=dtype)
    assert torch.equal(fused(*args), ref(*args))

    def loss(f):
        return lambda *a: (f(*a) ** 2 * w).sum()  # not linear in the inputs: second derivatives exist

    argnums = tuple(range(k))
    got, want = torch.func.grad(loss(fused), argnums)(*args), torch.func.grad(loss(ref), argnums)(*args)
    leaves = [a.clone().requires_grad_(i < k) for i, a in enumerate(args)]  # autograd, once and differentiable
    once = torch.autograd.grad(loss(fused)(*leaves), leaves[:k])
    for a, b in zip(once, torch.autograd.grad(loss(ref)(*leaves), leaves[:k]), strict=True):
        assert torch.equal(a, b)
    g1 = torch.autograd.grad(loss(fused)(*leaves), leaves[:k], create_graph=True)
    g2 = torch.autograd.grad(loss(ref)(*leaves), leaves[:k], create_graph=True)
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)
    h1 = torch.autograd.grad(sum((g ** 2).sum() for g in g1), leaves[:k])  # differentiated twice
    h2 = torch.autograd.grad(sum((g ** 2).sum() for g in g2), leaves[:k])
    for a, b in zip(h1, h2, strict=True):  # (differentiating the backward's own operations: the same to round-off)
        tol = 1e-13 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for a, b in zip(got, want, strict=True):  # bit for bit
        assert torch.equal(a, b)
    if name == "swiglu":  # it keeps only its inputs for the backward
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fused(*leaves)
        assert len(saved) == 2 and all(any(s is a for a in leaves) for s in saved)
    if name == "swiglu":  # only ``up`` batched: the forward must not write into silu(gate)
        ups = torch.stack([args[1], 3 * args[1]])
        assert torch.equal(torch.func.vmap(fused, in_dims=(None, 0))(args[0], ups),
                           torch.func.vmap(ref, in_dims=(None, 0))(args[0], ups))
    per_example = torch.func.vmap(torch.func.grad(loss(fused)), in_dims=(0,) + (None,) * (len(args) - 1))
    ref_example = torch.func.vmap(torch.func.grad(loss(ref)), in_dims=(0,) + (None,) * (len(args) - 1))
    batched = [torch.stack([args[0], 2 * args[0]])] + args[1:]
    assert torch.equal(per_example(*batched), ref_example(*batched))


def _rms_composed(x, w, eps):  # transformers' LlamaRMSNorm, written out
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_fused_rms_norm_values_bit_equal_gradients_to_round_off():
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(3, 5, 64, generator=gen), torch.randn(3, 5, 64, generator=gen)
    w, eps = 1 + 0.1 * torch.randn(64, generator=gen), 1e-6
    assert torch.equal(fp.layers.rms_norm(x, w, eps), _rms_composed(x, w, eps))  # forward: the same operations

    def vjp(f, *a):
        return torch.func.vjp(lambda x, w: f(x, w, eps), *a)[1](g.to(a[0].dtype))

    exact = torch.func.vjp(lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)),
                           x.double(), w.double())[1](g.double())  # float64 (the composition casts to float32)
    fused, composed = vjp(fp.layers.rms_norm, x, w), vjp(_rms_composed, x, w)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    fp.layers.rms_norm(*leaves, eps).backward(g)
    for got, ref, want, lv in zip(fused, composed, exact, leaves, strict=True):
        err = lambda t: ((t.double() - want).abs().max() / want.abs().max()).item()  # noqa: E731
        assert err(got) <= max(2 * err(ref), 2e-7), (err(got), err(ref))  # round-off, as the composition's
        assert torch.equal(lv.grad, got)  # .backward() and torch.func agree
    # it keeps x, w and the per-row scale only (the composition also keeps x * r, an x-sized tensor)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp.layers.rms_norm(*leaves, eps)
    assert sorted(t.numel() for t in saved) == [15, 64, x.numel()], [tuple(t.shape) for t in saved]
    # differentiated twice (autograd and torch.func), per-example under vmap, only w batched, bf16: as composed
    f3 = lambda f: lambda x, w: (f(x, w, eps) ** 3).sum()  # noqa: E731
    for argnum in (0, 1):
        h = [torch.func.grad(lambda *a: torch.func.grad(f3(f))(*a).sum(), argnum)(x, w) for f in
             (fp.layers.rms_norm, _rms_composed)]
        assert_rel(h[0], h[1], tol=1e-5, what=f'second order, argument {argnum}')
    g1 = torch.autograd.grad(f3(fp.layers.rms_norm)(*leaves), leaves[0], create_graph=True)[0]
    g2 = torch.autograd.grad(f3(_rms_composed)(*leaves), leaves[0], create_graph=True)[0]
    assert_rel(torch.autograd.grad(g1.pow(2).sum(), leaves)[0], torch.autograd.grad(g2.pow(2).sum(), leaves)[0],
               tol=1e-5, what="second order, create_graph")
    xs = torch.stack([x, 2 * x])
    per = [torch.func.vmap(torch.func.grad(f3(f)), in_dims=(0, None))(xs, w) for f in (fp.layers.rms_norm,
                                                                                      _rms_composed)]
    assert_rel(per[0], per[1], tol=1e-6, what='per-example gradients (vmap)')
    ws = torch.stack([w, 2 * w])
    assert torch.equal(torch.func.vmap(lambda w: fp.layers.rms_norm(x, w, eps))(ws),
                       torch.func.vmap(lambda w: _rms_composed(x, w, eps))(ws))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(fp.layers.rms_norm(xb, wb, eps), _rms_composed(xb, wb, eps))
