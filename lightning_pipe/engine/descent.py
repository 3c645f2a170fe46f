"""``descent_ratio``: how much of a fresh gradient's descent the update from a stage's stale gradient keeps
(docs/metrics.md).

``grad_cosine`` compares gradients; training applies the optimizer's *update*, and an optimizer can amplify a
small turn of the gradient or damp it. Adam divides every coordinate by its own running scale, so a stale error in
a coordinate whose gradient is small becomes a full-size step; momentum and Muon's orthogonalised update spread it
out. On the micro-batch ``grad_cosine`` measures, with its stale gradient ``g_s`` and its gradient ``g_f`` at the
weights the STEP updates::

    descent_ratio = <g_f, U(g_s)> / <g_f, U(g_f)>

where ``U(g)`` is the change the stage's optimizer would make to those weights from its current state, were
``M * g`` the step's gradient (a step sums ``M`` micro-batches' gradients). The numerator is the first-order
change of the micro-batch's loss under the stale update, the denominator under the fresh one: 1 means the
staleness costs that micro-batch no descent to first order, 0.7 that the stale update keeps 70 % of it, a
negative value that it climbs.

``U`` is found by trial: the stage's own optimizer steps on copies of the weights and of its state, swapped into its
parameter groups for the trial (:func:`stepping_copies`); the real weights, gradients and state are never touched,
so training is bit-identical with the measurement on. The learning-rate factor of a
delay-scaled warm-up and clipping are left out: both trials would share them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor


@contextmanager
def stepping_copies(optimizer: torch.optim.Optimizer, tensors: Sequence[Tensor]) -> Iterator[list[Tensor]]:
    """Within the block ``optimizer`` holds copies of ``tensors`` (with copies of their state) and no-gradient
    placeholders for its other parameters; the block gets the copies. Afterwards it holds its own parameters
    again. Its real weights, their gradients (a step's partial sum among them) and its state are never
    touched, so no version counter moves and no graph in flight is disturbed."""
    copies = {id(t): t.detach().clone().requires_grad_(True) for t in tensors}
    originals = [group["params"] for group in optimizer.param_groups]
    placeholder = {}
    for group in optimizer.param_groups:
        group["params"] = [copies[id(p)] if id(p) in copies else placeholder.setdefault(id(p), p.new_empty(0))
                           for p in group["params"]]
    for t in tensors:
        if t in optimizer.state:
            optimizer.state[copies[id(t)]] = {key: value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)
                                              for key, value in optimizer.state[t].items()}
    try:
        yield [copies[id(t)] for t in tensors]
    finally:
        for group, params in zip(optimizer.param_groups, originals):
            group["params"] = params
        for stand_in in [*copies.values(), *placeholder.values()]:
            optimizer.state.pop(stand_in, None)


def trial_update(optimizer: torch.optim.Optimizer, tensors: Sequence[Tensor], gradient: Sequence[Tensor | None],
                 scale: float) -> list[Tensor]:
    """The change ``optimizer.step()`` would make to ``tensors`` (some of its parameters) from its current state,
    were ``scale * gradient`` their gradients and no other parameter's gradient set (:func:`stepping_copies`)."""
    with stepping_copies(optimizer, tensors) as copies:
        for c, grad in zip(copies, gradient):
            c.grad = None if grad is None else (grad.detach() * scale).to(c.dtype)
        optimizer.step()
        return [c.detach() - t.detach() for c, t in zip(copies, tensors)]


def descent_ratio(optimizer: torch.optim.Optimizer, tensors: Sequence[Tensor], stale: Sequence[Tensor | None],
                  fresh: Sequence[Tensor | None], scale: float) -> Tensor | None:
    """``<fresh, U(stale)> / <fresh, U(fresh)>`` (module docstring) as a 0-d float32 tensor on the weights' device
    (no host synchronisation); ``None`` when the fresh gradient has no entry. ``tensors`` are the weights the
    optimizer steps, in the order of the gradients."""
    present = [i for i, g in enumerate(fresh) if g is not None]
    if not present:
        return None
    stale_update = trial_update(optimizer, tensors, stale, scale)
    fresh_update = trial_update(optimizer, tensors, fresh, scale)

    def first_order(update: list[Tensor]) -> Tensor:
        return torch.stack([(fresh[i].float() * update[i].float()).sum() for i in present]).sum()

    return first_order(stale_update) / first_order(fresh_update)
