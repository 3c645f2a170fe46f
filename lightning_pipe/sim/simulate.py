"""Discrete-event simulation of a schedule's action lists: step time, bubble, memory.

The simulator reads the very lists the executor runs (:mod:`lightning_pipe.schedules.ir`), so any
schedule the executor accepts, including merged per-device lists of several pipelines, can be
simulated before anything is launched.

Model (the assumptions behind every number here):

* every device runs its list in order, one action at a time, starting at time 0;
* a forward of virtual stage ``vs`` takes ``costs.forward[vs]``, a backward ``costs.backward[vs]``,
  a STEP ``costs.step``; sends and receives take no compute time. A split backward's ``W`` takes
  the share ``costs.weight_share[vs]`` of the backward and its ``I`` the rest, except on the first
  virtual stage, whose ``I`` has no input gradient to compute: its ``W`` is the whole backward;
* a message is available to its receiver ``transfer[i]`` seconds after the sender reaches its SEND
  (or, in lists without communication actions, after the producing forward/backward ends); ``i`` is
  the boundary ``i -> i+1`` it crosses (activation forward, gradient backward, same time);
* sends never block the sender (the executor's sends are asynchronous); a receive, or a compute
  action whose input has not arrived, waits; messages never contend for a link (no bandwidth
  sharing) and a device's compute is not slowed by communication in the background;
* a micro-batch's activations are held from the start of its forward to the end of its backward
  (of its ``W``, in a split one: the weight gradients need the layers' inputs; forward-only lists:
  only during the forward).

Dependencies are keyed by ``(virtual stage, micro-batch)`` (and ``replica``, for actions that carry
one), never by schedule name, so lists with any micro-batch numbering work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_pipe.errors import ScheduleError
from lightning_pipe.registry import SCHEDULES, weight_copies
from lightning_pipe.schedules import Action, Kind, Placement, Schedule, TimedAction, async_schedule, validate_async
from lightning_pipe.schedules.ir import locate_virtual_stage, virtual_stage_of


@dataclass(frozen=True)
class Costs:
    """Durations in seconds, per virtual stage (``len = stages * chunks``).

    Args:
        forward: forward time of one micro-batch on each virtual stage.
        backward: backward time of one micro-batch on each virtual stage.
        transfer: one-way time of a message across boundary ``i -> i+1`` (activation forward,
            gradient backward); ``()`` means 0. Length ``virtual_stages - 1`` (a trailing entry
            for the last stage is ignored).
        step: time of one optimizer STEP action on a device.
        weight_share: per virtual stage, the share of the backward a split backward's ``W`` (the
            weights' gradients) takes; ``()`` means 0.5 everywhere: a linear layer's input and weight
            gradients are one matrix product each, of the same size.
    """

    forward: Sequence[float]
    backward: Sequence[float]
    transfer: Sequence[float] = ()
    step: float = 0.0
    weight_share: Sequence[float] = ()

    def __post_init__(self) -> None:
        if len(self.forward) != len(self.backward):
            raise ValueError(
                f"Costs has {len(self.forward)} forward and {len(self.backward)} backward times; give one of each per virtual stage."
            )
        if any(t < 0 for t in (*self.forward, *self.backward, *self.transfer, self.step)):
            raise ValueError("Costs must not be negative; pass durations in seconds.")
        if any(not 0.0 <= share <= 1.0 for share in self.weight_share):
            raise ValueError("Costs.weight_share holds shares of the backward, between 0 and 1.")

    @classmethod
    def uniform(
        cls, virtual_stages: int, forward: float, backward: float, transfer: float = 0.0, step: float = 0.0
    ) -> Costs:
        """The same forward, backward and transfer time on every virtual stage."""
        return cls(
            (forward,) * virtual_stages, (backward,) * virtual_stages, (transfer,) * max(virtual_stages - 1, 0), step
        )

    def share(self, virtual_stage: int) -> float:
        """The share of ``virtual_stage``'s backward its ``W`` takes (see ``weight_share``)."""
        return self.weight_share[virtual_stage] if virtual_stage < len(self.weight_share) else 0.5

    def link(self, boundary: int) -> float:
        """One-way transfer time across ``boundary -> boundary+1``."""
        return self.transfer[boundary] if boundary < len(self.transfer) else 0.0

    def duration(self, action: Action, virtual_stage: int) -> float:
        """Compute time of ``action`` (0 for communication)."""
        if action.kind is Kind.FORWARD:
            return self.forward[virtual_stage]
        if action.kind is Kind.BACKWARD:
            return self.backward[virtual_stage]
        if action.kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT):
            share = 1.0 if virtual_stage == 0 else self.share(virtual_stage)
            weight = self.backward[virtual_stage] * share
            return weight if action.kind is Kind.BACKWARD_WEIGHT else self.backward[virtual_stage] - weight
        if action.kind is Kind.STEP:
            return self.step
        return 0.0


@dataclass
class Simulation:
    """What :func:`simulate` predicts.

    Attributes:
        events: every action of every device with its simulated start and end.
        step_time: seconds per training step (flushing schedules: the makespan; asynchronous
            schedules: the steady-state time per window of ``M`` micro-batches).
        bubble_fraction: ``1 - sum(busy) / (devices * step_time)``: the idle share of device time.
        busy: per device, seconds of compute (forward, backward, STEP) per step.
        peak_activations: per device, the most micro-batches (per chunk) whose activations are held
            at once.
        weight_copies: per device, weight-sized copies of the stage from docs/algorithms.md §11
            (the module's own weights included), by schedule name; see :func:`weight_copies`.
    """

    events: list[TimedAction]
    step_time: float
    bubble_fraction: float
    busy: list[float]
    peak_activations: list[int]
    weight_copies: list[int] = field(default_factory=list)

    def describe(self) -> str:
        """A few lines for a console: step time, bubble, per-device busy time and memory."""
        lines = [f"step time {self.step_time * 1e3:.3f} ms, bubble {self.bubble_fraction:.1%}"]
        for d, busy in enumerate(self.busy):
            copies = f", {self.weight_copies[d]} weight copies" if self.weight_copies else ""
            lines.append(
                f"  stage {d}: busy {busy * 1e3:.3f} ms, peak activations {self.peak_activations[d]} micro-batches{copies}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------- measured costs
_SENT_BY = {Kind.RECV_ACTIVATION: (Kind.SEND_ACTIVATION, -1), Kind.RECV_GRADIENT: (Kind.SEND_GRADIENT, +1)}


def measured_costs(
    events: Sequence[TimedAction], stages: int, chunks: int = 1, steps: Sequence[int] | None = None,
    placement: Placement = "loop",
) -> Costs:
    """The costs a measured run shows, to simulate other schedules or micro-batch counts with them.

    ``events`` are the recorded actions of one pipeline (``PipeStrategy(trace_dir=...)``'s
    ``events-rank{r}.json`` through :func:`lightning_pipe.sim.tracing.events_from_rows`, or an
    ``ActionRecorder``), ``device`` being the rank; devices ``>= stages`` (other data-parallel
    pipelines) are ignored. Per virtual stage, forward and backward are the medians of the recorded
    ones, each with the median time it took to post the message it sends; ``step`` is the slowest
    device's median STEP (0 for synchronous schedules under Lightning, whose optimizer steps outside
    the schedule). The transfer time of a boundary is the median delay from a send being posted to
    its receive finishing, over the receives that were already waiting when it was posted. When none
    was, it is the shortest such delay over the later receives: each bounds the transfer from above
    (the message was there by the time that receive ended), the shortest is the tightest bound, and
    with it no receive would have waited longer than it did; 0 without any receive. ``steps``
    (parallel to ``events``) tells apart micro-batches of different training steps that share a
    number. A split backward's ``I`` and ``W`` add up to the backward, and ``W``'s median share of it
    is ``weight_share``. ``placement``: the schedule's (``"v"`` for ``zbv``).
    """
    steps = list(steps) if steps is not None else [0] * len(events)
    virtual = stages * chunks
    durations: dict[tuple[Kind, int], list[float]] = {}
    sends: dict[tuple[Kind, int, int, int | None, int], TimedAction] = {}
    for event, step in zip(events, steps):
        if event.device >= stages:
            continue
        vs = virtual_stage_of(event.device, event.action.chunk, stages, placement)
        durations.setdefault((event.action.kind, vs), []).append(event.duration)
        if event.action.kind.is_send:
            sends[(event.action.kind, vs, step, event.action.micro_batch, event.action.replica)] = event
    delays: dict[int, list[float]] = {}  # from receives already waiting when the send was posted
    bounds: dict[int, list[float]] = {}  # from later receives: the message took at most this long
    for event, step in zip(events, steps):
        if event.device >= stages or event.action.kind not in _SENT_BY:
            continue
        kind, direction = _SENT_BY[event.action.kind]
        vs = virtual_stage_of(event.device, event.action.chunk, stages, placement)
        send = sends.get((kind, vs + direction, step, event.action.micro_batch, event.action.replica))
        if send is not None:
            waiting = event.start <= send.end
            (delays if waiting else bounds).setdefault(min(vs, vs + direction), []).append(event.end - send.start)

    def median(kind: Kind, vs: int) -> float:
        return median_of(durations.get((kind, vs), []))

    forward = [median(Kind.FORWARD, vs) + median(Kind.SEND_ACTIVATION, vs) for vs in range(virtual)]
    split = [(Kind.BACKWARD_WEIGHT, vs) in durations for vs in range(virtual)]
    weights = [median(Kind.BACKWARD_WEIGHT, vs) for vs in range(virtual)]
    backward = [median(Kind.BACKWARD_INPUT if split[vs] else Kind.BACKWARD, vs) + median(Kind.SEND_GRADIENT, vs) + weights[vs]
                for vs in range(virtual)]
    shares = [weights[vs] / backward[vs] if split[vs] and backward[vs] > 0 else 0.5 for vs in range(virtual)]
    transfer = [
        median_of(delays[boundary]) if boundary in delays else min(bounds.get(boundary, [0.0]))
        for boundary in range(virtual - 1)
    ]
    step = max((median(Kind.STEP, d) for d in range(stages)), default=0.0)
    return Costs(forward, backward, transfer, step, shares if any(split) else ())


def median_of(values: Sequence[float]) -> float:
    """The median (0 for no values)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


# ---------------------------------------------------------------------------------------- the engine
_PAYLOAD = {
    Kind.FORWARD: Kind.SEND_ACTIVATION, Kind.SEND_ACTIVATION: Kind.SEND_ACTIVATION, Kind.RECV_ACTIVATION: Kind.SEND_ACTIVATION,
    Kind.BACKWARD: Kind.SEND_GRADIENT, Kind.BACKWARD_INPUT: Kind.SEND_GRADIENT, Kind.SEND_GRADIENT: Kind.SEND_GRADIENT,
    Kind.RECV_GRADIENT: Kind.SEND_GRADIENT,
}


def _timeline(
    actions: Sequence[Sequence[Action]], stages: int, virtual_stages: int, costs: Costs, forward_only: bool = False,
    placement: Placement = "loop",
) -> tuple[list[list[TimedAction]], list[int]]:
    """Simulate; return every device's timed actions (aligned with its list) and peak activations."""
    if len(costs.forward) != virtual_stages:
        raise ValueError(
            f"Costs give {len(costs.forward)} virtual stages but the schedule has {virtual_stages}; "
            "give one forward and backward time per virtual stage."
        )
    last = virtual_stages - 1
    # with SEND actions in the lists, a message leaves at its SEND; without, when its compute ends
    explicit = any(a.kind.is_send for device in actions for a in device)
    # (payload, receiving virtual stage, micro-batch, replica) -> time the message is available there
    arrival: dict[tuple[Kind, int, int | None, int], float] = {}
    clock = [0.0] * stages
    position = [0] * stages
    timed: list[list[TimedAction]] = [[] for _ in range(stages)]
    held = [0] * stages
    peak = [0] * stages

    def needs(action: Action, vs: int) -> tuple[Kind, int, int | None, int] | None:
        """The message ``action`` waits for, if any."""
        kind, replica = action.kind, getattr(action, "replica", 0)  # merged lists of parallel pipelines
        if kind in (Kind.FORWARD, Kind.RECV_ACTIVATION) and vs > 0:
            return (Kind.SEND_ACTIVATION, vs, action.micro_batch, replica)
        if (kind.takes_gradient or kind is Kind.RECV_GRADIENT) and vs < last:
            return (Kind.SEND_GRADIENT, vs, action.micro_batch, replica)
        return None

    def local(vs: int, device: int) -> bool:  # a neighbour on the same device: handed over as its compute ends
        return 0 <= vs < virtual_stages and locate_virtual_stage(vs, stages, placement)[0] == device

    def publish(action: Action, vs: int, when: float, in_memory: bool = False) -> None:
        payload, replica = _PAYLOAD[action.kind], getattr(action, "replica", 0)
        if payload is Kind.SEND_ACTIVATION and vs < last:
            arrival[(payload, vs + 1, action.micro_batch, replica)] = when + (0.0 if in_memory else costs.link(vs))
        elif payload is Kind.SEND_GRADIENT and vs > 0:
            arrival[(payload, vs - 1, action.micro_batch, replica)] = when + (0.0 if in_memory else costs.link(vs - 1))

    progress = True
    while progress:
        progress = False
        for d in range(stages):
            own = actions[d]
            while position[d] < len(own):
                action = own[position[d]]
                vs = virtual_stage_of(d, action.chunk, stages, placement)
                start = clock[d]
                wait = needs(action, vs)
                if wait is not None:
                    if wait not in arrival:
                        break  # blocked until the producer has been simulated
                    if action.kind.is_recv or action.kind.is_compute:
                        ready = arrival[wait]
                        if action.kind.is_recv:
                            end = max(start, ready)
                        else:
                            start = max(start, ready)
                if not action.kind.is_recv:
                    end = start + costs.duration(action, vs)
                if action.kind is Kind.FORWARD:
                    held[d] += 1
                    peak[d] = max(peak[d], held[d])
                    if forward_only:
                        held[d] -= 1
                elif action.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                    held[d] -= 1
                produces = action.kind in _PAYLOAD and action.kind.is_compute  # F, B or I: a message's content
                in_memory = produces and local(vs + 1 if action.kind is Kind.FORWARD else vs - 1, d)
                if action.kind.is_send or (not explicit and produces) or in_memory:
                    publish(action, vs, end, in_memory)
                timed[d].append(TimedAction(d, action, start, end))
                clock[d] = end
                position[d] += 1
                progress = True
    stuck = [d for d in range(stages) if position[d] < len(actions[d])]
    if stuck:
        where = ", ".join(f"stage {d} at {actions[d][position[d]]}" for d in stuck)
        raise ScheduleError(f"the action lists deadlock: {where} wait for a message that is never sent.")
    return timed, peak


def _summary(
    timed: list[list[TimedAction]], peak: list[int], step_time: float, busy: list[float], copies: list[int]
) -> Simulation:
    events = sorted((e for device in timed for e in device), key=lambda e: (e.start, e.device))
    total = len(busy) * step_time
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0
    return Simulation(events, step_time, bubble, busy, peak, copies)


def _busy(events: Sequence[TimedAction]) -> float:
    return sum(e.duration for e in events if e.action.kind.is_compute or e.action.kind is Kind.STEP)


def simulate(schedule: Schedule, costs: Costs, replicas: int = 1) -> Simulation:
    """Simulate one training step of ``schedule`` (every device starts idle at time 0).

    Args:
        schedule: any schedule: ``build_schedule(...)``, an asynchronous segment
            (``validate_async``), or merged per-device lists of several pipelines.
        costs: per-virtual-stage durations.
        replicas: parallel pipelines per device, for :func:`weight_copies` (avgpipe's ``N``).

    Returns:
        The timeline; ``step_time`` is the makespan (last action's end).
    """
    timed, peak = _timeline(schedule.actions, schedule.stages, schedule.virtual_stages, costs, schedule.forward_only,
                            schedule.placement)
    step_time = max((device[-1].end for device in timed if device), default=0.0)
    busy = [_busy(device) for device in timed]
    return _summary(timed, peak, step_time, busy, weight_copies(schedule.name, schedule.stages, schedule.micro_batches, replicas))


def _async_rate(
    name: str, stages: int, micro_batches: int, costs: Costs, windows: int, settle: int = 3
) -> tuple[float, list[float], bool]:
    """Time and per-device compute per window at the end of ``windows`` windows, and whether the run
    has settled: every device's last ``settle`` windows took one common time. Unsettled: the averages
    over the second half of the windows."""
    parts = [async_schedule(name, stages, micro_batches, t).actions for t in range(windows)]
    actions = [tuple(a for part in parts for a in part[d]) for d in range(stages)]
    ends = [[sum(len(part[d]) for part in parts[: t + 1]) - 1 for t in range(windows)] for d in range(stages)]
    timed, _ = _timeline(actions, stages, stages, costs)
    end = [[timed[d][ends[d][t]].end for t in range(windows)] for d in range(stages)]
    last = windows - 1
    rate = (end[0][last] - end[0][last - settle]) / settle
    settled = all(
        math.isclose(end[d][t + 1] - end[d][t], rate, rel_tol=1e-9, abs_tol=1e-12)
        for d in range(stages) for t in range(last - settle, last)
    )
    first = last - settle if settled else windows // 2
    span = last - first
    if not settled:
        rate = (max(e[last] for e in end) - max(e[first] for e in end)) / span
    busy = [_busy(timed[d][ends[d][first] + 1 : ends[d][last] + 1]) / span for d in range(stages)]
    return rate, busy, settled


def simulate_async(
    name: str, stages: int, micro_batches: int, costs: Costs, windows: int = 8, max_windows: int = 1024
) -> Simulation:
    """Simulate a segment of an asynchronous schedule: ``windows`` windows of ``micro_batches``
    micro-batches each, then the drain (the lists ``validate_async`` proves and the executor runs).

    ``events`` and ``peak_activations`` cover that segment. ``step_time`` is the steady-state time per
    window (per Lightning training step): ``n`` windows are simulated, ``n`` starting at ``windows``
    and doubling (up to ``max_windows``) until every device's last 3 windows took one common time (a
    downstream stage with slack from the warm-up can run faster than the bottleneck for many
    windows); that time is ``step_time`` and ``busy`` is compute per window over those windows. If
    it never settles, both are averages over the second half of the ``max_windows`` windows.
    """
    if windows < 4:
        raise ValueError(f"simulate_async needs windows >= 4 to reach a steady state, got {windows}.")
    segment = validate_async(name, stages, micro_batches, windows)
    timed, peak = _timeline(segment.actions, stages, stages, costs)
    n = windows
    rate, busy, settled = _async_rate(name, stages, micro_batches, costs, n)
    while not settled and n < max_windows:
        n = min(2 * n, max_windows)
        rate, busy, settled = _async_rate(name, stages, micro_batches, costs, n)
    return _summary(timed, peak, rate, busy, weight_copies(name, stages, micro_batches))


def closed_form_step_time(name: str, stage_times: Sequence[float], micro_batches: int, chunks: int = 1) -> float:
    """docs/algorithms.md §12 step 2: predicted time per mini-batch from per-device times ``t_d``
    (forward + backward of one micro-batch, all chunks of the device summed).

    Flushing schedules ``(M-1) t* + sum t_d``; interleaved ``M t* + (sum t_d - t*) / v``;
    asynchronous ``M t*``, with ``t* = max t_d``.
    """
    worst, total = max(stage_times), sum(stage_times)
    if SCHEDULES[name].chunked:
        return micro_batches * worst + (total - worst) / chunks
    if SCHEDULES[name].family == "asynchronous":
        return micro_batches * worst
    return (micro_batches - 1) * worst + total

