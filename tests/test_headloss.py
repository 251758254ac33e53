"""funcpar.nn.headloss: the head's matmul and the cross-entropy fused over row chunks equal the unfused head (the
logits, then ``layers.vocab_cross_entropy``) to round-off, in loss and in both gradients, with several chunks, a
padded vocabulary, ignored targets, either reduction, in bfloat16 too, vocab-parallel over tp=2, and under
``torch.func.grad``; the logits are never held whole."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import funcpar as fp
import harness
from funcpar.nn import headloss as HL

N, D, V = 24, 16, 50  # V: a vocabulary padded to 52 rows (tp=2 splits it 26 + 26)


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(52, D, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::5] = -100
    weights = (targets != -100).float() / (targets != -100).sum()
    return x, w, targets, weights


def _unfused(x, w, targets, weights, mesh):
    logits = x @ w.t()
    tok = fp.layers.vocab_cross_entropy(logits, targets, mesh, "tp", V)
    return (torch.where(targets != -100, tok, torch.zeros(())) * weights).sum()


def _both(x, w, targets, weights, mesh, chunk_floats):
    out = []
    for f in (lambda *a: HL.head_loss(*a, mesh, "tp", V, chunk_floats), lambda *a: _unfused(*a, mesh)):
        xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = f(xs, ws, targets, weights)
        loss.backward()
        out.append((loss.detach(), xs.grad, ws.grad))
    return out


@pytest.mark.parametrize("chunk_floats", [52 * 5, 1 << 24])  # 5 rows a chunk (5 chunks), or one chunk
def test_the_fused_head_equals_the_unfused_one(chunk_floats):
    fused, ref = _both(*_inputs(), fp.Mesh(), chunk_floats)
    for a, b in zip(fused, ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a, b)
    x, w, targets, weights = _inputs()
    summed = HL.head_loss(x, w, targets, (targets != -100).float(), fp.Mesh(), "tp", V, chunk_floats)
    assert torch.allclose(summed, _unfused(x, w, targets, (targets != -100).float(), fp.Mesh()), rtol=1e-6)


def test_in_bfloat16_the_gradients_are_the_inputs_dtype_and_near_float32():
    fused, ref = _both(*_inputs(torch.bfloat16), fp.Mesh(), 52 * 5)
    assert fused[1].dtype == fused[2].dtype == torch.bfloat16
    for a, b in zip(fused, ref, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def _tp(chunk_floats):
    mesh = harness.mesh(tp=2)
    x, w, targets, weights = _inputs()
    rows = w.chunk(2)[mesh.coord("tp")]
    got = []
    for f in (lambda xr, wr: HL.head_loss(fp.collectives.copy_to_region(xr, mesh, "tp"), wr, targets, weights, mesh,
                                          "tp", V, chunk_floats),
              lambda xr, wr: _unfused(fp.collectives.copy_to_region(xr, mesh, "tp"), wr, targets, weights, mesh)):
        xr, wr = x.clone().requires_grad_(), rows.clone().requires_grad_()
        loss = f(xr, wr)
        loss.backward()
        got.append((loss.detach(), xr.grad, wr.grad))
    return got


def test_vocab_parallel_over_tp2_equals_the_unfused_head():
    for fused, ref in harness.run(2, _tp, 26 * 5):
        for a, b in zip(fused, ref, strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a, b)


def test_under_torch_func_grad_and_without_the_whole_logits():
    x, w, targets, weights = _inputs()
    got = torch.func.grad(lambda x, w: HL.head_loss(x, w, targets, weights, fp.Mesh(), "tp", V, 52 * 4),
                          argnums=(0, 1))(x, w)
    want = torch.func.grad(lambda x, w: _unfused(x, w, targets, weights, fp.Mesh()), argnums=(0, 1))(x, w)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, want, strict=True))
    biggest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            biggest.extend(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Sizes():
        loss = HL.head_loss(x.requires_grad_(), w.requires_grad_(), targets, weights, fp.Mesh(), "tp", V, 52 * 4)
        loss.backward()
    assert max(biggest) == 52 * D and N * 52 not in biggest  # w's gradient is the largest; never N x V logits
    with torch.no_grad():  # an evaluation: no gradients formed
        assert torch.allclose(HL.head_loss(x, w, targets, weights, fp.Mesh(), "tp", V),
                              _unfused(x, w, targets, weights, fp.Mesh()), rtol=1e-6)


@pytest.mark.parametrize("chunk_floats", [None, 6 * 52])
def test_soft_capping_and_a_bias_equal_the_composition(chunk_floats):
    """Gemma's ``cap * tanh(logits / cap)`` and a head's bias (Phi's), inside the fused chunks: the loss and the
    gradients of x, w and the bias as the composition's, to round-off."""
    x, w, targets, weights = _inputs(seed=3)
    bias = torch.randn(52) * 0.3
    mesh, cap = fp.Mesh(), 2.0
    out = []
    for fused in (True, False):
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, bias))
        if fused:
            loss = HL.head_loss(xs, ws, targets, weights, mesh, "tp", V, chunk_floats, softcap=cap, bias=bs)
        else:
            logits = torch.tanh((xs @ ws.t() + bs) / cap) * cap
            tok = fp.layers.vocab_cross_entropy(logits, targets, mesh, "tp", V)
            loss = (torch.where(targets != -100, tok, torch.zeros(())) * weights).sum()
        loss.backward()
        out.append((loss.detach(), xs.grad, ws.grad, bs.grad))
    for a, b in zip(*out, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert out[0][3][V:].abs().max() == 0  # (the padding columns: no gradient)
