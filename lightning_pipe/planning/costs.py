"""The planner's cost model (docs/algorithms.md §12): what a split costs in time and memory.

Per stage ``d`` holding layers ``i..j-1``, from per-layer :class:`~.profile.Profile` entries at the
micro-batch size ``b = B / M`` (interpolated linearly between two profiled sizes):

* time ``t = sum(f + g) / sigma_d`` plus, unless it is the last stage, ``2 * (latency + o / bandwidth)``
  for the activation out and the gradient back (``max`` of the two instead of the sum when
  ``overlap``);
* memory ``(c_S(d) - 1 + kappa) * sum(p) + n_S(d, M) * sum(a) + 2 * (boundary outputs in and out)``,
  with ``c_S`` the weight copies and ``n_S`` the micro-batches in flight of the schedule
  (docs/algorithms.md §11; docs/memory.md measures them).

Mini-batch time from the stage times ``t_d`` and bottleneck ``t*``: flushing schedules
``(M-1) t* + sum t_d``; interleaved ``M t* + (sum t_d - t*) / v`` with ``t_d`` the device's chunks
together; asynchronous schedules ``M t*``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

from lightning_pipe.errors import PlanError
from lightning_pipe.planning.profile import Profile
from lightning_pipe.registry import SCHEDULES, build_schedule
from lightning_pipe.schedules.ir import Kind, locate_virtual_stage
from lightning_pipe.sim.simulate import Costs, simulate

GIB = float(2**30)


def planned_schedules() -> tuple[str, ...]:
    """The schedules the split search compares (avgpipe is tuned apart: docs/algorithms.md §13)."""
    return tuple(name for name, row in SCHEDULES.items() if row.family != "averaging")


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
            elif action.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):  # a split backward frees at W
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
    """Predicted mini-batch time (section 12 step 2). Zero-bubble schedules have no closed form: their
    lists are simulated with each virtual stage's time split as forward 1/3, ``I`` 1/3, ``W`` 1/3 (a
    backward costs about two forwards, half of it for the weights)."""
    row = SCHEDULES[schedule]
    if row.split_backward:
        stages = len(device_times)
        plan = build_schedule(schedule, stages, micro_batches, chunks if row.chunked else 1)
        return simulate(plan, Costs([t / 3 for t in times], [2 * t / 3 for t in times])).step_time
    if row.family == "asynchronous":
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
        """Per-device lists must have one entry per stage; speeds, memory, bandwidth and kappa must be positive."""
        for name, values in (("memory", self.memory), ("speeds", self.speeds)):
            if isinstance(values, Sequence) and len(values) != stages:
                raise PlanError(f"{name} has {len(values)} entries but the pipeline has {stages} stages; give one per stage.")
        if self.speeds is not None and min(self.speeds) <= 0:
            raise PlanError(f"speeds {list(self.speeds)} must all be positive.")
        if self.memory is not None and min(self.memory if isinstance(self.memory, Sequence) else [self.memory]) <= 0:
            raise PlanError(f"the memory limit {self.memory} must be positive (bytes per device); None for no limit.")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise PlanError(f"bandwidth {self.bandwidth} must be positive (bytes per second); None for free transfers.")
        if self.latency < 0 or self.kappa <= 0:
            raise PlanError(f"latency {self.latency} must be at least 0 and kappa {self.kappa} positive.")

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
        return locate_virtual_stage(k, self.stages, SCHEDULES[self.schedule].placement)

    def time(self, i: int, j: int, k: int) -> float:
        machine = self.machine
        compute = (self.comp[j] - self.comp[i]) / machine.speed(self.where(k)[0])
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
        return self.memory(i, j, k) <= self.machine.cap(self.where(k)[0]) / self.chunks

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
