"""Every schedule lightning_pipe offers, one row each: the only place schedule names are written.

Whatever needs a schedule by name reads this table: the strategy (the names Lightning accepts, the
option checks, which runtime trains it), the planner and ``lightning-pipe plan``, the simulator and
the pictures. A new schedule is one generator file under :mod:`lightning_pipe.schedules` (plus a
weight policy under :mod:`lightning_pipe.engine.policies` if it needs one) and one row here
(docs/architecture.md shows it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from lightning_pipe.engine.policies import (
    DoubleBufferPolicy,
    ElasticAveraging,
    PipeMarePolicy,
    StashPolicy,
    WeightPolicy,
    XPipePolicy,
)
from lightning_pipe.errors import PipeConfigError
from lightning_pipe.schedules import (
    Generator,
    Placement,
    Schedule,
    build_avgpipe,
    dualpipev,
    flush_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    validate_async,
    zb_h1,
    zbv,
)

Family = Literal["synchronous", "asynchronous", "averaging"]
#: ``copies(stage, stages, micro_batches, replicas)``: weight-sized copies a device holds, its own weights included.
Copies = Callable[[int, int, int, int], int]
#: ``requirement(stages, micro_batches)``: why the schedule cannot run this shape, or ``None``.
Requirement = Callable[[int, int], "str | None"]


def _tau_bar(stage: int, stages: int, micro_batches: int) -> int:
    """Most optimizer steps between a micro-batch's forward and backward (docs/algorithms.md §5)."""
    return math.ceil((stages - 1 - stage) / micro_batches)


def _one_copy(stage: int, stages: int, micro_batches: int, replicas: int) -> int:
    return 1


def _no_requirement(stages: int, micro_batches: int) -> str | None:
    return None


@dataclass(frozen=True)
class ScheduleSpec:
    """What lightning_pipe knows about one schedule.

    Args:
        name: the strategy name (``Trainer(strategy=name)``) and ``PipeStrategy(schedule=name)``.
        family: ``"synchronous"`` (flushes every step; equals one device), ``"asynchronous"`` (the
            async 1F1B core of docs/algorithms.md §5 with a weight policy; steps inside the pipeline)
            or ``"averaging"`` (avgpipe's parallel pipelines).
        description: one line, shown by Lightning's strategy registry.
        generator: synchronous schedules: a device's compute actions for one flushed step.
        policy: asynchronous and averaging schedules: the weight policy.
        weight_copies: weight-sized copies per device, at most (docs/algorithms.md §11; docs/memory.md
            measures what the policies hold).
        requirement: a shape (stages, micro-batches) the schedule cannot run, in words that say what to change.
        default_chunks: chunks (virtual stages) per device when ``chunks_per_stage`` is not given; only a
            schedule with more than one may take ``chunks_per_stage > 1``.
        flush_with: the synchronous schedule that runs where a flushed step is needed: evaluation, an
            asynchronous schedule's synchronous warm-up, short measurements at setup (``None``: itself).
        placement: where a device's chunks sit among the virtual stages (``"loop"``, or ``"v"``:
            :class:`~lightning_pipe.schedules.ir.Schedule`).
        fixed_chunks: the only chunk count the schedule runs (``zbv``: 2), if it has one.
        split_backward: the schedule splits each backward into ``I`` and ``W`` (zero-bubble).
    """

    name: str
    family: Family
    description: str
    generator: Generator | None = None
    policy: type[WeightPolicy] | None = None
    weight_copies: Copies = _one_copy
    requirement: Requirement = _no_requirement
    default_chunks: int = 1
    flush_with: str | None = None
    placement: Placement = "loop"
    fixed_chunks: int | None = None
    split_backward: bool = False

    @property
    def synchronous(self) -> bool:
        return self.family == "synchronous"

    @property
    def flushed(self) -> str:
        """The synchronous schedule that runs this schedule's flushed steps (see ``flush_with``)."""
        return self.flush_with or self.name

    @property
    def steps_inside(self) -> bool:
        """Whether optimizer steps happen inside the pipeline (not in Lightning's ``optimizer_step``)."""
        return self.family != "synchronous"

    @property
    def recomputes_activations(self) -> bool:
        """Whether ``checkpoint_activations=True`` keeps the schedule's rule: not with a split backward (each of its
        autograd passes would recompute) nor a live weight policy (no copy of a forward's weights to recompute on)."""
        return not self.split_backward and (self.policy is None or self.policy.keeps_forward_weights)

    @property
    def chunked(self) -> bool:
        """Whether the schedule places several chunks (virtual stages) on a device."""
        return self.default_chunks > 1

    def check(self, stages: int, micro_batches: int) -> None:
        """Raise :class:`PipeConfigError` if the schedule cannot run ``micro_batches`` on ``stages`` stages."""
        problem = self.requirement(stages, micro_batches)
        if problem is not None:
            raise PipeConfigError(problem)

    def build(self, stages: int, micro_batches: int, chunks: int = 1, forward_only: bool = False) -> Schedule:
        """The validated action lists: one flushed step (synchronous; ``forward_only`` for evaluation),
        a segment of three windows and the drain (asynchronous), or one round of two replicas (averaging)."""
        if self.generator is not None:
            return flush_schedule(self.name, self.generator, stages, micro_batches, chunks, forward_only, self.placement)
        if self.family == "asynchronous":
            return validate_async(self.name, stages, micro_batches)
        return build_avgpipe(stages, micro_batches, 2)


def _interleaved_requirement(stages: int, micro_batches: int) -> str | None:
    if micro_batches % stages == 0:
        return None
    return (f"interleaved_1f1b needs micro_batches to be a multiple of stages; micro_batches={micro_batches} with "
            f"{stages} stages: use micro_batches={stages * max(1, round(micro_batches / stages))}.")


def _dualpipev_requirement(stages: int, micro_batches: int) -> str | None:
    if micro_batches >= 2 * stages:
        return None
    return (f"dualpipev needs micro_batches >= 2 * stages; got micro_batches={micro_batches} with {stages} stages: "
            f"use micro_batches={2 * stages} or more.")


def _double_buffer_requirement(stages: int, micro_batches: int) -> str | None:
    if micro_batches >= stages:
        return None
    return (f"pipedream_2bw needs micro_batches >= stages (so two weight versions suffice); got micro_batches="
            f"{micro_batches} with {stages} stages: use micro_batches={stages} or more.")


#: ``PipeStrategy``'s default schedule, and the flushed one of those that do not flush.
DEFAULT = "1f1b"

SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("gpipe", "synchronous", "GPipe pipeline: all forwards, then all backwards, one step per batch",
                 generator=lambda d, p, m, v: gpipe(d, p, m)),
    ScheduleSpec("1f1b", "synchronous",
                 "1F1B (PipeDream-Flush) pipeline: GPipe's result with at most one micro-batch per stage in flight",
                 generator=lambda d, p, m, v: one_f_one_b(d, p, m)),
    ScheduleSpec("interleaved_1f1b", "synchronous", "interleaved 1F1B pipeline: several chunks per device, a smaller bubble",
                 generator=interleaved_1f1b, requirement=_interleaved_requirement, default_chunks=2),
    ScheduleSpec("zb_h1", "synchronous",
                 "ZB-H1 zero-bubble pipeline: 1F1B with the backward split into input and weight gradients, "
                 "the weight gradients filling the bubble",
                 generator=lambda d, p, m, v: zb_h1(d, p, m), split_backward=True),
    ScheduleSpec("zbv", "synchronous",
                 "ZBV zero-bubble pipeline: two chunks per device in a V, split backward, almost no bubble",
                 generator=zbv, default_chunks=2, placement="v", fixed_chunks=2, split_backward=True),
    ScheduleSpec("dualpipev", "synchronous",
                 "DualPipeV pipeline: zbv's V with whole backwards in the steady state, split ones only at its ends",
                 generator=dualpipev, default_chunks=2, placement="v", fixed_chunks=2, split_backward=True,
                 requirement=_dualpipev_requirement),
    ScheduleSpec("pipedream", "asynchronous", "asynchronous PipeDream pipeline with weight stashing (no flush)",
                 policy=StashPolicy, flush_with=DEFAULT, weight_copies=lambda s, p, m, n: _tau_bar(s, p, m) + 2),
    ScheduleSpec("pipedream_2bw", "asynchronous",
                 "asynchronous PipeDream-2BW pipeline: double-buffered 1-stale weights (no flush)",
                 # the weights, two versions, and the look-ahead's W(v-1) (one less with lookahead=0)
                 policy=DoubleBufferPolicy, flush_with=DEFAULT, weight_copies=lambda s, p, m, n: 4,
                 requirement=_double_buffer_requirement),
    ScheduleSpec("pipemare", "asynchronous",
                 "asynchronous PipeMare pipeline: lr rescheduling and discrepancy correction, no stash",
                 policy=PipeMarePolicy, flush_with=DEFAULT, weight_copies=lambda s, p, m, n: 3),
    ScheduleSpec("xpipe", "asynchronous", "asynchronous XPipe pipeline: weight prediction from the optimizer state",
                 policy=XPipePolicy, flush_with=DEFAULT, weight_copies=lambda s, p, m, n: 4),
    ScheduleSpec("avgpipe", "averaging", "AvgPipe: parallel pipelines on the same devices joined by elastic averaging",
                 policy=ElasticAveraging, flush_with=DEFAULT, weight_copies=lambda s, p, m, n: n + 1),
)}

#: Every schedule name, in the order of :data:`SCHEDULES`.
NAMES: tuple[str, ...] = tuple(SCHEDULES)
#: ``PipeStrategy(schedule=...)``'s type: the names, as LightningCLI shows and checks them.
ScheduleName = Literal[NAMES]  # type: ignore[valid-type]


def names(family: Family | None = None) -> tuple[str, ...]:
    """The schedule names, or those of one family."""
    return tuple(name for name, spec in SCHEDULES.items() if family is None or spec.family == family)


def spec(name: str) -> ScheduleSpec:
    """The row of ``name``; an unknown name is a :class:`PipeConfigError` that lists the choices."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise PipeConfigError(f"schedule={name!r} is not available; choose one of {', '.join(NAMES)}.") from None


def build_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1, forward_only: bool = False) -> Schedule:
    """The validated action lists of a synchronous schedule's flushed step (see :meth:`ScheduleSpec.build`)."""
    row = spec(name)
    if not row.synchronous:
        raise PipeConfigError(f"{name!r} is not a flushing schedule; build_schedule takes one of {', '.join(names('synchronous'))}.")
    if chunks != 1 and not row.chunked:
        raise PipeConfigError(f"schedule {name!r} runs one chunk per device; got chunks={chunks}.")
    if row.fixed_chunks is not None and chunks != row.fixed_chunks:
        raise PipeConfigError(f"schedule {name!r} runs exactly {row.fixed_chunks} chunks per device; got chunks={chunks}.")
    return row.build(stages, micro_batches, chunks, forward_only)


def weight_copies(name: str, stages: int, micro_batches: int, replicas: int = 1) -> list[int]:
    """Weight copies of every device (the module's own weights included); ``[]`` for an unknown name."""
    row = SCHEDULES.get(name)
    return [row.weight_copies(s, stages, micro_batches, replicas) for s in range(stages)] if row else []


__all__ = ["DEFAULT", "NAMES", "SCHEDULES", "Family", "ScheduleName", "ScheduleSpec", "build_schedule", "names", "spec", "weight_copies"]
