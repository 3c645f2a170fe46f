"""Pipeline schedules as data: the IR, one small generator per schedule, and the validator.

This package knows no schedule *names*; :mod:`lightning_pipe.registry` maps each name to its
generator and facts. Here a generator becomes a validated :class:`Schedule`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import lru_cache

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedules.async_core import async_drain, async_window
from lightning_pipe.schedules.avgpipe import MergeCosts, averaging_order, avgpipe_replica, build_avgpipe, merge_replicas
from lightning_pipe.schedules.communication import with_communication
from lightning_pipe.schedules.forward_only import forward_only as forward_only_actions
from lightning_pipe.schedules.gpipe import gpipe
from lightning_pipe.schedules.interleaved import interleaved_1f1b
from lightning_pipe.schedules.ir import STEP, Action, B, F, I, Kind, Placement, Schedule, TimedAction, W
from lightning_pipe.schedules.one_f_one_b import one_f_one_b
from lightning_pipe.schedules.rendezvous import rendezvous_dry_run
from lightning_pipe.schedules.validate import dry_run, validate
from lightning_pipe.schedules.zero_bubble import dualpipev, zb_h1, zbv

#: ``generator(device, stages, micro_batches, chunks)``: a device's compute actions for one flushed step.
Generator = Callable[[int, int, int, int], Iterator[Action]]


@lru_cache(maxsize=128)
def flush_schedule(
    name: str, generator: Generator, stages: int, micro_batches: int, chunks: int = 1, forward_only: bool = False,
    placement: Placement = "loop",
) -> Schedule:
    """Generate, add communication to and validate one flushed step of a synchronous schedule.

    Args:
        name: the schedule's name (carried by the result, e.g. for weight-copy counts).
        generator: the schedule's generator (see :data:`Generator`).
        stages: devices per pipeline.
        micro_batches: micro-batches per training step.
        chunks: chunks (virtual stages) per device.
        forward_only: the evaluation variant (forwards only, same placement of chunks).
        placement: where the chunks sit (:class:`~lightning_pipe.schedules.ir.Schedule`).
    """
    make = (lambda d: forward_only_actions(d, stages, micro_batches, chunks)) if forward_only else (
        lambda d: generator(d, stages, micro_batches, chunks))
    actions = tuple(with_communication(list(make(d)), d, stages, chunks, placement) for d in range(stages))
    schedule = Schedule(name, stages, micro_batches, chunks, actions, forward_only, placement=placement)
    validate(schedule)
    return schedule


def async_schedule(
    name: str, stages: int, micro_batches: int, window: int | None, windows_before_drain: int = 0, size: int | None = None,
) -> Schedule:
    """The actions of one asynchronous window (``window=t``) or of the drain (``window=None``,
    after ``windows_before_drain`` windows). Micro-batch indices are segment-global. ``size``: the
    micro-batches of the window (of the segment's last window, for the drain) when fewer than
    ``micro_batches`` (a short last batch). Every asynchronous schedule shares this order; ``name``
    only labels the result."""
    if window is None:
        compute = [list(async_drain(d, stages, micro_batches, windows_before_drain, size)) for d in range(stages)]
    else:
        compute = [list(async_window(d, stages, micro_batches, window, size)) for d in range(stages)]
    actions = tuple(with_communication(c, d, stages, 1) for d, c in enumerate(compute))
    return Schedule(name, stages, micro_batches, 1, actions, step_every=micro_batches)


@lru_cache(maxsize=64)
def validate_async(name: str, stages: int, micro_batches: int, windows: int = 3, last_size: int | None = None) -> Schedule:
    """Validate a whole segment (``windows`` windows, the last one of ``last_size`` micro-batches, and
    the drain, concatenated) and return it."""
    sizes = [micro_batches] * (windows - 1) + [micro_batches if last_size is None else last_size]
    parts = [async_schedule(name, stages, micro_batches, t, size=sizes[t]) for t in range(windows)]
    parts.append(async_schedule(name, stages, micro_batches, None, windows, size=sizes[-1]))
    actions = tuple(tuple(a for part in parts for a in part.actions[d]) for d in range(stages))
    segment = Schedule(name, stages, sum(sizes), 1, actions, step_every=micro_batches)
    validate(segment, runs=parts)  # NCCL's dry run window by window, as the executor runs them
    return segment


__all__ = [
    "STEP", "Action", "B", "F", "Generator", "I", "Kind", "MergeCosts", "Placement", "Schedule", "ScheduleError",
    "TimedAction", "W",
    "async_drain", "async_schedule", "async_window", "averaging_order", "dualpipev", "avgpipe_replica", "build_avgpipe", "dry_run",
    "flush_schedule", "forward_only_actions", "gpipe", "interleaved_1f1b", "merge_replicas", "one_f_one_b",
    "rendezvous_dry_run", "validate", "validate_async", "with_communication", "zb_h1", "zbv",
]
