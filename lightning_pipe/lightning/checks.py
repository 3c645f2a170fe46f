"""Checks of a ``PipeStrategy`` against the Trainer and the module, before any process group exists.

Each failure is one :class:`~lightning_pipe.errors.PipeConfigError` sentence that says what to change.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import LightningModule

from lightning_pipe.errors import PipeConfigError
from lightning_pipe.partition import find_trunk, resolve_balance
from lightning_pipe.registry import ScheduleSpec


def resolve_stages(world_size: int, stages: int | None, pipelines: int) -> int:
    """The number of stages per pipeline, checked against the number of processes.

    One process with ``stages > 1`` (and one pipeline) emulates the pipeline in that process.
    """
    if world_size == 1 and pipelines == 1 and stages is not None:
        return stages
    if stages is None:
        if world_size % pipelines:
            raise PipeConfigError(
                f"{world_size} processes (devices × num_nodes) cannot form {pipelines} pipelines; "
                f"use a multiple of {pipelines} devices or change pipelines."
            )
        return world_size // pipelines
    if stages * pipelines != world_size:
        raise PipeConfigError(
            f"stages={stages} × pipelines={pipelines} needs {stages * pipelines} processes but the Trainer has "
            f"{world_size} (devices × num_nodes); set devices={stages * pipelines} or change stages/pipelines."
        )
    return stages


def check_module(
    module: LightningModule, trunk_name: str | None, balance: str | Sequence[int], virtual_stages: int, schedule: ScheduleSpec,
    stages: int, micro_batches: int,
) -> list[int]:
    """Checks that need the module; returns the layer count of every virtual stage."""
    if not module.automatic_optimization:
        raise PipeConfigError(
            f"{type(module).__name__} uses manual optimization, which pipeline schedules cannot drive; "
            "set self.automatic_optimization = True or train it with strategy='ddp'."
        )
    schedule.check(stages, micro_batches)
    _, trunk = find_trunk(module, trunk_name)
    return resolve_balance(balance, trunk, virtual_stages)


def check_trainer(schedule: ScheduleSpec, accumulate_grad_batches: int, optimizers: int) -> None:
    """Schedules that step inside the pipeline do so once per mini-batch, with one optimizer."""
    if not schedule.steps_inside:
        return
    if accumulate_grad_batches > 1:
        raise PipeConfigError(
            f"schedule={schedule.name!r} steps every mini-batch, so accumulate_grad_batches={accumulate_grad_batches} has no "
            "meaning; use more micro_batches or a larger batch instead."
        )
    if optimizers != 1:
        raise PipeConfigError(f"schedule={schedule.name!r} supports exactly one optimizer; configure_optimizers returned {optimizers}.")
