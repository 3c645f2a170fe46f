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

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.engine.async_segments import AsyncSegments
from lightning_pipe.engine.local import LocalPipeline
from lightning_pipe.engine.policies import AsyncOptions, Clip, WeightPolicy
from lightning_pipe.engine.stage_optimizers import HyperparameterMirror, group_names, stage_optimizer, stage_scheduler
from lightning_pipe.schedules import validate_async


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
        self._mirror: HyperparameterMirror | None = None

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
        # what an epoch-interval lr scheduler changes in Lightning's optimizer reaches every stage
        self._mirror = HyperparameterMirror(optimizer, self.optimizers)
        return self.policies

    def _follow_original(self) -> None:
        """Hyperparameters Lightning changed in its optimizer since the last look go to every stage's
        optimizer, as each process's scheduler would change its own."""
        if self._mirror is not None:
            self._mirror.follow()

    def run_window(self, micro_batches: Sequence[Any], weights: Sequence[float], scale_loss: Any = None) -> list[Any]:
        self._follow_original()
        return super().run_window(micro_batches, weights, scale_loss)

    def drain(self) -> None:
        if self.window:
            self._follow_original()
        super().drain()

    def param_names(self, stage: int) -> list[list[str]]:
        """Parameter names of every param group of ``stage``'s optimizer (masters named like their parameter; frozen
        parameters, which the policy leaves alone, too)."""
        policy = self.policies[stage]
        masters = {id(m): n for n, m in getattr(policy, "masters", {}).items()}
        return group_names(self.optimizers[stage], policy.root, masters)

    def optimizer_parts(self) -> list[tuple[dict[str, Any], list[list[str]]]]:
        """Every stage's optimizer state and :meth:`param_names`, as each process would save its own: with what
        Lightning changed in its optimizer since the last window (an lr scheduler stepped at the epoch's end)
        handed over first, as each process's own scheduler has already applied it."""
        self._follow_original()
        return [(optimizer.state_dict(), self.param_names(s)) for s, optimizer in enumerate(self.optimizers)]
