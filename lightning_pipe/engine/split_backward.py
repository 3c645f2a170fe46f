"""One backward in two halves: the stage input's gradient now, the weights' gradients later.

Zero-bubble schedules (docs/algorithms.md §4a) run a stage's backward as ``I``, the gradient of the
stage's input, which the previous stage waits for, and ``W``, the gradients of its weights, which no
one waits for until the optimizer step. Both halves walk the autograd graph the forward built once;
nothing is recomputed:

* ``I`` finds the *boundary* nodes: those on the path from the outputs to the inputs that also
  lead to a weight (``AddmmBackward`` of a linear layer: its input path goes on to ``x``, its other
  edges to ``W`` and ``b``). It runs autograd to the inputs only, keeping the graph, and a pre-hook
  on each boundary node records the gradient that reached it (``dY`` of the linear layer), so the
  weight edges of these nodes are never computed.
* ``W`` restarts autograd at the boundary nodes with the recorded gradients, towards the weights
  only, one call per group of weights that share boundary nodes (one call for all would push
  ``dY`` down the input path again, from one layer to the next). The weights' ``AccumulateGrad``
  nodes run as in an ordinary backward, so ``.grad`` and its hooks see the same sums.

torch.distributed.pipelining splits its backward the same way (``stage_backward_input`` and
``stage_backward_weight``, private API); this is the same idea written against public autograd API.
Graphs that cannot be split this way (a weight reaches an output without passing through the input
path, e.g. a stage that returns a parameter) fall back to the whole backward in ``I``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node
from torch.autograd.variable import Variable


@dataclass
class _WeightGroup:
    """Weights whose gradients start from the same boundary nodes."""

    boundaries: list[Node] = field(default_factory=list)
    weights: list[Tensor] = field(default_factory=list)


class DeferredWeightGradients:
    """The ``W`` half of a split backward: call :meth:`run` once."""

    def __init__(self, groups: list[_WeightGroup], recorded: dict[Node, tuple[Tensor | None, ...]]) -> None:
        self._groups = groups
        self._recorded = recorded

    @property
    def device(self) -> torch.device | None:
        """The device of the recorded gradients; ``None`` if none reached this stage's weights."""
        return next((g.device for grads in self._recorded.values() for g in grads if g is not None), None)

    def run(self, one_task: bool | None = None) -> None:
        """Accumulate every weight's gradient into its ``.grad`` and drop the graph.

        Args:
            one_task: make the groups' autograd calls inside one autograd task
                (:func:`in_one_engine_task`); by default on an accelerator (autograd hands a CPU graph
                to no other thread, so there it would only add a node).
        """
        device = self.device
        if device is None:  # no gradient reached this stage's weights
            self._run_groups()
            return
        if one_task is None:
            one_task = device.type != "cpu" and ONE_TASK_ON_DEVICES
        if one_task:
            in_one_engine_task(self._run_groups, device)
        else:
            self._run_groups()

    def _run_groups(self) -> None:
        for group in self._groups:
            edges, grads = [], []
            for node in group.boundaries:
                for index, grad in enumerate(self._recorded.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grads.append(grad)
            if not edges:
                continue  # no gradient reached these weights (an unused branch): as in a full backward
            handles = []
            if len(group.boundaries) > 1:  # one boundary below another: take its recorded sum, not sum + flow
                handles = [node.register_prehook(lambda _, saved=self._recorded.get(node): saved)
                           for node in group.boundaries]
            try:
                _accumulate(edges, grads, group.weights)
            finally:
                for handle in handles:
                    handle.remove()
        self._groups, self._recorded = [], {}


#: Run a device's ``W`` calls inside one autograd task (:func:`in_one_engine_task`); ``False`` makes one
#: task per weight group, for measuring what that costs (benchmarks/gpu.py).
ONE_TASK_ON_DEVICES = True


class _Callback(torch.autograd.Function):
    """A one-node graph whose backward calls ``callback`` (see :func:`in_one_engine_task`)."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, callback: Callable[[], None]) -> Tensor:
        ctx.callback = callback
        return anchor.new_empty(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[None, None]:
        ctx.callback()
        return None, None


def in_one_engine_task(callback: Callable[[], None], device: torch.device) -> None:
    """Call ``callback``, which makes autograd calls on ``device``, as the backward of a one-node graph.

    Autograd runs a CUDA graph on its own thread for the device: each call from the main thread
    hands the task over to that thread and waits to be woken, which cost about 170 us per call on an
    H100's host (a dozen calls per ``W``). Calls made *from* that thread (re-entrant backward, as
    reentrant activation checkpointing makes) run in place, so ``W``'s calls pay one hand-over
    together. Nothing is computed for the graph itself: its tensors are uninitialised scalars.
    """
    anchor = torch.empty((), device=device, requires_grad=True)
    out = _Callback.apply(anchor, callback)
    Variable._execution_engine.run_backward((out,), (torch.empty((), device=device),), False, False, (anchor,), True, False)


def _accumulate(edges: list[GradientEdge], grads: list[Tensor], weights: list[Tensor]) -> None:
    """``torch.autograd.backward(edges, grads, inputs=weights, retain_graph=True)`` without its per-call
    argument checks and conversions: ``W`` makes one call per weight group (a dozen per transformer block
    and micro-batch), and those checks took half of each call's host time (about 55 of 100 us on a CPU
    core). The gradients are the engine's own, recorded in ``I``, so there is nothing to check."""
    Variable._execution_engine.run_backward(  # the call torch.autograd.backward ends in
        tuple(edges), tuple(grads), True, False, tuple(weights), True, True,  # keep graph, no create, accumulate
    )


def backward_input(
    outputs: Sequence[Tensor], grad_outputs: Sequence[Tensor | None], inputs: Sequence[Tensor],
    before_whole_backward: Callable[[], None] | None = None,
) -> tuple[list[Tensor], DeferredWeightGradients | None]:
    """Compute the gradients of ``inputs`` (leaf tensors that require grad) and defer the weights'.

    Returns the inputs' gradients (zeros for an input the outputs do not depend on) and the deferred
    ``W``; ``None`` when the graph cannot be split, in which case the whole backward ran here, after
    ``before_whole_backward`` (the executor waits there for the ``W`` halves still running in the background).
    """
    groups = _weight_groups(outputs, inputs)
    if groups is None:
        if before_whole_backward is not None:
            before_whole_backward()
        torch.autograd.backward(list(outputs), list(grad_outputs))
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs], None
    recorded: dict[Node, tuple[Tensor | None, ...]] = {}
    handles = [node.register_prehook(lambda grads, node=node: recorded.__setitem__(node, grads))
               for group in groups for node in group.boundaries]
    try:
        grads = torch.autograd.grad(list(outputs), list(inputs), list(grad_outputs), retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, inputs)], DeferredWeightGradients(groups, recorded)


def _weight_groups(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> list[_WeightGroup] | None:
    """Group the graph's weights by the boundary nodes their gradients start from (module docstring);
    ``None`` if some weight's path to an output avoids the input path."""
    roots = [t.grad_fn for t in outputs]
    if not inputs or any(root is None for root in roots):
        return None
    parents: dict[Node, list[Node]] = {}
    seen: set[Node] = set(roots)
    queue = list(seen)
    leaves: list[Node] = []
    while queue:
        node = queue.pop()
        if hasattr(node, "variable"):
            leaves.append(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    input_ids = {id(t) for t in inputs}
    input_leaves = [leaf for leaf in leaves if id(leaf.variable) in input_ids]
    weight_leaves = [leaf for leaf in leaves if id(leaf.variable) not in input_ids]
    on_input_path = _ancestors(input_leaves, parents)
    group_of: dict[Node, _WeightGroup] = {}
    for leaf in weight_leaves:
        boundaries = _boundaries(leaf, parents, on_input_path)
        if boundaries is None:
            return None
        merged = {id(g): g for g in (group_of.get(b) for b in boundaries) if g is not None}
        group = _WeightGroup()
        for other in merged.values():
            group.boundaries += other.boundaries
            group.weights += other.weights
        group.boundaries += [b for b in boundaries if b not in group_of]
        group.weights.append(leaf.variable)
        for node in group.boundaries:
            group_of[node] = group
    unique = {id(g): g for g in group_of.values()}
    return list(unique.values())


def _ancestors(starts: list[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``starts`` and every node whose backward leads to one of them."""
    found = set(starts)
    queue = list(starts)
    while queue:
        for parent in parents.get(queue.pop(), ()):
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


def _boundaries(leaf: Node, parents: dict[Node, list[Node]], on_input_path: set[Node]) -> list[Node] | None:
    """The input-path nodes the weight's own sub-graph hangs from; ``None`` if it reaches an output
    without one."""
    boundaries: list[Node] = []
    seen = {leaf}
    queue = [leaf]
    while queue:
        node = queue.pop()
        above = parents.get(node, ())
        if not above:
            return None  # a root off the input path
        for parent in above:
            if parent in seen:
                continue
            seen.add(parent)
            if parent in on_input_path:
                boundaries.append(parent)
            else:
                queue.append(parent)
    return boundaries
