"""Checks of a PipeStrategy configuration that run before any process group exists.

Each failure is one :class:`PipeConfigError` sentence that says what to change.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import LightningModule

from lightning_pipe.partition import BalanceError, TrunkError, find_trunk, resolve_balance
from lightning_pipe.schedules import ASYNC_SCHEDULES, SYNC_SCHEDULES


class PipeConfigError(ValueError):
    """A PipeStrategy option does not fit the Trainer or the module."""


SCHEDULE_NAMES = (*SYNC_SCHEDULES, *ASYNC_SCHEDULES, "avgpipe")
#: Schedules whose optimizer steps happen inside the pipeline, not in Lightning's optimizer_step.
STEPS_INSIDE = (*ASYNC_SCHEDULES, "avgpipe")


def check_options(schedule: str, micro_batches: int | str, stages: int | None, pipelines: int, chunks_per_stage: int) -> None:
    """Checks that need neither the Trainer nor the module."""
    if schedule not in SCHEDULE_NAMES:
        raise PipeConfigError(f"schedule={schedule!r} is not available; choose one of {', '.join(SCHEDULE_NAMES)}.")
    if micro_batches == "auto":
        if schedule != "avgpipe":
            raise PipeConfigError(f"micro_batches='auto' needs schedule='avgpipe' (its tuner); give a number for {schedule!r}.")
    elif micro_batches < 1:
        raise PipeConfigError(f"micro_batches={micro_batches} must be at least 1.")
    if stages is not None and stages < 1:
        raise PipeConfigError(f"stages={stages} must be at least 1.")
    if pipelines < 1:
        raise PipeConfigError(f"pipelines={pipelines} must be at least 1.")
    if chunks_per_stage < 1:
        raise PipeConfigError(f"chunks_per_stage={chunks_per_stage} must be at least 1.")
    if schedule != "interleaved_1f1b" and chunks_per_stage != 1:
        raise PipeConfigError(
            f"chunks_per_stage={chunks_per_stage} only applies to schedule='interleaved_1f1b'; leave it at 1 for {schedule!r}."
        )


def check_avgpipe_options(
    schedule: str, parallel_pipelines: int | str, alpha: float | None, period: int, averaging: str, advance: int | str,
    trials: int = 3,
) -> None:
    """avgpipe's own options (other schedules ignore their numbers, but not an ``"auto"``)."""
    for name, value in (("parallel_pipelines", parallel_pipelines), ("advance_forward", advance)):
        if value == "auto" and schedule != "avgpipe":
            raise PipeConfigError(f"{name}='auto' needs schedule='avgpipe' (its tuner); {schedule!r} does not use it.")
    if parallel_pipelines != "auto" and parallel_pipelines < 1:
        raise PipeConfigError(f"parallel_pipelines={parallel_pipelines} must be at least 1 (or 'auto').")
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise PipeConfigError(f"avgpipe_alpha={alpha} must lie in [0, 1] (None picks 0.9 / parallel_pipelines).")
    if period < 1:
        raise PipeConfigError(f"avgpipe_period={period} must be at least 1 (average every that many rounds).")
    if averaging not in ("async", "sync"):
        raise PipeConfigError(f"avgpipe_averaging={averaging!r} must be 'async' or 'sync'.")
    if advance != "auto" and advance < 0:
        raise PipeConfigError(f"advance_forward={advance} must be at least 0 (or 'auto').")
    if trials < 0:
        raise PipeConfigError(f"avgpipe_trials={trials} must be at least 0 (0 or 1: trust the tuner's prediction).")


def check_async_trainer(schedule: str, accumulate_grad_batches: int, optimizers: int) -> None:
    """Asynchronous schedules and avgpipe step inside the pipeline, once per mini-batch, with one optimizer."""
    if schedule not in STEPS_INSIDE:
        return
    if accumulate_grad_batches > 1:
        raise PipeConfigError(
            f"schedule={schedule!r} steps every mini-batch, so accumulate_grad_batches={accumulate_grad_batches} has no "
            "meaning; use more micro_batches or a larger batch instead."
        )
    if optimizers != 1:
        raise PipeConfigError(f"schedule={schedule!r} supports exactly one optimizer; configure_optimizers returned {optimizers}.")


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
    module: LightningModule,
    trunk_name: str | None,
    balance: str | Sequence[int],
    virtual_stages: int,
    schedule: str,
    stages: int,
    micro_batches: int,
) -> list[int]:
    """Checks that need the module; returns the layer count of every virtual stage."""
    if not module.automatic_optimization:
        raise PipeConfigError(
            f"{type(module).__name__} uses manual optimization, which pipeline schedules cannot drive; "
            "set self.automatic_optimization = True or train it with strategy='ddp'."
        )
    if schedule == "pipedream_2bw" and micro_batches < stages:
        raise PipeConfigError(
            f"pipedream_2bw needs micro_batches >= stages (so two weight versions suffice); got micro_batches="
            f"{micro_batches} with {stages} stages: use micro_batches={stages} or more."
        )
    if schedule == "interleaved_1f1b" and micro_batches % stages:
        raise PipeConfigError(
            f"interleaved_1f1b needs micro_batches to be a multiple of stages; micro_batches={micro_batches} with "
            f"{stages} stages: use micro_batches={stages * max(1, round(micro_batches / stages))}."
        )
    try:
        _, trunk = find_trunk(module, trunk_name)
        return resolve_balance(balance, trunk, virtual_stages)
    except (TrunkError, BalanceError) as error:
        raise PipeConfigError(str(error)) from None
