"""A backward pass split in two: the inputs' gradients now, the weights' gradients later (zero-bubble pipelines).

A pipeline stage's backward has two parts with different urgency: the gradient of its *input* is what the previous
stage waits for, while the gradients of its *weights* are needed only when the step ends. Computing the first at
once and deferring the second lets a schedule fill its bubble with weight-gradient work (Qi et al., "Zero Bubble
Pipeline Parallelism", 2023).

:func:`backward_input` walks the autograd graph of a chunk's outputs and finds, for every weight, the *split nodes*:
the nodes on the path from the outputs to the inputs through which that weight's gradient flows (for ``y = x @ w.T``
the matmul's backward node, which forms both ``x``'s and ``w``'s gradients). It runs the backward to the inputs
only, keeping the graph, and records the gradient arriving at each split node. :meth:`Deferred.run` later restarts
the engine at the split nodes with those gradients, towards the weights only, and accumulates them into ``.grad``.
The engine computes a node's outputs only where a requested edge needs them, so the two passes together do the
work of one backward: the input-gradient matmuls in the first, the weight-gradient matmuls in the second. (A custom
``autograd.Function`` computes what ``ctx.needs_input_grad`` says: each pass narrows it, on every such Function of the
graph, to what that pass reaches, :func:`_narrowing`.)
The gradients are the single backward's: the same ops on the same operands.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["Deferred", "backward_input"]


# the leaves' accumulator nodes the running split pass computes gradients for: a module-level stack, not a
# thread-local, since on CUDA the engine runs a custom Function's backward on its device thread, not the caller's. So
# one split pass at a time per process (funcpar's ranks are processes, each walking its schedule on one thread)
_REQUESTED: list[set[Node]] = []


def _narrowed(node: Node, need: tuple[bool, ...]) -> tuple[bool, ...]:
    """A custom Function node's ``needs_input_grad`` (``need``, as its forward set it) narrowed to the inputs the
    running split pass reaches. The inputs that need a gradient are the tensors that require one, and those are,
    in order, the node's edges to another node (its other inputs have none), so the k-th True of ``need`` is the
    k-th such edge."""
    nodes = iter(n for n, _ in node.next_functions if n is not None)
    out = []
    for x in need:
        if not x:
            out.append(False)
            continue
        child = next(nodes)
        if type(child).__name__ == "AccumulateGrad":  # a leaf: the engine cannot say during autograd.grad
            out.append(child in _REQUESTED[-1])
        else:
            out.append(torch._C._will_engine_execute_node(child))
    return tuple(out)


class _Narrow:
    """A pre-hook setting a custom Function node's ``needs_input_grad`` to what the running pass reaches
    (:func:`_narrowed`), from the value its forward set (put back by :meth:`restore`)."""

    def __init__(self, node: Node):
        self.node, self.need = node, tuple(node.needs_input_grad)

    def __call__(self, _grads) -> None:
        self.node.needs_input_grad = _narrowed(self.node, self.need)

    def restore(self) -> None:
        self.node.needs_input_grad = self.need


def _narrowing(parents: dict[Node, list[Node]]) -> list[tuple[Node, _Narrow]]:
    """Pre-hooks for every custom Function node of the graph ``parents`` (:func:`_parents`) that narrow its
    ``needs_input_grad`` just before its backward runs: a Function's backward forms only the gradients it is asked
    for, so each pass does only its part of the work, while the Functions read ``ctx.needs_input_grad`` as in any
    backward (the split is the pipeline's business, not theirs)."""
    return [(node, _Narrow(node)) for node in parents if isinstance(node, BackwardCFunction)]


def _backward(outputs, inputs, grad_outputs, prehooks=()) -> None:
    """``torch.autograd.backward`` into ``inputs`` only (graph kept), with ``inputs``' leaves known to
    :func:`_narrowed` and ``prehooks`` ((node, hook) pairs) registered for the call only. The leaves' own
    accumulator nodes add to ``.grad`` as in any backward: a fresh gradient is taken as it is, one the engine holds
    elsewhere (the same tensor for two leaves, the gradient it was given) copied first."""
    _REQUESTED.append({get_gradient_edge(x).node if isinstance(x, torch.Tensor) else x.node for x in inputs})
    handles = [node.register_prehook(hook) for node, hook in prehooks]
    try:
        torch.autograd.backward(outputs, grad_outputs, retain_graph=True, inputs=inputs)
    finally:
        for h in handles:
            h.remove()
        _REQUESTED.pop()


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots`` -> the nodes with an edge to it (``roots`` map to [])."""
    parents: dict[Node, list[Node]] = {n: [] for n in roots}
    stack = list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _above(start: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``start`` and every node with a path down to one of them."""
    seen, stack = set(start), list(start)
    while stack:
        for p in parents[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


class Deferred:
    """The weight-gradient half of a split backward (see the module docstring): ``run()`` once."""

    def __init__(self, groups: list[tuple[list[torch.Tensor], list[Node]]], grads: dict[Node, tuple],
                 narrowing: list[tuple[Node, _Narrow]]):
        self.groups, self.grads, self.narrowing = groups, grads, narrowing

    def run(self) -> None:
        """Each group's weights' gradients from the gradients recorded at its split nodes, added to ``.grad``."""
        for weights, nodes in self.groups:
            edges, outs = [], []
            for n in nodes:
                for i, g in enumerate(self.grads.get(n, ())):
                    if g is not None:
                        edges.append(GradientEdge(n, i))
                        outs.append(g)
            if not edges:  # no gradient reached this group: its weights get none
                continue
            # each split node gets its record as it is: tensor hooks ran on it in the input pass and would run again
            # on what the engine is given, and a split node below another would also get what arrives from above
            clamps = [(n, lambda _g, rec=self.grads[n]: rec) for n in nodes if n in self.grads]
            _backward(edges, weights, outs, clamps + self.narrowing)
        for _, hook in self.narrowing:
            hook.restore()
        self.groups, self.grads, self.narrowing = [], {}, []


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> Deferred | None:
    """The backward of ``outputs`` (with ``grads``; None for a scalar's 1) into ``inputs``' ``.grad`` only; returns
    what computes ``weights``' gradients later (those not requiring grad are skipped). Returns ``None`` after a whole
    backward (``.grad`` of the inputs and the weights set) where nothing can be deferred: no input, an output the
    inputs do not reach, or a weight whose path joins the inputs' at an input itself (a non-leaf input computed from
    it: the input pass stops there)."""
    roots = [o.grad_fn for o in outputs]
    if not inputs or any(r is None for r in roots):
        torch.autograd.backward(list(outputs), list(grads))
        return None
    parents = _parents(roots)
    starts = {n for n in (get_gradient_edge(x).node for x in inputs) if n in parents}
    on_path = _above(list(starts), parents)
    by_nodes: dict[frozenset, list[torch.Tensor]] = defaultdict(list)
    for w in weights:
        if not w.requires_grad:
            continue
        acc = get_gradient_edge(w).node
        if acc not in parents:
            continue  # not used by these outputs
        split, seen, stack = set(), {acc}, [acc]
        while stack:
            node = stack.pop()
            if not parents[node] and node not in on_path or starts.intersection(parents[node]):
                torch.autograd.backward(list(outputs), list(grads))  # a root only weights reach, or an input's node
                return None
            for p in parents[node]:
                if p in on_path:
                    split.add(p)
                elif p not in seen:
                    seen.add(p)
                    stack.append(p)
        by_nodes[frozenset(split)].append(w)
    recorded: dict[Node, tuple] = {}
    records = [(n, lambda g, n=n: recorded.__setitem__(n, g)) for nodes in by_nodes for n in nodes]
    narrowing = _narrowing(parents)
    _backward(list(outputs), list(inputs), list(grads), records + narrowing)
    return Deferred([(ws, list(nodes)) for nodes, ws in by_nodes.items()], recorded, narrowing)
