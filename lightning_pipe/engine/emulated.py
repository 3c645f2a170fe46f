"""Asynchronous segments of a whole pipeline emulated in one process (docs/emulation.md).

Every stage runs through :class:`~lightning_pipe.engine.local.LocalPipeline`: the distributed run's
executors, schedules and weight policies, connected by in-process queues. Each stage gets what a
separate process would have:

* its own share of the parameters: its trunk layers, plus the parameters outside the trunk that its
  part of the step uses (the caller finds them);
* its own optimizer over that share (same class, param groups and state as Lightning's), its own
  copy of a step-interval lr scheduler, and its own weight policy, which STEPs it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.engine.async_segments import AsyncSegments
from lightning_pipe.engine.local import LocalPipeline
from lightning_pipe.engine.policies import AsyncOptions, Clip, WeightPolicy
from lightning_pipe.optim import CombinedOptimizer
from lightning_pipe.schedules import validate_async


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


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
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


class EmulatedAsyncSegments(AsyncSegments):
    """:class:`~.async_segments.AsyncSegments` for every stage of one pipeline in this process.

    Args:
        name: the asynchronous schedule; ``policy_class``: its weight policy.
        pipeline: the in-process pipeline (its executors get one policy each).
        stages: stages emulated; ``micro_batches``: per window.
    """

    def __init__(self, name: str, policy_class: type[WeightPolicy], pipeline: LocalPipeline, stages: int, micro_batches: int) -> None:
        super().__init__(name, policy_class, pipeline, 0, stages, micro_batches)  # type: ignore[arg-type]
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any | None] = []
        self.stage_names: list[set[str]] = []

    def start_stages(
        self, root: nn.Module, optimizer: torch.optim.Optimizer, options: AsyncOptions, scheduler: Any | None,
        clip: Clip | None, steps_done: int, stage_names: list[set[str]],
    ) -> list[WeightPolicy]:
        """Split ``optimizer`` (and ``scheduler``) by stage and create every stage's policy."""
        validate_async(self.name, self.stages, self.micro_batches)
        name_of = {id(p): n for n, p in root.named_parameters()}
        self.stage_names = stage_names
        self.optimizers = [stage_optimizer(optimizer, names, name_of) for names in stage_names]
        self.schedulers = [None if scheduler is None else stage_scheduler(scheduler, optimizer, o) for o in self.optimizers]
        self.policies = []
        for s, (names, stage_opt, stage_sched) in enumerate(zip(stage_names, self.optimizers, self.schedulers)):
            policy = self.policy_class(root, stage_opt, s, self.stages, self.micro_batches, options, stage_sched, clip, names=names)
            policy.begin(steps_done)
            self.executor.executors[s].policy = policy
            self.policies.append(policy)
        self.policy = self.policies[0]
        self.load_restored()
        self._original = optimizer
        # the stages step their shares from now on; torch's "scheduler stepped before optimizer"
        # warning for an epoch-interval scheduler of this optimizer would be misleading
        optimizer._opt_called = True
        self._seen = [_hyperparameters(group) for group in optimizer.param_groups]
        return self.policies

    def _follow_original(self) -> None:
        """Hyperparameters Lightning changed in its optimizer since the last look (an epoch-interval
        lr scheduler stepped it) go to every stage's optimizer, as each process's scheduler would."""
        for g, group in enumerate(self._original.param_groups):
            now = _hyperparameters(group)
            changed = {k: v for k, v in now.items() if k not in self._seen[g] or not _same(v, self._seen[g][k])}
            for optimizer in self.optimizers:
                optimizer.param_groups[g].update(changed)
            self._seen[g] = now

    def run_window(self, micro_batches: Sequence[Any], weights: Sequence[float], scale_loss: Any = None) -> list[Any]:
        self._follow_original()
        return super().run_window(micro_batches, weights, scale_loss)

    def drain(self) -> None:
        if self.window:
            self._follow_original()
        super().drain()

    def param_names(self, stage: int) -> list[list[str]]:
        """Parameter names of every param group of ``stage``'s optimizer (masters named like their parameter)."""
        policy, optimizer = self.policies[stage], self.optimizers[stage]
        names = {id(p): n for n, p in policy.params.items()}
        names.update({id(m): n for n, m in getattr(policy, "masters", {}).items()})
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
