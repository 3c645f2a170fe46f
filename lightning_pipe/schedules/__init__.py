"""Pipeline schedules as data: generators of per-device action lists, and their validator."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import lru_cache

from lightning_pipe.schedules.async_core import async_drain, async_window
from lightning_pipe.schedules.avgpipe import MergeCosts, averaging_order, avgpipe_replica, build_avgpipe, merge_replicas
from lightning_pipe.schedules.communication import with_communication
from lightning_pipe.schedules.forward_only import forward_only as forward_only_actions
from lightning_pipe.schedules.gpipe import gpipe
from lightning_pipe.schedules.interleaved import interleaved_1f1b
from lightning_pipe.schedules.ir import STEP, Action, B, F, Kind, Schedule
from lightning_pipe.schedules.one_f_one_b import one_f_one_b
from lightning_pipe.schedules.validate import ScheduleError, dry_run, validate

#: Synchronous (flushing) schedules: one optimizer step per training step, equal to one device.
SYNC_SCHEDULES: dict[str, Callable[..., Iterator[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
}


@lru_cache(maxsize=64)
def build_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1, forward_only: bool = False) -> Schedule:
    """Generate, add communication to and validate the named schedule.

    Args:
        name: one of :data:`SYNC_SCHEDULES`.
        stages: devices per pipeline.
        micro_batches: micro-batches per training step.
        chunks: chunks per device (only ``interleaved_1f1b`` uses more than one).
        forward_only: the evaluation variant (forwards only, same placement of chunks).
    """
    if name not in SYNC_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SYNC_SCHEDULES)}.")
    if chunks != 1 and name != "interleaved_1f1b":
        raise ValueError(f"schedule {name!r} runs one chunk per device; got chunks={chunks}.")
    if forward_only:
        compute = [list(forward_only_actions(d, stages, micro_batches, chunks)) for d in range(stages)]
    elif name == "interleaved_1f1b":
        compute = [list(interleaved_1f1b(d, stages, micro_batches, chunks)) for d in range(stages)]
    else:
        compute = [list(SYNC_SCHEDULES[name](d, stages, micro_batches)) for d in range(stages)]
    actions = tuple(with_communication(c, d, stages, chunks) for d, c in enumerate(compute))
    schedule = Schedule(name, stages, micro_batches, chunks, actions, forward_only)
    validate(schedule)
    return schedule


#: Asynchronous schedules: the async 1F1B core with a weight policy each (engine/weights.py).
ASYNC_SCHEDULES = ("pipedream", "pipedream_2bw", "pipemare", "xpipe")


def async_schedule(name: str, stages: int, micro_batches: int, window: int | None, windows_before_drain: int = 0) -> Schedule:
    """The actions of one asynchronous window (``window=t``) or of the drain (``window=None``,
    after ``windows_before_drain`` windows). Micro-batch indices are segment-global."""
    if window is None:
        compute = [list(async_drain(d, stages, micro_batches, windows_before_drain)) for d in range(stages)]
    else:
        compute = [list(async_window(d, stages, micro_batches, window)) for d in range(stages)]
    actions = tuple(with_communication(c, d, stages, 1) for d, c in enumerate(compute))
    return Schedule(name, stages, micro_batches, 1, actions, step_every=micro_batches)


@lru_cache(maxsize=64)
def validate_async(name: str, stages: int, micro_batches: int, windows: int = 3) -> Schedule:
    """Validate a whole segment (``windows`` windows and the drain, concatenated) and return it."""
    parts = [async_schedule(name, stages, micro_batches, t) for t in range(windows)]
    parts.append(async_schedule(name, stages, micro_batches, None, windows))
    actions = tuple(tuple(a for part in parts for a in part.actions[d]) for d in range(stages))
    segment = Schedule(name, stages, micro_batches * windows, 1, actions, step_every=micro_batches)
    validate(segment)
    return segment


__all__ = [
    "ASYNC_SCHEDULES", "async_schedule", "validate_async",
    "MergeCosts", "averaging_order", "avgpipe_replica", "build_avgpipe", "merge_replicas",
    "STEP", "Action", "B", "F", "Kind", "Schedule", "ScheduleError", "SYNC_SCHEDULES",
    "build_schedule", "dry_run", "forward_only_actions", "gpipe", "interleaved_1f1b", "one_f_one_b", "validate",
    "with_communication",
]
