"""Balanced partitioning and plan search (docs/algorithms.md §12, BaPipe-style).

:func:`min_max_split` is the exact dynamic program for the bottleneck split of ``L`` layers into
``P`` contiguous stages under per-stage feasibility (memory) limits. :func:`split_for` builds the
per-stage time and memory of section 12 for one schedule and micro-batch count and runs it;
:func:`explore` does that for every allowed schedule and candidate micro-batch count and scores each
by the predicted mini-batch time; :func:`plan` returns the best.

Cost model (per stage ``d`` holding layers ``i..j-1``, from per-layer :class:`Profile` entries at the
micro-batch size ``b = B / M``, interpolated linearly between two profiled sizes):

* time ``t = sum(f + g) / sigma_d`` plus, unless it is the last stage, ``2 * (latency + o / bandwidth)``
  for the activation out and the gradient back (``max`` of the two instead of the sum when
  ``overlap``);
* memory ``(c_S(d) - 1 + kappa) * sum(p) + n_S(d, M) * sum(a) + 2 * (boundary outputs in and out)``,
  with ``c_S`` the weight copies and ``n_S`` the micro-batches in flight of the schedule
  (section 11, the counts docs/memory.md measures).

Mini-batch time from the stage times ``t_d`` and bottleneck ``t*``: flushing schedules
``(M-1) t* + sum t_d``; interleaved ``M t* + (sum t_d - t*) / v`` with ``t_d`` the device's chunks
together; asynchronous schedules ``M t*``. Ties go to fewer weight copies, then larger micro-batches,
then lower peak memory. The DP is exact for one chunk per device; for interleaved schedules it is
followed by a boundary-moving descent (see :func:`split_for`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

from lightning_pipe.errors import PlanError
from lightning_pipe.partition.balance import min_max_split
from lightning_pipe.planning.profile import Profile, interpolate
from lightning_pipe.registry import SCHEDULES, build_schedule, names
from lightning_pipe.schedules.ir import Kind

GIB = float(2**30)
#: The schedules the planner compares (avgpipe is tuned apart: docs/algorithms.md §13).
PLANNED_SCHEDULES = (*names("synchronous"), *names("asynchronous"))


@dataclass(frozen=True)
class StagePlan:
    """One (virtual) stage of a plan.

    Args:
        device: the process (pipeline stage) that runs it.
        chunk: which of that device's chunks (``0`` except for interleaved schedules).
        start: first trunk layer.
        end: one past the last trunk layer.
        params: parameter bytes.
        time: predicted forward + backward (+ transfer) seconds per micro-batch.
        memory: predicted peak bytes (weights, gradients, optimizer state, activations, buffers).
    """

    device: int
    chunk: int
    start: int
    end: int
    params: int
    time: float
    memory: float


@dataclass(frozen=True)
class Plan:
    """A schedule, micro-batch count and split with its predictions.

    Args:
        schedule: schedule name.
        micro_batches: micro-batches per mini-batch ``M``.
        micro_batch_size: samples per micro-batch ``b``.
        balance: layer count per (virtual) stage, pipeline order.
        stages: per (virtual) stage predictions.
        step_time: predicted seconds per mini-batch.
        throughput: predicted samples per second.
        weight_copies: most weight copies any device keeps (``c_S``).
        memory: predicted peak bytes per device.
    """

    schedule: str
    micro_batches: int
    micro_batch_size: float
    balance: list[int]
    stages: list[StagePlan]
    step_time: float
    throughput: float
    weight_copies: int
    memory: list[float] = field(default_factory=list)

    @property
    def bottleneck(self) -> float:
        return max(s.time for s in self.stages)


def format_bytes(value: float) -> str:
    """``512 B``, ``3.2 KiB``, ``1.5 MiB``, ``2.0 GiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


# ---------------------------------------------------------------------------------- schedules
def extra_weight_copies(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Weight-sized tensors beyond the module's own parameters (``c_S(d) - 1``; docs/memory.md)."""
    row = SCHEDULES.get(schedule)
    return row.weight_copies(stage, stages, micro_batches, 1) - 1 if row else 0


@lru_cache(maxsize=256)
def in_flight(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> tuple[tuple[int, ...], ...]:
    """Peak micro-batches in flight (forward done, backward not) per device and chunk (``n_S``)."""
    if SCHEDULES[schedule].family == "asynchronous":
        return tuple((stages - d,) for d in range(stages))
    result = []  # counted on the schedule's own lists: M for gpipe, min(P - d, M) for 1f1b, ...
    for actions in build_schedule(schedule, stages, micro_batches, chunks).actions:
        now, peak = [0] * chunks, [0] * chunks
        for action in actions:
            if action.kind is Kind.FORWARD:
                now[action.chunk] += 1
                peak[action.chunk] = max(peak[action.chunk], now[action.chunk])
            elif action.kind is Kind.BACKWARD:
                now[action.chunk] -= 1
        result.append(tuple(peak))
    return tuple(result)


def allowed(schedule: str, stages: int, micro_batches: int, layers: int, chunks: int) -> bool:
    """Whether the schedule can run this configuration at all (the strategy's own checks)."""
    row = SCHEDULES[schedule]
    if row.requirement(stages, micro_batches) is not None:
        return False
    if row.chunked:
        return stages > 1 and layers >= stages * chunks
    return layers >= stages


def step_time(schedule: str, times: Sequence[float], device_times: Sequence[float], micro_batches: int, chunks: int) -> float:
    """Predicted mini-batch time (section 12 step 2)."""
    if SCHEDULES[schedule].family == "asynchronous":
        return micro_batches * max(times)
    if SCHEDULES[schedule].chunked:
        worst = max(device_times)
        return micro_batches * worst + (sum(device_times) - worst) / chunks
    worst = max(times)
    return (micro_batches - 1) * worst + sum(times)


# ---------------------------------------------------------------------------------- one split
@dataclass(frozen=True)
class Machine:
    """The devices and links a plan runs on.

    Args:
        memory: bytes per device (one value for all, or one per stage); ``None``: unlimited.
        speeds: relative speed per device (``sigma_d``; profile device = 1.0).
        bandwidth: bytes per second between neighbouring stages; ``None``: transfers cost nothing.
        latency: seconds per transfer.
        overlap: transfers overlap compute (stage time is the max, not the sum).
        kappa: bytes of weights + gradient + optimizer state per parameter byte (4 for fp32 Adam,
            3 for SGD with momentum).
        recompute: activations are recomputed in backward (``checkpoint_activations=True``): a stage
            keeps only its input per micro-batch in flight plus one micro-batch's saved tensors, and
            its backward runs the forward again.
    """

    memory: float | Sequence[float] | None = None
    speeds: Sequence[float] | None = None
    bandwidth: float | None = None
    latency: float = 0.0
    overlap: bool = False
    kappa: float = 4.0
    recompute: bool = False

    def check(self, stages: int) -> None:
        """Per-device lists must have one entry per stage; speeds must be positive."""
        for name, values in (("memory", self.memory), ("speeds", self.speeds)):
            if isinstance(values, Sequence) and len(values) != stages:
                raise PlanError(f"{name} has {len(values)} entries but the pipeline has {stages} stages; give one per stage.")
        if self.speeds is not None and min(self.speeds) <= 0:
            raise PlanError(f"speeds {list(self.speeds)} must all be positive.")

    def cap(self, device: int) -> float:
        if self.memory is None:
            return math.inf
        return float(self.memory[device] if isinstance(self.memory, Sequence) else self.memory)

    def speed(self, device: int) -> float:
        return float(self.speeds[device]) if self.speeds is not None else 1.0


class StageCosts:
    """Section 12's per-stage time and memory for one profile, schedule and ``M`` (``O(1)`` each).

    Stage ``k`` (virtual stage for interleaved schedules, on device ``k % stages``) holds layers
    ``i..j-1``.
    """

    def __init__(self, profile: Profile, schedule: str, stages: int, micro_batches: int, machine: Machine, chunks: int = 2):
        self.profile, self.schedule, self.stages, self.micro_batches, self.machine = profile, schedule, stages, micro_batches, machine
        self.chunks = chunks if SCHEDULES[schedule].chunked else 1
        self.parts = stages * self.chunks
        layers = profile.layers
        again = 2.0 if machine.recompute else 1.0
        self.comp = [0.0, *accumulate(again * l.forward + l.backward for l in layers)]
        self.params = [0, *accumulate(l.params for l in layers)]
        self.saved = [0.0, *accumulate(float(l.saved) for l in layers)]
        self.outputs = [profile.input_bytes, *(l.output for l in layers)]  # outputs[j]: the value after layer j-1
        self.flight = in_flight(schedule, stages, micro_batches, self.chunks)
        self.extra = [extra_weight_copies(schedule, d, stages, micro_batches) for d in range(stages)]

    def where(self, k: int) -> tuple[int, int]:
        return k % self.stages, k // self.stages

    def time(self, i: int, j: int, k: int) -> float:
        machine = self.machine
        compute = (self.comp[j] - self.comp[i]) / machine.speed(k % self.stages)
        if k == self.parts - 1 or machine.bandwidth is None:
            return compute
        transfer = 2 * (machine.latency + self.outputs[j] / machine.bandwidth)
        return max(compute, transfer) if machine.overlap else compute + transfer

    def memory(self, i: int, j: int, k: int) -> float:
        device, chunk = self.where(k)
        buffers = 2 * ((self.outputs[i] if k > 0 else 0) + (self.outputs[j] if k < self.parts - 1 else 0))
        return ((self.extra[device] + self.machine.kappa) * (self.params[j] - self.params[i])
                + self._activations(i, j, self.flight[device][chunk]) + buffers)

    def _activations(self, i: int, j: int, in_flight: int) -> float:
        if self.machine.recompute:  # inputs of the micro-batches in flight, one backward's worth of saved tensors
            return in_flight * self.outputs[i] + (self.saved[j] - self.saved[i])
        return in_flight * (self.saved[j] - self.saved[i])

    def fits(self, i: int, j: int, k: int) -> bool:
        return self.memory(i, j, k) <= self.machine.cap(k % self.stages) / self.chunks

    def feasible(self, counts: Sequence[int]) -> bool:
        """Whether every stage of the split fits its memory limit."""
        bounds = [0, *accumulate(counts)]
        return all(self.fits(bounds[k], bounds[k + 1], k) for k in range(self.parts))

    def plan(self, counts: Sequence[int], batch: int | None = None) -> Plan:
        """The predictions for ``counts`` layers per (virtual) stage."""
        stages, bounds = [], [0, *accumulate(counts)]
        for k in range(self.parts):
            i, j = bounds[k], bounds[k + 1]
            device, chunk = self.where(k)
            stages.append(StagePlan(device, chunk, i, j, self.params[j] - self.params[i], self.time(i, j, k), self.memory(i, j, k)))
        device_times = [sum(s.time for s in stages if s.device == d) for d in range(self.stages)]
        device_memory = [sum(s.memory for s in stages if s.device == d) for d in range(self.stages)]
        m = self.micro_batches
        total = step_time(self.schedule, [s.time for s in stages], device_times, m, self.chunks)
        samples = batch if batch is not None else m * self.profile.micro_batch
        return Plan(self.schedule, m, samples / m, list(counts), stages, total,
                    samples / total if total > 0 else math.inf, 1 + max(self.extra), device_memory)


def split_for(
    profile: Profile,
    schedule: str,
    stages: int,
    micro_batches: int,
    machine: Machine = Machine(),
    chunks: int = 2,
    batch: int | None = None,
) -> Plan | None:
    """The min-max split of ``profile`` (already at this micro-batch size) for one schedule and ``M``.

    Returns ``None`` when no split fits the memory limits. For ``interleaved_1f1b`` the DP runs
    over ``stages * chunks`` virtual stages (virtual stage ``k`` on device ``k % stages``), each
    chunk limited to ``1/chunks`` of its device's memory; since a device's time is the sum of its
    non-adjacent chunks, which no chain DP captures exactly, the DP's split and the uniform split are
    then improved by moving single boundaries while the predicted mini-batch time drops.
    """
    costs = StageCosts(profile, schedule, stages, micro_batches, machine, chunks)
    n = len(profile.layers)
    if n < costs.parts:
        return None
    found = min_max_split(n, costs.parts, costs.time, costs.fits)
    if found is None:
        return None
    if costs.chunks == 1:
        return costs.plan(found[1], batch)
    base, extra = divmod(n, costs.parts)
    starts = [found[1], [base + (k < extra) for k in range(costs.parts)]]
    return min((_descend(costs, counts, batch) for counts in starts if costs.feasible(counts)), key=lambda p: p.step_time)


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
    """
    machine.check(stages)
    candidates = list(micro_batches) if micro_batches is not None else candidate_micro_batches(batch)
    scaled = {m: interpolate(profiles, batch / m) for m in candidates}
    result: dict[str, Plan | None] = {}
    for schedule in schedules:
        if schedule not in PLANNED_SCHEDULES:
            raise PlanError(f"schedule {schedule!r} is not known; choose among {', '.join(PLANNED_SCHEDULES)}.")
        result[schedule] = best_of(
            split_for(scaled[m], schedule, stages, m, machine, chunks, batch)
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
) -> Plan:
    """The best plan over schedules and micro-batch counts (see :func:`explore`); raises
    :class:`PlanError` naming the smallest memory any split needs when nothing fits."""
    best = best_of(explore(profiles, batch, stages, schedules, micro_batches, machine, chunks).values())
    if best is not None:
        return best
    candidates = list(micro_batches) if micro_batches is not None else candidate_micro_batches(batch)
    smallest = None
    for schedule in schedules:
        for m in candidates:
            if allowed(schedule, stages, m, len(profiles[0].layers), chunks):
                option = smallest_memory(interpolate(profiles, batch / m), schedule, stages, m, machine, chunks, batch)
                if option is not None and (smallest is None or _peak(option) < _peak(smallest)):
                    smallest = option
    raise no_fit_error(len(profiles[0].layers), stages, machine, smallest)


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
) -> Plan:
    """The min-max split for a schedule and ``M`` the user chose (what ``balance="auto"`` uses);
    raises :class:`PlanError` when nothing fits."""
    machine.check(stages)
    found = split_for(profile, schedule, stages, micro_batches, machine, chunks, batch)
    if found is not None:
        return found
    smallest = smallest_memory(profile, schedule, stages, micro_batches, machine, chunks, batch)
    raise no_fit_error(len(profile.layers), stages, machine, smallest)
