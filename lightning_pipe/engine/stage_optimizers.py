"""Each emulated stage's own optimizer, as its own process would hold it (docs/emulation.md).

One process emulating ``P`` stages splits the user's optimizer into one share per stage (same class,
param groups, hyperparameters and state): :func:`stage_optimizer`; a step-interval lr scheduler is
copied per stage (:func:`stage_scheduler`); and :class:`HyperparameterMirror` carries what Lightning
changes in the user's optimizer (an lr scheduler it steps) to every share, as each process's own
scheduler would change its own optimizer.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.optim import CombinedOptimizer


def group_names(optimizer: torch.optim.Optimizer, module: torch.nn.Module, aliases: Mapping[int, str] | None = None) -> list[list[str]]:
    """The parameter names of each of ``optimizer``'s param groups: ``module``'s own names (frozen parameters too), and
    ``aliases`` (``id`` -> name) for tensors it steps in their place (a live policy's master copies)."""
    names = {id(p): n for n, p in module.named_parameters()}
    names.update(aliases or {})
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def stage_optimizer(optimizer: torch.optim.Optimizer, names: set[str], name_of: dict[int, str]) -> torch.optim.Optimizer:
    """An optimizer of the same class over the parameters in ``names``: the same param groups (empty
    ones kept, so group indices and schedulers line up), hyperparameters and per-parameter state; a
    :class:`~lightning_pipe.optim.CombinedOptimizer` gets one of each member."""
    if isinstance(optimizer, CombinedOptimizer):
        return CombinedOptimizer(*(stage_optimizer(member, names, name_of) for member in optimizer.optimizers))
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [p for p in group["params"] if name_of.get(id(p)) in names]}
        for group in optimizer.param_groups
    ]
    try:
        stage = type(optimizer)(groups, **optimizer.defaults)
    except TypeError:  # an optimizer whose defaults are not all constructor arguments
        stage = type(optimizer)(groups)
    for group in groups:
        for p in group["params"]:
            if p in optimizer.state:
                stage.state[p] = optimizer.state[p]
    return stage


def stage_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, stage_optimizer_: torch.optim.Optimizer) -> Any:
    """A copy of ``scheduler`` (its state included) that drives ``stage_optimizer_`` instead of ``optimizer``."""
    copied = copy.deepcopy(scheduler, {id(optimizer): stage_optimizer_})
    if getattr(copied, "_step_count", 0) == 1:
        copied._step_count = 2  # torch's "scheduler stepped before optimizer" check concerns the original
    return copied


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # values without a plain truth value count as changed
        return False


class HyperparameterMirror:
    """Carries the hyperparameters Lightning changes in ``original`` (an lr scheduler it steps) to the
    stages' optimizers, which replace it from now on.

    Args:
        original: the optimizer ``configure_optimizers`` returned (Lightning's schedulers drive it).
        copies: the stages' optimizers, made by :func:`stage_optimizer` (same param groups).
    """

    def __init__(self, original: torch.optim.Optimizer, copies: Sequence[torch.optim.Optimizer]) -> None:
        self.original = original
        self.copies = list(copies)
        self._seen = [hyperparameters(group) for group in original.param_groups]
        # the stages step their shares from now on; torch's "scheduler stepped before optimizer"
        # warning for a scheduler of the original would be misleading
        original._opt_called = True

    def follow(self) -> None:
        """Hand every hyperparameter changed since the last call to every stage's optimizer."""
        for g, group in enumerate(self.original.param_groups):
            now = hyperparameters(group)
            changed = {k: v for k, v in now.items() if k not in self._seen[g] or not _same(v, self._seen[g][k])}
            for optimizer in self.copies:
                optimizer.param_groups[g].update(changed)
            self._seen[g] = now
