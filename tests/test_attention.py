"""funcpar.nn.attention.causal: torch's causal SDPA to round-off (no further from a float64 reference than torch's own
float32 kernel), through the block path on CPU float32, torch's kernel everywhere else; the block path skips the
masked keys beyond the diagonal block and returns the layout torch's CPU kernel returns."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from funcpar.nn import attention as A


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _inputs(B, H, KV, T, D, seed=0, dtype=torch.float64, permuted=True):
    g = torch.Generator().manual_seed(seed)
    if permuted:  # (B, T, H, D) memory, as the models' rearranged projections are
        xs = [torch.randn(B, T, n, D, generator=g, dtype=torch.float64).transpose(1, 2) for n in (H, KV, KV)]
    else:
        xs = [torch.randn(B, n, T, D, generator=g, dtype=torch.float64) for n in (H, KV, KV)]
    return [x.to(dtype) for x in xs], torch.randn(B, H, T, D, generator=g, dtype=torch.float64)


def _run(f, xs, go, dtype):
    xs = [x.detach().to(dtype).requires_grad_() for x in xs]
    o = f(*xs)
    o.backward(go.to(dtype))
    return [o.detach().double()] + [x.grad.double() for x in xs]


@pytest.mark.parametrize("shape,permuted", [((4, 8, 4, 256, 64), True), ((2, 4, 4, 100, 32), False),
                                            ((1, 6, 2, 512, 16), True), ((3, 8, 4, 97, 64), True),
                                            ((2, 2, 1, 64, 8), False)])
def test_block_path_is_sdpa_to_round_off(shape, permuted):
    xs, go = _inputs(*shape, permuted=permuted)
    assert A._blocked(*[x.float() for x in xs])
    exact = _run(_sdpa, xs, go, torch.float64)
    for name, got in (("sdpa", _run(_sdpa, xs, go, torch.float32)), ("block", _run(A.causal, xs, go, torch.float32))):
        err = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, exact, strict=True)]
        if name == "sdpa":
            # twice torch's own error and 2 float32 ulps of the largest value: torch's error moves with the CPU's
            # kernels (on one machine, q's gradient at (3, 8, 4, 97, 64): torch 3.69e-7, the block path 7.39e-7,
            # 1.0007x twice torch's)
            bound = [max(2 * e + 2 * torch.finfo(torch.float32).eps, 1e-7) for e in err]
        else:  # output, then the gradients of q, k, v
            assert all(e <= b for e, b in zip(err, bound, strict=True)), (shape, err, bound)


def test_outside_the_block_path_it_is_torchs_kernel_exactly():
    for shape, dtype in [((2, 4, 2, 63, 16), torch.float32), ((1, 2, 2, 513, 8), torch.float32),
                         ((2, 4, 2, 128, 16), torch.float64)]:
        xs, go = _inputs(*shape, dtype=dtype)
        assert not A._blocked(*xs)
        assert all(torch.equal(a, b) for a, b in zip(_run(A.causal, xs, go, dtype), _run(_sdpa, xs, go, dtype), strict=True))
    xs, go = _inputs(2, 4, 2, 128, 16, dtype=torch.float32)  # under torch.func: wrapped inputs take torch's kernel
    loss = lambda f: (lambda q, k, v: (f(q, k, v) * go.float()).sum())  # noqa: E731
    got = torch.func.grad(loss(A.causal), argnums=(0, 1, 2))(*xs)
    want = torch.func.grad(loss(_sdpa), argnums=(0, 1, 2))(*xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _Bmms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        add = (torch.ops.aten.baddbmm.default, torch.ops.aten.baddbmm_.default)
        if func is torch.ops.aten.bmm.default or func in add:
            a, b = args[1:3] if func in add else args
            self.flops += 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        return func(*args, **(kwargs or {}))


def test_block_path_skips_the_masked_keys_and_keeps_torchs_layout():
    B, H, KV, T, D = 2, 4, 2, 256, 16
    xs, go = _inputs(B, H, KV, T, D, dtype=torch.float32)
    xs = [x.requires_grad_() for x in xs]
    with _Bmms() as counted:
        o = A.causal(*xs)
    full = 2 * 2 * B * H * T * T * D  # q kᵀ and p v over every (query, key) pair
    assert counted.flops == full * (8 + 1) / (2 * 8)  # 8 blocks of 32: (n + 1) / 2n of it
    with _Bmms() as counted:
        o.backward(go.float())
    assert counted.flops == 2 * full * (8 + 1) / (2 * 8)  # the gradients of v, p, k and q
    assert o.transpose(1, 2).is_contiguous()  # (B, T, H, D) memory: "b h t d -> b t (h d)" is a view
    assert o.transpose(1, 2).reshape(B, T, H * D).data_ptr() == o.data_ptr()


def test_block_path_twice_and_differentiated_again():
    xs, go = _inputs(1, 4, 2, 96, 8, dtype=torch.float32)
    xs = [x.requires_grad_() for x in xs]
    o = A.causal(*xs)
    first = torch.autograd.grad(o, xs, go.float(), retain_graph=True)
    again = torch.autograd.grad(o, xs, go.float(), retain_graph=True)  # the kept probabilities are left intact
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    gq = torch.autograd.grad(o, xs[0], go.float(), create_graph=True)[0]
    second = torch.autograd.grad(gq.square().sum(), xs)
    g = xs[0].shape[1] // xs[1].shape[1]  # (torch's CPU kernel has no second derivative: the math composition)
    s = (xs[0] @ xs[1].repeat_interleave(g, 1).transpose(-1, -2) / 8 ** 0.5).masked_fill(
        torch.ones(96, 96, dtype=torch.bool).triu(1), float("-inf"))
    o_ref = s.softmax(-1) @ xs[2].repeat_interleave(g, 1)
    gq_ref = torch.autograd.grad(o_ref, xs[0], go.float(), create_graph=True)[0]
    want = torch.autograd.grad(gq_ref.square().sum(), xs)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(second, want, strict=True))


@pytest.mark.parametrize("shape,dtype", [((2, 4, 2, 24, 40, 16), torch.float32), ((1, 6, 3, 33, 99, 32), torch.float32),
                                         ((2, 2, 2, 8, 24, 16), torch.bfloat16)])
def test_a_context_chunk_runs_two_flash_calls_and_no_mask(shape, dtype):
    """A context-parallel chunk (queries at positions ``Tk - Tq ..`` of the keys): the unmasked earlier keys and the
    chunk's own, causally, merged by log-sum-exp; equal to the masked attention (float64) to round-off, and no
    (Tq, Tk) tensor is ever made."""
    B, H, KV, Tq, Tk, D = shape
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(B, n, t, D, generator=g, dtype=torch.float64) for n, t in ((H, Tq), (KV, Tk), (KV, Tk))]
    go = torch.randn(B, H, Tq, D, generator=g, dtype=torch.float64)
    i, j = torch.arange(Tk - Tq, Tk)[:, None], torch.arange(Tk)[None, :]
    exact = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=j <= i, enable_gqa=True), xs, go,
                 torch.float64)
    assert A._chunk(*[x.to(dtype) for x in xs], None, Tk - Tq, "cpu")
    sizes = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes.extend(tuple(t.shape[-2:]) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Sizes():
        got = _run(lambda q, k, v: A.causal(q, k, v, None, Tk - Tq), xs, go, dtype)
    assert (Tq, Tk) not in sizes and (Tk, Tq) not in sizes
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    for a, b in zip(got, exact, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= tol


def test_a_context_chunk_differentiated_again_and_under_torch_func():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, t, 8, generator=g, requires_grad=True) for t in (6, 18, 18))
    go = torch.randn(1, 4, 6, 8, generator=g)
    i, j = torch.arange(12, 18)[:, None], torch.arange(18)[None, :]
    masked = lambda q, k, v: ((q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(j > i, float("-inf")).softmax(-1)  # noqa
                              @ v)
    chunk = lambda q, k, v: A.causal(q, k, v, None, 12)  # noqa: E731
    gq, gq_ref = (torch.autograd.grad(f(q, k, v), q, go, create_graph=True)[0] for f in (chunk, masked))
    second, want = (torch.autograd.grad(x.square().sum(), (q, k, v)) for x in (gq, gq_ref))
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(second, want, strict=True))
    loss = lambda f: (lambda q, k, v: (f(q, k, v) * go).sum())  # noqa: E731  (wrapped inputs: the masked kernel)
    got, ref = (torch.func.grad(loss(f), argnums=(0, 1, 2))(q, k, v) for f in (chunk, masked))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, ref, strict=True))


def test_a_context_chunk_on_cuda_takes_torchs_lower_right_bias(monkeypatch):
    """On CUDA a chunk runs torch's lower-right causal bias (its kernels form no mask), the keys repeated per query
    head: exact against the masked attention here, where torch forms the bias as a mask; the route is checked on
    meta tensors standing for CUDA ones."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, t, 16, generator=g, dtype=torch.float64) for h, t in ((6, 10), (2, 30), (2, 30)))
    i, j = torch.arange(20, 30)[:, None], torch.arange(30)[None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=j <= i, enable_gqa=True)
    assert torch.allclose(A._lower_right(q, k, v), want, rtol=1e-12, atol=1e-12)
    taken = []
    monkeypatch.setattr(A, "_lower_right", lambda *xs: taken.append("cuda") or xs[0])
    monkeypatch.setattr(A, "_ChunkCausal", type("Spy", (), {"apply": staticmethod(lambda *xs: taken.append("cpu"))}))
    for device in ("cuda", "cpu"):
        monkeypatch.setattr(A, "META_DEVICE", device)
        A.causal(q.to("meta", torch.float32), k.to("meta", torch.float32), v.to("meta", torch.float32), None, 20)
    assert taken == ["cuda", "cpu"]
