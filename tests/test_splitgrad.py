"""A backward split into the inputs' gradients now and the weights' later (funcpar/pipeline/splitgrad.py), on one process.

Each test runs a function's backward whole and split, and compares every gradient bit for bit; and checks the
split's two passes each do only their part (a custom Function's ``needs_input_grad`` narrowed to each pass's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from funcpar.pipeline import splitgrad
from funcpar.nn.pointwise import rms_norm

D = 16


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"w1": (D, D), "b1": (D,), "scale": (D,), "w2": (D, D), "w3": (D, D), "norm": (D,)}
    return {k: (torch.randn(s, generator=g) * 0.3).requires_grad_() for k, s in shapes.items()}


def net(p, x):
    h = F.linear(rms_norm(x, p["norm"], 1e-6), p["w1"], p["b1"]).relu() * p["scale"]
    h = F.linear(h, p["w2"]) + x  # a residual: x's gradient arrives from two places
    return F.linear(h.tanh(), p["w3"])


def whole_and_split(fn, p, x0, seed=1):
    g = torch.randn(fn(p, x0).shape, generator=torch.Generator().manual_seed(seed))
    x = x0.clone().requires_grad_()
    fn(p, x).backward(g)
    whole = {k: w.grad.clone() for k, w in p.items()}, x.grad.clone()
    for w in p.values():
        w.grad = None
    x = x0.clone().requires_grad_()
    rest = splitgrad.backward_input([fn(p, x)], [g], [x], list(p.values()))
    between = {k: w.grad for k, w in p.items()}
    if rest is not None:
        rest.run()
    return whole, ({k: w.grad for k, w in p.items()}, x.grad), between, rest


def test_the_split_gives_the_whole_backwards_gradients_bit_for_bit():
    p, x0 = weights(), torch.randn(3, 5, D, generator=torch.Generator().manual_seed(2))
    (w_ref, x_ref), (w_got, x_got), between, rest = whole_and_split(net, p, x0)
    assert rest is not None
    assert all(g is None for g in between.values())  # the input pass leaves every weight alone
    assert torch.equal(x_got, x_ref)
    for k in p:
        assert torch.equal(w_got[k], w_ref[k]), k


def test_a_weight_used_twice_still_gets_its_gradient_once():
    # w1 feeds two matmuls, one above the other on the inputs' path: the weight pass must not count the lower one's
    # part twice (what reaches it from the upper one is already in its record)
    def twice(p, x):
        return F.linear(F.linear(x, p["w1"]).sin(), p["w1"]) * p["scale"]
    p, x0 = weights(3), torch.randn(4, D, generator=torch.Generator().manual_seed(4))
    p = {k: p[k] for k in ("w1", "scale")}
    (w_ref, x_ref), (w_got, x_got), _, rest = whole_and_split(twice, p, x0)
    assert rest is not None and torch.equal(x_got, x_ref)
    for k in p:
        assert torch.allclose(w_got[k], w_ref[k], rtol=1e-6, atol=1e-7), k


def test_what_cannot_be_split_runs_whole():
    # a second output that only a weight reaches (no path to the input to split it from): one pass does all
    p, x0 = weights(5), torch.randn(4, D, generator=torch.Generator().manual_seed(6))
    g = torch.randn(4, D, generator=torch.Generator().manual_seed(7))
    x = x0.clone().requires_grad_()
    torch.autograd.backward([net(p, x), p["b1"].square().sum()], [g, None])
    ref = {k: w.grad.clone() for k, w in p.items()}, x.grad.clone()
    for w in p.values():
        w.grad = None
    x = x0.clone().requires_grad_()
    rest = splitgrad.backward_input([net(p, x), p["b1"].square().sum()], [g, None], [x], list(p.values()))
    assert rest is None and torch.equal(x.grad, ref[1]) and all(torch.equal(p[k].grad, ref[0][k]) for k in p)
    # a weight joining the output by its own path is split at the node where it joins
    p = weights(5)
    (w_ref, x_ref), (w_got, x_got), between, rest = whole_and_split(lambda p, x: net(p, x) + p["b1"].sum(), p, x0)
    assert rest is not None and all(v is None for v in between.values())
    assert torch.equal(x_got, x_ref) and all(torch.equal(w_got[k], w_ref[k]) for k in p)
    # an input the outputs do not use: nothing to split from, the whole backward (and no gradient for it)
    p, unused = weights(8), torch.randn(4, D, requires_grad=True)
    assert splitgrad.backward_input([net(p, x0).sum()], [None], [unused], list(p.values())) is None
    assert unused.grad is None and all(w.grad is not None for w in p.values())
    # an input computed from a weight: the input pass stops at the input, so that weight's part cannot wait
    p, w0 = weights(9), torch.randn(D, requires_grad=True)
    xin = x0 * w0
    assert splitgrad.backward_input([net(p, xin).sum()], [None], [xin], [w0, *p.values()]) is None
    assert w0.grad is not None
    # no input at all: the whole backward
    p = weights(7)
    assert splitgrad.backward_input([net(p, x0).sum()], [None], [], list(p.values())) is None
    assert all(w.grad is not None for w in p.values())


class _Recorder(torch.autograd.Function):
    """``x @ w.T`` that records which gradients each backward call formed."""

    calls: list = []

    @staticmethod
    def forward(x, tag, w):
        return x @ w.t()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[2])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad)
        _Recorder.calls.append(need)
        return g @ w if need[0] else None, None, g.t() @ x if need[2] else None


def test_tensor_hooks_run_once_and_first_gradients_are_copies():
    # a hook on an activation scales what reaches the weights below it: once, as in a whole backward
    def hooked(p, x):
        h = F.linear(x, p["w1"])
        h.register_hook(lambda g: g * 10)
        return F.linear(h, p["w2"]) + p["b1"] + p["b2"]  # two biases given one gradient tensor by the engine
    p, x0 = weights(10), torch.randn(4, D, generator=torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(12)
    p = {"w1": p["w1"], "w2": p["w2"], "b1": torch.randn(4, D, generator=g).requires_grad_(),
         "b2": torch.randn(4, D, generator=g).requires_grad_()}
    (w_ref, x_ref), (w_got, x_got), _, rest = whole_and_split(hooked, p, x0)
    assert rest is not None and torch.equal(x_got, x_ref) and all(torch.equal(w_got[k], w_ref[k]) for k in p)
    assert p["b1"].grad.data_ptr() != p["b2"].grad.data_ptr()  # summed into separately by the next micro-batch


def test_custom_functions_reading_needs_input_grad_form_only_each_passes_part():
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(3, D, requires_grad=True)
    _Recorder.calls.clear()
    _Recorder.apply(x, "t", w).sum().backward()  # a plain backward: what needs_input_grad says
    whole = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    rest = splitgrad.backward_input([_Recorder.apply(x, "t", w).sum()], [None], [x], [w])
    assert w.grad is None and torch.equal(x.grad, whole[0])
    rest.run()
    assert torch.equal(w.grad, whole[1])
    assert _Recorder.calls == [(True, False, True), (True, False, False), (False, False, True)]
    # and under torch.func, outside any split pass, needs_input_grad itself
    _Recorder.calls.clear()
    torch.func.grad(lambda w: _Recorder.apply(x.detach(), "t", w).sum())(w.detach())
    assert _Recorder.calls == [(False, False, True)]


def test_the_weight_pass_takes_the_engines_gradients_without_copies_but_never_a_given_one():
    # the leaves' accumulator nodes take a fresh gradient as it is (a copy per weight per micro-batch cost a zero-
    # bubble pipeline's step 2%); a gradient the caller still holds (here the one given for the output, which the
    # bias gets unchanged) is copied, so the next micro-batch's in-place sum cannot reach the caller's tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_):
                self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    p = weights(13)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(14)).requires_grad_()
    g = torch.randn(4, D, generator=torch.Generator().manual_seed(15))
    y = F.linear(F.linear(x, p["w1"]).tanh(), p["w2"])
    rest = splitgrad.backward_input([y], [g], [x], [p["w1"], p["w2"]])
    with Copies() as mode:
        rest.run()
    assert mode.seen == [] and p["w1"].grad is not None and p["w2"].grad is not None
    b = torch.zeros(4, D, requires_grad=True)
    x = x.detach().requires_grad_()
    rest = splitgrad.backward_input([F.linear(x, p["w1"]) + b], [g], [x], [p["w1"], b])
    rest.run()
    assert torch.equal(b.grad, g) and b.grad.data_ptr() != g.data_ptr()
