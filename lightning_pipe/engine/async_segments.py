"""An asynchronous schedule across training steps: the window counter, the weight policy, the drain.

Within a segment micro-batches stream through the pipeline without a flush (docs/algorithms.md §5):
each training step runs one window, and a drain at the segment's end finishes what is in flight.
The caller decides *when* to run a window or drain; this object knows *how*."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.engine.executor import Executor, RunOptions
from lightning_pipe.engine.policies import AsyncOptions, Clip, WeightPolicy
from lightning_pipe.engine.policies.base import PolicyStates
from lightning_pipe.schedules import async_schedule, validate_async


class AsyncSegments(PolicyStates):
    """Runs windows of an asynchronous schedule and drains it.

    Args:
        name: the schedule's name (labels the action lists).
        policy_class: the schedule's weight policy (:mod:`lightning_pipe.engine.policies`).
        executor: this rank's executor (its ``policy`` is set here).
        stage: this rank's stage; ``stages``: stages per pipeline.
        micro_batches: micro-batches per window (fixed within a segment).
    """

    def __init__(
        self, name: str, policy_class: type[WeightPolicy], executor: Executor, stage: int, stages: int, micro_batches: int,
    ) -> None:
        validate_async(name, stages, micro_batches)
        self.name = name
        self.policy_class = policy_class
        self.executor = executor
        self.stage, self.stages, self.micro_batches = stage, stages, micro_batches
        self.window = 0
        self.short: int | None = None  # micro-batches of a short last window, which ends the segment
        self.policy: WeightPolicy | None = None
        self.policies: list[WeightPolicy] = []  # of every stage this process runs
        self._restore: dict[str, Any] | None = None  # a checkpoint's (merged) policy state, loaded at start

    def start(
        self, root: nn.Module, optimizer: torch.optim.Optimizer, options: AsyncOptions, scheduler: Any | None,
        clip: Clip | None, steps_done: int,
    ) -> WeightPolicy:
        """Create the weight policy (at the first asynchronous step; ``steps_done`` on resume)."""
        policy = self.policy_class(root, optimizer, self.stage, self.stages, self.micro_batches, options, scheduler, clip)
        policy.begin(steps_done)
        self.policy = self.executor.policy = policy
        self.policies = [policy]
        self.load_restored()
        return policy

    def run_window(self, micro_batches: Sequence[Any], weights: Sequence[float], scale_loss: Any = None) -> list[Any]:
        """Feed one batch's micro-batches into the stream. Fewer than ``micro_batches`` (a short last
        batch) make a short mini-batch that ends the segment: :meth:`drain` must come next."""
        if self.short is not None:
            raise RuntimeError("a short window ends its segment; drain() before the next window.")
        size = len(micro_batches)
        if not 0 < size <= self.micro_batches:
            raise ValueError(f"a window takes 1 to {self.micro_batches} micro-batches, got {size}.")
        if size < self.micro_batches:
            validate_async(self.name, self.stages, self.micro_batches, self.window + 1, size)
            self.short = size
        schedule = async_schedule(self.name, self.stages, self.micro_batches, self.window, size=size)
        window = RunOptions(loss_weights=weights, scale_loss=scale_loss,
                            first_micro_batch=self.window * self.micro_batches, carry_over=True)
        outputs = self.executor.run(schedule, micro_batches, window)
        self.window += 1
        return outputs

    @property
    def in_flight(self) -> bool:
        return self.window > 0

    def drain(self) -> None:
        """Run the outstanding backwards and STEPs; every stage ends with the same STEP count."""
        if not self.window:
            return
        drain = async_schedule(self.name, self.stages, self.micro_batches, None, self.window, size=self.short)
        self.executor.run(drain, [], RunOptions(carry_over=True))
        self.executor.finish()
        for policy in self.policies:
            policy.end_segment(self.window)
        self.window = 0
        self.short = None
