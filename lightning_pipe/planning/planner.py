"""Balanced partitioning and plan search (docs/algorithms.md §12, BaPipe-style).

:func:`~lightning_pipe.partition.balance.min_max_split` is the exact dynamic program for the
bottleneck split of ``L`` layers into ``P`` contiguous stages under per-stage feasibility (memory)
limits. :func:`split_for` builds the per-stage time and memory of the cost model
(:mod:`.costs`) for one schedule and micro-batch count and runs it; :func:`explore` does that for
every allowed schedule and candidate micro-batch count and scores each by the predicted mini-batch
time; :func:`plan` returns the best. Ties go to fewer weight copies, then larger micro-batches, then
lower peak memory. The DP is exact for one chunk per device; for interleaved schedules it is
followed by a boundary-moving descent (see :func:`split_for`). :func:`refine_split` moves layers off
a *measured* bottleneck (docs/algorithms.md §12 step 4).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from lightning_pipe.errors import PlanError
from lightning_pipe.partition.balance import min_max_split
from lightning_pipe.planning.costs import (
    GIB,
    Machine,
    Plan,
    StageCosts,
    StagePlan,
    allowed,
    extra_weight_copies,
    format_bytes,
    in_flight,
    planned_schedules,
    step_time,
)
from lightning_pipe.planning.profile import Profile, interpolate
from lightning_pipe.registry import names


def split_for(
    profile: Profile,
    schedule: str,
    stages: int,
    micro_batches: int,
    machine: Machine = Machine(),
    chunks: int = 2,
    batch: int | None = None,
    min_gain: float = 0.0,
) -> Plan | None:
    """The min-max split of ``profile`` (already at this micro-batch size) for one schedule and ``M``.

    Returns ``None`` when no split fits the memory limits. For ``interleaved_1f1b`` the DP runs
    over ``stages * chunks`` virtual stages (virtual stage ``k`` on device ``k % stages``), each
    chunk limited to ``1/chunks`` of its device's memory; since a device's time is the sum of its
    non-adjacent chunks, which no chain DP captures exactly, the DP's split and the uniform split are
    then improved by moving single boundaries while the predicted mini-batch time drops.

    The uniform split (when it fits) is kept unless the split found is predicted faster by more than
    ``min_gain`` (relative; ``0``: only ties go to it): a smaller predicted gain is noise or the cost
    model's own approximation (e.g. zero-bubble schedules' forward / input-gradient / weight-gradient
    thirds), not a reason to split unevenly.
    """
    costs = StageCosts(profile, schedule, stages, micro_batches, machine, chunks)
    n = len(profile.layers)
    if n < costs.parts:
        return None
    found = min_max_split(n, costs.parts, costs.time, costs.fits)
    if found is None:
        return None
    base, extra = divmod(n, costs.parts)
    uniform = [base + (k < extra) for k in range(costs.parts)]
    if costs.chunks == 1:
        best = costs.plan(found[1], batch)
    else:
        best = min((_descend(costs, counts, batch) for counts in (found[1], uniform) if costs.feasible(counts)),
                   key=lambda p: p.step_time)
    if best.balance == uniform or not costs.feasible(uniform):
        return best
    even = costs.plan(uniform, batch)
    # not the timings' spread as the margin: each layer's cost is its fastest run, far steadier than a
    # round's total, so a margin from the spread would discard clear gains on a loaded machine
    return even if even.step_time <= best.step_time * (1 + min_gain) else best


def _descend(costs: StageCosts, counts: list[int], batch: int | None) -> Plan:
    """Move one boundary by one layer at a time while the predicted mini-batch time drops."""
    best = costs.plan(counts, batch)
    improved = True
    while improved:
        improved = False
        for k in range(len(counts) - 1):
            for shift in (-1, 1):
                trial = list(best.balance)
                trial[k] += shift
                trial[k + 1] -= shift
                if min(trial) < 1 or not costs.feasible(trial):
                    continue
                candidate = costs.plan(trial, batch)
                if candidate.step_time < best.step_time * (1 - 1e-12):
                    best, improved = candidate, True
    return best


def refinement_move(counts: Sequence[int], times: Sequence[float], feasible: Callable[[list[int]], bool]) -> list[int] | None:
    """Section 12 step 4's next split to try, from measured per-stage times: one layer of the measured
    bottleneck stage moved to its faster neighbour (the other one if that does not fit memory);
    ``None`` when the bottleneck holds a single layer or no move fits."""
    slowest = max(range(len(times)), key=lambda d: times[d])
    if counts[slowest] <= 1:
        return None
    for neighbour in sorted((n for n in (slowest - 1, slowest + 1) if 0 <= n < len(counts)), key=lambda n: times[n]):
        trial = list(counts)
        trial[slowest] -= 1
        trial[neighbour] += 1
        if feasible(trial):
            return trial
    return None


def refine_split(
    counts: Sequence[int], measure: Callable[[list[int]], list[float]], feasible: Callable[[list[int]], bool],
    moves: int, report: Callable[[list[int], list[float], bool], None] | None = None,
) -> tuple[list[int], list[float]]:
    """Section 12 step 4: measure ``counts`` (``measure(split)`` gives each stage's time), then move a
    boundary layer away from the measured bottleneck (:func:`refinement_move`) while the measured
    bottleneck shrinks, at most ``moves`` times; a move back to a split already kept ends it (that
    split was slower). Returns the kept split and its measured times; ``report(split, times, kept)``
    hears of every measurement."""
    counts = list(counts)
    times = measure(counts)
    visited = [counts]
    if report is not None:
        report(counts, times, True)
    for _ in range(moves):
        trial = refinement_move(counts, times, feasible)
        if trial is None or trial in visited:
            break
        visited.append(trial)
        trial_times = measure(trial)
        better = max(trial_times) < max(times)
        if report is not None:
            report(trial, trial_times, better)
        if not better:
            break
        counts, times = trial, trial_times
    return counts, times


def smallest_memory(
    profile: Profile, schedule: str, stages: int, micro_batches: int, machine: Machine = Machine(), chunks: int = 2,
    batch: int | None = None,
) -> Plan | None:
    """The split with the smallest peak memory of any (virtual) stage, limits ignored."""
    costs = StageCosts(profile, schedule, stages, micro_batches, machine, chunks)
    if len(profile.layers) < costs.parts:
        return None
    found = min_max_split(len(profile.layers), costs.parts, costs.memory)
    return None if found is None else costs.plan(found[1], batch)


def evaluate(
    profile: Profile,
    schedule: str,
    stages: int,
    micro_batches: int,
    counts: Sequence[int],
    machine: Machine = Machine(),
    chunks: int = 2,
    batch: int | None = None,
) -> Plan:
    """Predictions for a given split (e.g. ``balance="uniform"``); memory limits are not checked."""
    return StageCosts(profile, schedule, stages, micro_batches, machine, chunks).plan(counts, batch)


# ---------------------------------------------------------------------------------- the search
def candidate_micro_batches(batch: int, low: int = 1, high: int | None = None) -> list[int]:
    """Divisors of ``batch`` between ``low`` and ``high`` (default: ``batch``)."""
    high = batch if high is None else high
    return [m for m in range(max(1, low), min(batch, high) + 1) if batch % m == 0]


def better(a: Plan, b: Plan | None) -> bool:
    """Higher throughput; ties (1e-9 relative) to fewer weight copies, then larger micro-batches,
    then lower peak memory."""
    if b is None:
        return True
    if not math.isclose(a.throughput, b.throughput, rel_tol=1e-9):
        return a.throughput > b.throughput
    if a.weight_copies != b.weight_copies:
        return a.weight_copies < b.weight_copies
    if a.micro_batch_size != b.micro_batch_size:
        return a.micro_batch_size > b.micro_batch_size
    return max(a.memory) < max(b.memory)


def explore(
    profiles: Sequence[Profile],
    batch: int,
    stages: int,
    schedules: Sequence[str] = names("synchronous"),
    micro_batches: Sequence[int] | None = None,
    machine: Machine = Machine(),
    chunks: int = 2,
    min_gain: float = 0.0,
) -> dict[str, Plan | None]:
    """The best plan per schedule (``None`` when nothing fits), over candidate ``M``.

    Args:
        profiles: one or two profiles of the trunk at different micro-batch sizes (costs at other
            sizes are interpolated linearly).
        batch: samples per mini-batch ``B``.
        stages: devices per pipeline ``P``.
        schedules: schedules to consider.
        micro_batches: candidate ``M`` (default: every divisor of ``batch``).
        machine: memory limits, speeds and links.
        chunks: chunks per device for ``interleaved_1f1b``.
        min_gain: a split other than the uniform one must be predicted this much faster (relative) to be
            chosen (:func:`split_for`).
    """
    machine.check(stages)
    candidates = list(micro_batches) if micro_batches is not None else candidate_micro_batches(batch)
    scaled = {m: interpolate(profiles, batch / m) for m in candidates}
    result: dict[str, Plan | None] = {}
    for schedule in schedules:
        if schedule not in planned_schedules():
            raise PlanError(f"schedule {schedule!r} is not known; choose among {', '.join(planned_schedules())}.")
        result[schedule] = best_of(
            split_for(scaled[m], schedule, stages, m, machine, chunks, batch, min_gain)
            for m in candidates
            if allowed(schedule, stages, m, len(profiles[0].layers), chunks)
        )
    return result


def best_of(plans: Iterable[Plan | None]) -> Plan | None:
    """The best of ``plans`` by :func:`better` (``None`` entries skipped)."""
    best = None
    for found in plans:
        if found is not None and better(found, best):
            best = found
    return best


def plan(
    profiles: Sequence[Profile],
    batch: int,
    stages: int,
    schedules: Sequence[str] = names("synchronous"),
    micro_batches: Sequence[int] | None = None,
    machine: Machine = Machine(),
    chunks: int = 2,
    min_gain: float = 0.0,
) -> Plan:
    """The best plan over schedules and micro-batch counts (see :func:`explore`); raises
    :class:`PlanError` naming the smallest memory any split needs when nothing fits."""
    best = best_of(explore(profiles, batch, stages, schedules, micro_batches, machine, chunks, min_gain).values())
    if best is not None:
        return best
    raise no_fit_error(len(profiles[0].layers), stages, machine,
                       smallest_need(profiles, batch, stages, schedules, micro_batches, machine, chunks))


def smallest_need(
    profiles: Sequence[Profile],
    batch: int,
    stages: int,
    schedules: Sequence[str] = names("synchronous"),
    micro_batches: Sequence[int] | None = None,
    machine: Machine = Machine(),
    chunks: int = 2,
) -> Plan | None:
    """Over every allowed schedule and candidate ``M``, the split with the smallest peak memory,
    limits ignored (what an error names when nothing fits); ``None`` when no split exists at all."""
    candidates = list(micro_batches) if micro_batches is not None else candidate_micro_batches(batch)
    smallest = None
    for schedule in schedules:
        for m in candidates:
            if allowed(schedule, stages, m, len(profiles[0].layers), chunks):
                option = smallest_memory(interpolate(profiles, batch / m), schedule, stages, m, machine, chunks, batch)
                if option is not None and (smallest is None or _peak(option) < _peak(smallest)):
                    smallest = option
    return smallest


def _peak(plan_: Plan) -> float:
    return max(plan_.memory)


def no_fit_error(layers: int, stages: int, machine: Machine, smallest: Plan | None) -> PlanError:
    """"no split of 12 layers over 4 stages fits 1.0 GiB per device; the smallest needs 1.3 GiB: ..."."""
    caps = [machine.cap(d) for d in range(stages)]
    limit = f"{format_bytes(caps[0])} per device" if len(set(caps)) == 1 else f"[{', '.join(map(format_bytes, caps))}]"
    if smallest is None:
        return PlanError(f"no split of {layers} layers over {stages} stages exists; use at most {layers} stages.")
    return PlanError(
        f"no split of {layers} layers over {stages} stages fits {limit}; the smallest needs {format_bytes(_peak(smallest))}: "
        f"balance={smallest.balance} with schedule={smallest.schedule!r}, micro_batches={smallest.micro_batches}; raise the memory "
        "limit, use more stages or micro-batches, or checkpoint_activations=True."
    )


def fixed_plan(
    profile: Profile,
    schedule: str,
    stages: int,
    micro_batches: int,
    machine: Machine = Machine(),
    chunks: int = 2,
    batch: int | None = None,
    min_gain: float = 0.0,
) -> Plan:
    """The min-max split for a schedule and ``M`` the user chose (what ``balance="auto"`` uses);
    raises :class:`PlanError` when nothing fits. ``min_gain``: see :func:`split_for`."""
    machine.check(stages)
    found = split_for(profile, schedule, stages, micro_batches, machine, chunks, batch, min_gain)
    if found is not None:
        return found
    smallest = smallest_memory(profile, schedule, stages, micro_batches, machine, chunks, batch)
    raise no_fit_error(len(profile.layers), stages, machine, smallest)


__all__ = [
    "GIB", "Machine", "Plan", "PlanError", "StageCosts", "StagePlan", "allowed", "best_of",
    "candidate_micro_batches", "evaluate", "explore", "extra_weight_copies", "fixed_plan", "format_bytes", "in_flight",
    "min_max_split", "no_fit_error", "plan", "planned_schedules", "refine_split", "refinement_move", "smallest_memory",
    "smallest_need", "split_for", "step_time",
]
