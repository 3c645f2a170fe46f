"""avgpipe across training steps: the merged schedule, the replicas' policy, one round per batch.

The caller decides *when* (one round per training batch); this object knows *how* (docs/algorithms.md §10).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.engine.executor import Executor, RunOptions
from lightning_pipe.engine.policies import AvgPipeOptions, Clip, ElasticAveraging
from lightning_pipe.engine.policies.base import PolicyStates
from lightning_pipe.engine.stage import batch_size, split_micro_batches
from lightning_pipe.errors import PipeConfigError, ScheduleError
from lightning_pipe.schedules import Schedule, build_avgpipe, validate


def keeps_one_fifo_order(stages: int, micro_batches: int, replicas: int, advance: int) -> bool:
    """Whether the merged round keeps one FIFO order across replicas on every link, as an untagged
    backend (NCCL) needs."""
    try:
        validate(build_avgpipe(stages, micro_batches, replicas, advance), replica_channels=False)
    except ScheduleError:
        return False
    return True


class AvgPipeRounds(PolicyStates):
    """Runs avgpipe rounds on one rank.

    Args:
        executor: this rank's executor (its policy is set only while a round runs, so evaluation
            runs on the center copy the module's parameters point at).
        stage: this rank's stage; ``stages``: stages per pipeline.
        options: the avgpipe options.
        tagged: whether the backend matches messages by tag (gloo); untagged backends need the
            merged order to keep one FIFO order across replicas, which is checked here.
    """

    def __init__(self, executor: Executor, stage: int, stages: int, options: AvgPipeOptions, tagged: bool = True) -> None:
        self.executor = executor
        self.stage, self.stages = stage, stages
        self.options = options
        self.tagged = tagged
        self.policy: ElasticAveraging | None = None
        self.policies: list[ElasticAveraging] = []  # of every stage this process runs
        self._checked: set[int] = set()
        self._restore: dict[str, Any] | None = None  # a checkpoint's replicas, loaded at start

    def split(self, batch: Any, micro_batches: int, first: bool) -> tuple[list[Any], int]:
        """The batch's ``N`` replica mini-batches, each split into micro-batches (replica-major), and the
        micro-batches per replica: ``micro_batches``, or fewer for a short last batch (not the ``first``)."""
        replicas = self.options.parallel_pipelines
        parts = split_micro_batches(batch, replicas)
        smallest = min(batch_size(p) for p in parts)
        if smallest < micro_batches and first or smallest == 0:
            raise PipeConfigError(
                f"a batch of {batch_size(batch)} samples cannot feed parallel_pipelines={replicas} × micro_batches="
                f"{micro_batches}; use a batch size of at least {replicas * micro_batches} (the batch holds every "
                "replica's mini-batch)" + (" or drop_last=True in the DataLoader." if not first else ".")
            )
        count = min(micro_batches, smallest)
        return [mb for part in parts for mb in split_micro_batches(part, count)], count

    def loss_weights(self, sizes: Sequence[int], count: int) -> list[float]:
        """Each micro-batch's share of its replica's mini-batch, so every replica's gradient is its own mean."""
        replicas = range(self.options.parallel_pipelines)
        return [s / sum(sizes[r * count:(r + 1) * count]) for r in replicas for s in sizes[r * count:(r + 1) * count]]

    def schedule(self, micro_batches: int) -> Schedule:
        """The merged schedule of a round with ``micro_batches`` micro-batches per replica."""
        schedule = build_avgpipe(self.stages, micro_batches, self.options.parallel_pipelines, self.options.advance_forward)
        if not self.tagged and micro_batches not in self._checked:
            try:
                validate(schedule, replica_channels=False)
            except ScheduleError as error:
                raise ScheduleError(
                    f"{error} An untagged backend (NCCL) needs one FIFO order across avgpipe replicas; use gloo, "
                    "parallel_pipelines=1 or another micro_batches."
                ) from None
            self._checked.add(micro_batches)
        return schedule

    def start(
        self, root: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int,
        clip: Clip | None, gradient_group: Any, gradient_world: int,
    ) -> ElasticAveraging:
        """Create the replicas and the center from the module's current weights (at the first training
        step), then load a checkpoint's replicas if :meth:`restore` was given some."""
        o = self.options
        self.policy = ElasticAveraging(
            root, optimizer, self.stage, self.stages, micro_batches, o.parallel_pipelines, o.resolved_alpha, o.period,
            o.averaging, clip, gradient_group, gradient_world,
        )
        self.policies = [self.policy]
        self.load_restored()
        return self.policy

    @property
    def used_names(self) -> set[str]:
        """The parameters that received a gradient on this process's stages."""
        return set().union(*(policy.used_names for policy in self.policies))

    def run_round(self, micro_batches: Sequence[Any], weights: Sequence[float], count: int) -> list[Any]:
        """One round: every replica's ``count`` micro-batches (replica-major), STEPs and AVGs."""
        self.executor.policy = self.policy
        try:
            return self.executor.run(self.schedule(count), micro_batches, RunOptions(loss_weights=weights))
        finally:
            self.executor.policy = None
