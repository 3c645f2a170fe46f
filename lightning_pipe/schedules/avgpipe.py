"""avgpipe (docs/algorithms.md §10): N parallel pipelines on the same devices, one merged list per device.

Each replica (parallel pipeline) ``n`` runs a flushed 1F1B with advance forward propagation on its own
mini-batch: stage ``s`` starts with ``k_s = min(M, w_s + a_s)`` forwards (``a_s = a`` except on the
last stage, where it is 0), alternates one forward with one backward, drains the rest, then STEP
and AVG (elastic averaging against the center copy).

The paper's device scheduler picks, whenever a device is free, the first *ready* action of its N
lists in a rotating priority order. The executor cannot poll readiness (gloo's
``Work.is_completed()`` stays ``False`` until ``wait()``), so the choice is made ahead of time by a
small discrete-event run of all devices with per-action durations, and the executor runs the
resulting static order. Each replica uses its own point-to-point tags, so messages of different
replicas never match each other whatever order the merge picks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from lightning_pipe.schedules.communication import with_communication
from lightning_pipe.schedules.ir import Action, Kind, Schedule
from lightning_pipe.schedules.validate import validate


def warmup_forwards(stage: int, stages: int, micro_batches: int, advance: int) -> int:
    """``k_s = min(M, w_s + a_s)``: forwards before the first backward on ``stage``."""
    extra = advance if stage < stages - 1 else 0
    return min(micro_batches, stages - 1 - stage + extra)


def avgpipe_replica(stage: int, stages: int, micro_batches: int, advance: int = 0, replica: int = 0) -> Iterator[Action]:
    """Compute actions of one replica on ``stage``: 1F1B with ``advance`` extra warm-up forwards, STEP, AVG."""
    warmup = warmup_forwards(stage, stages, micro_batches, advance)
    order = [Action(Kind.FORWARD, j) for j in range(warmup)]
    for j in range(warmup, micro_batches):
        order += [Action(Kind.FORWARD, j), Action(Kind.BACKWARD, j - warmup)]
    order += [Action(Kind.BACKWARD, j) for j in range(micro_batches - warmup, micro_batches)]
    order += [Action(Kind.STEP), Action(Kind.AVG)]
    for action in order:
        yield replace(action, replica=replica)


@dataclass(frozen=True)
class MergeCosts:
    """Durations the device scheduler assumes when it merges the replicas' lists.

    Args:
        forward: time of one micro-batch forward, per stage.
        backward: time of one micro-batch backward, per stage.
        transfer: time a message takes from one stage to the next, per boundary (``P - 1`` values).
        step: time of a STEP plus its AVG (any stage).
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    transfer: tuple[float, ...] = ()
    step: float = 0.0

    @classmethod
    def uniform(cls, stages: int) -> MergeCosts:
        """Equal stages, backward twice a forward, free transfers: the default when nothing is measured."""
        return cls((1.0,) * stages, (2.0,) * stages, (0.0,) * max(stages - 1, 0), 0.0)


def _units(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    """Group a list with communication into units ``[RECV] compute [SEND]``, STEP and AVG."""
    units: list[list[Action]] = []
    pending: list[Action] = []
    for action in actions:
        if action.kind.is_recv:
            pending.append(action)
        elif action.kind.is_send:
            units[-1].append(action)
        else:
            units.append(pending + [action])
            pending = []
    return [tuple(u) for u in units]


def merge_replicas(
    per_replica: Sequence[Sequence[Sequence[Action]]], stages: int, costs: MergeCosts
) -> tuple[tuple[Action, ...], ...]:
    """Merge ``per_replica[n][d]`` (lists with communication) into one list per device.

    A discrete-event run: each device, when free, runs the first ready unit of its replicas' lists,
    starting the search at the replica after the one whose compute it ran last (rotating priority);
    a unit is ready when the message its receive waits for has arrived. When nothing is ready the
    device idles until the earliest arrival. Devices decide in global time order, so a decision never
    misses a message that could still arrive before it.
    """
    replicas = len(per_replica)
    queues = [[_units(per_replica[n][d]) for n in range(replicas)] for d in range(stages)]
    heads = [[0] * replicas for _ in range(stages)]
    free = [0.0] * stages
    last = [replicas - 1] * stages  # so replica 0 has priority first
    arrival: dict[tuple[Kind, int, int | None, int], float] = {}  # (payload kind, replica, mb, receiving stage)
    merged: list[list[Action]] = [[] for _ in range(stages)]

    def ready_at(d: int, unit: tuple[Action, ...]) -> float | None:
        recv = unit[0] if unit[0].kind.is_recv else None
        if recv is None:
            return free[d]
        t = arrival.get((recv.kind, recv.replica, recv.micro_batch, d))
        return None if t is None else max(free[d], t)

    def duration(d: int, action: Action) -> float:
        if action.kind is Kind.FORWARD:
            return costs.forward[d]
        if action.kind is Kind.BACKWARD:
            return costs.backward[d]
        return costs.step if action.kind is Kind.STEP else 0.0

    while True:
        best: tuple[float, int] | None = None  # (decision time, device)
        for d in range(stages):
            times = [ready_at(d, queues[d][n][heads[d][n]]) for n in range(replicas) if heads[d][n] < len(queues[d][n])]
            known = [t for t in times if t is not None]
            if known and (best is None or min(known) < best[0]):
                best = (min(known), d)
        if best is None:
            break
        now, d = best
        for k in range(1, replicas + 1):
            n = (last[d] + k) % replicas
            if heads[d][n] >= len(queues[d][n]):
                continue
            unit = queues[d][n][heads[d][n]]
            start = ready_at(d, unit)
            if start is not None and start <= now:
                break
        heads[d][n] += 1
        merged[d] += unit
        compute = next(a for a in unit if not (a.kind.is_recv or a.kind.is_send))
        end = now + duration(d, compute)
        free[d] = end
        if compute.kind.is_compute:
            last[d] = n
        for send in (a for a in unit if a.kind.is_send):
            to = d + 1 if send.kind is Kind.SEND_ACTIVATION else d - 1
            link = costs.transfer[min(d, to)] if costs.transfer else 0.0
            recv = Kind.RECV_ACTIVATION if send.kind is Kind.SEND_ACTIVATION else Kind.RECV_GRADIENT
            arrival[(recv, send.replica, send.micro_batch, to)] = end + link
    unfinished = [d for d in range(stages) if any(heads[d][n] < len(queues[d][n]) for n in range(replicas))]
    if unfinished:  # cannot happen for lists that pass the validator one by one
        raise RuntimeError(f"the avgpipe merge stalled on stages {unfinished}.")
    return tuple(tuple(m) for m in merged)


@lru_cache(maxsize=64)
def build_avgpipe(
    stages: int, micro_batches: int, replicas: int, advance: int = 0, costs: MergeCosts | None = None,
) -> Schedule:
    """The merged, validated avgpipe schedule of one round (every replica's STEP and AVG included)."""
    if replicas < 1:
        raise ValueError(f"avgpipe needs at least one replica; got {replicas}.")
    if advance < 0:
        raise ValueError(f"advance_forward must be >= 0; got {advance}.")
    costs = costs or MergeCosts.uniform(stages)
    per_replica = [
        [with_communication(avgpipe_replica(d, stages, micro_batches, advance, n), d, stages, 1) for d in range(stages)]
        for n in range(replicas)
    ]
    actions = merge_replicas(per_replica, stages, costs)
    schedule = Schedule("avgpipe", stages, micro_batches, 1, actions, replicas=replicas)
    validate(schedule)
    return schedule


def averaging_order(schedule: Schedule) -> list[list[int]]:
    """Per stage, the replicas in the order their AVG runs (what the asynchronous center update depends on)."""
    return [[a.replica for a in actions if a.kind is Kind.AVG] for actions in schedule.actions]
