"""Who is who: world = pipelines × stages, one process per (pipeline, stage).

Consecutive global ranks form one pipeline (``rank = pipeline * stages + stage``), so a pipeline's
neighbours share a node. Two kinds of groups: a pipeline group (all stages of one pipeline: metric
broadcast) and a stage group (the same stage across pipelines: gradient all-reduce); on NCCL also
a two-rank group per point-to-point channel, a direction of a pair and a message kind (``ChannelGroups``),
and a gloo copy of the pipeline group for Python objects (a checkpoint's stages gathered on rank 0 go
through host memory, never through GPU memory as NCCL's ``gather_object`` would take them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_pipe.engine.p2p import ChannelGroups

#: The groups this process made, per (stages, pipelines, rank, with channel groups), with the world group
#: they were made in: a new Trainer call (fit, validate, test; every one sets the strategy up again) takes
#: them back instead of making new ones, which torch would keep until the process ends (issue 30, hazard 9).
#: A world group destroyed and made again (``destroy_process_group``, then ``init_process_group``) is
#: another object: the groups of the old one are not taken.
_MADE: dict[tuple[int, int, int, bool], tuple[Any, ...]] = {}


@dataclass
class Topology:
    """Placement of this rank.

    Args:
        stages: devices per pipeline.
        pipelines: data-parallel pipeline replicas.
        rank: this process's global rank.
    """

    stages: int
    pipelines: int
    rank: int
    pipeline_group: Any = field(default=None, repr=False)
    stage_group: Any = field(default=None, repr=False)
    channel_groups: Any = field(default=None, repr=False)  # a ChannelGroups on untagged backends
    object_group: Any = field(default=None, repr=False)  # the pipeline group on gloo, for object collectives

    @property
    def world_size(self) -> int:
        return self.stages * self.pipelines

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def pipeline(self) -> int:
        return self.rank // self.stages

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, in stage order."""
        return [self.pipeline * self.stages + s for s in range(self.stages)]

    @property
    def stage_ranks(self) -> list[int]:
        """Global ranks holding this rank's stage, one per pipeline."""
        return [p * self.stages + self.stage for p in range(self.pipelines)]

    def create_groups(self, directional: bool = False, timeout: timedelta | None = None) -> None:
        """Create the pipeline and stage groups (every rank must call this, in the same order), or take
        back those this process made for the same placement (every rank then takes them back: the
        calls match, since every rank's Trainer sets up the same number of times).

        Args:
            directional: also create :attr:`channel_groups`, a two-rank group per pair of neighbours,
                direction and message kind for point-to-point messages (:class:`~lightning_pipe.engine.p2p.ChannelGroups`;
                untagged backends, i.e. NCCL).
            timeout: the groups' timeout for collectives (torch's default when ``None``: 30 min on gloo);
                :meth:`set_timeout` changes it later."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        for stale in [k for k, v in _MADE.items() if v[0] is not dist.group.WORLD]:  # of a destroyed world
            del _MADE[stale]
        key = (self.stages, self.pipelines, self.rank, directional and self.stages > 1)
        made = _MADE.get(key)
        if made is not None:  # made in this process already, for this world
            self.pipeline_group, self.stage_group, self.channel_groups, self.object_group = made[1:]
            if timeout is not None:  # what a new group would have started with
                self.set_timeout(timeout.total_seconds())
            return
        self._make_groups(directional, timeout)
        _MADE[key] = (dist.group.WORLD, self.pipeline_group, self.stage_group, self.channel_groups, self.object_group)

    def _make_groups(self, directional: bool, timeout: timedelta | None) -> None:
        if directional and self.stages > 1:
            self.channel_groups = ChannelGroups.create(timeout, self.stages, self.pipelines)
        on_gloo = dist.get_backend() == "gloo"
        for p in range(self.pipelines):
            ranks = [p * self.stages + s for s in range(self.stages)]
            group = dist.new_group(ranks, timeout=timeout) if self.pipelines > 1 else dist.group.WORLD
            objects = group if on_gloo else dist.new_group(ranks, backend="gloo", timeout=timeout)
            if p == self.pipeline:
                self.pipeline_group, self.object_group = group, objects
        for s in range(self.stages):
            ranks = [p * self.stages + s for p in range(self.pipelines)]
            group = dist.new_group(ranks, timeout=timeout) if self.stages > 1 else dist.group.WORLD
            if s == self.stage:
                self.stage_group = group

    def set_timeout(self, seconds: float) -> None:
        """Bound every later collective of the world and of this rank's pipeline and stage groups by
        ``seconds`` (start-up runs under ``startup_timeout``, training under the longer process-group timeout)."""
        if not dist.is_initialized():
            return
        channels = self.channel_groups
        point_to_point = tuple(channels.groups.values()) if channels else ()
        named = (dist.group.WORLD, self.pipeline_group, self.object_group, self.stage_group, *point_to_point)
        groups = {id(g): g for g in named if g is not None}
        for group in groups.values():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
