"""Prove a schedule sound before anything runs it.

Checks, with one sentence per failure:

* every micro-batch is forwarded and backwarded exactly once on every virtual stage, forward first
  (a backward is one ``B``, or a split one: ``I`` then ``W``);
* STEPs come exactly where they belong: one after every ``step_every`` backwards (a flushing schedule:
  once, after all its compute; forward-only: never), since the executor calls the optimizer at each;
* compute actions are bracketed by the communication they need, and a neighbour on the same device
  (ZBV's turn) has computed what they take from it;
* every send has its receive, in the same order on every channel (so NCCL, which ignores tags,
  matches messages correctly);
* a dry run, where sends never block and receives wait for their message, finishes: no deadlock
  on gloo;
* a second dry run under NCCL's rules (rendezvous sends, one order per stream, tags ignored;
  :mod:`~lightning_pipe.schedules.rendezvous`) finishes too, with and without shape headers.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedules.communication import peer
from lightning_pipe.schedules.ir import Action, Kind, Schedule
from lightning_pipe.schedules.rendezvous import rendezvous_dry_run


def _check_steps(schedule: Schedule) -> None:
    """STEP ``k`` must follow every backward of micro-batches ``< (k+1) * step_every`` and precede the
    others (a flushing schedule: one STEP after all compute; forward-only: none). With several
    replicas (avgpipe) this holds for each replica's actions, and an AVG, if any, follows each STEP."""
    averaging = any(a.kind is Kind.AVG for actions in schedule.actions for a in actions)
    for device, actions in enumerate(schedule.actions):
        for replica in range(schedule.replicas):
            own = tuple(a for a in actions if a.replica == replica)
            where = f"stage {device}" + (f" replica {replica}" if schedule.replicas > 1 else "")
            _check_replica_steps(schedule, where, own, averaging)


def _check_replica_steps(schedule: Schedule, where: str, actions: tuple[Action, ...], averaging: bool) -> None:
    every = schedule.step_every or schedule.micro_batches
    expected = 0 if schedule.forward_only else -(-schedule.micro_batches // every)  # a short last mini-batch steps too
    steps = [i for i, action in enumerate(actions) if action.kind is Kind.STEP]
    if schedule.forward_only and steps:
        raise ScheduleError(f"{where}: a forward-only schedule must not STEP.")
    if len(steps) != expected:
        raise ScheduleError(f"{where}: STEP appears {len(steps)} times, expected {expected}.")
    averages = [i for i, action in enumerate(actions) if action.kind is Kind.AVG]
    if averaging and (len(averages) != len(steps) or any(a < s for a, s in zip(averages, steps))):
        raise ScheduleError(f"{where}: AVG must come once after every STEP (of every replica on every stage), or never.")
    done = 0
    for action in actions:
        if action.kind is Kind.STEP:
            done += 1
        elif action.kind.is_backward and action.micro_batch // every != done:
            raise ScheduleError(
                f"{where}: {action} runs after {done} STEPs; a STEP must follow every backward of "
                f"its {every} micro-batches and precede the next ones."
            )
    if steps and schedule.step_every is None and any(a.kind.is_compute for a in actions[steps[-1] :]):
        raise ScheduleError(f"{where}: a flushing schedule steps once, after every forward and backward.")


def _check_compute(schedule: Schedule) -> None:
    expected = {
        (r, c, mb) for r in range(schedule.replicas) for c in range(schedule.chunks) for mb in range(schedule.micro_batches)
    }
    for device, actions in enumerate(schedule.actions):
        seen_forward: set[tuple[int, int, int]] = set()
        counts: Counter[tuple[Kind, int, int, int]] = Counter()
        for action in actions:
            if action.kind in (Kind.STEP, Kind.AVG):
                continue
            key = (action.replica, action.chunk, action.micro_batch)
            if action.kind.is_compute:
                counts[(action.kind, *key)] += 1
            if action.kind is Kind.FORWARD:
                seen_forward.add(key)
            elif action.kind.is_backward and key not in seen_forward:
                raise ScheduleError(f"stage {device}: {action} runs before its forward.")
            elif action.kind is Kind.BACKWARD_WEIGHT and counts[(Kind.BACKWARD_INPUT, *key)] == 0:
                raise ScheduleError(f"stage {device}: {action} runs before the I of its micro-batch.")
        for replica, chunk, mb in expected:
            split = counts[(Kind.BACKWARD_INPUT, replica, chunk, mb)] + counts[(Kind.BACKWARD_WEIGHT, replica, chunk, mb)] > 0
            backward = (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT) if split else (Kind.BACKWARD,)
            for kind in (Kind.FORWARD, *backward):
                want = 0 if kind is not Kind.FORWARD and schedule.forward_only else 1
                n = counts[(kind, replica, chunk, mb)]
                if n != want:
                    of = f"chunk {chunk}" + (f" of replica {replica}" if replica else "")
                    also = " (a backward is one B, or one I and one W)" if split or kind is Kind.BACKWARD else ""
                    raise ScheduleError(
                        f"stage {device}: {kind.value}{mb} of {of} runs {n} times, expected {want}{also}."
                    )
            if split and counts[(Kind.BACKWARD, replica, chunk, mb)]:
                raise ScheduleError(f"stage {device}: micro-batch {mb} of chunk {chunk} has both a B and an I/W backward.")
        extra = {key[1:] for key in counts} - expected
        if extra:
            raise ScheduleError(f"stage {device}: actions for unknown (replica, chunk, micro-batch) {sorted(extra)}.")


def dry_run(schedule: Schedule, replica_channels: bool = True) -> list[tuple[int, Action]]:
    """Execute the schedule symbolically and return the global order ``[(device, action), ...]``.

    Sends never block (the executor only waits on sends at the end of a step); a receive blocks
    until its message is at the head of its channel and must match it exactly. Each replica has
    its own channels (its own p2p tags); ``replica_channels=False`` checks the stricter order an
    untagged backend (NCCL) needs, where all replicas share one channel per peer and direction.
    """
    P = schedule.stages
    channels: dict[tuple[int, int, Kind, int], deque[tuple[int, int, int]]] = {}
    position = [0] * P
    order: list[tuple[int, Action]] = []
    progress = True
    while progress:
        progress = False
        for device in range(P):
            actions = schedule.actions[device]
            while position[device] < len(actions):
                action = actions[position[device]]
                if action.kind.is_send or action.kind.is_recv:
                    other, other_chunk = peer(action.kind, device, action.chunk, P, schedule.placement)
                    payload = Kind.SEND_ACTIVATION if action.kind in (Kind.SEND_ACTIVATION, Kind.RECV_ACTIVATION) else Kind.SEND_GRADIENT
                    lane = action.replica if replica_channels else 0
                    if action.kind.is_send:
                        key = (device, other, payload, lane)
                        channels.setdefault(key, deque()).append((other_chunk, action.micro_batch, action.replica))
                    else:
                        queue = channels.get((other, device, payload, lane))
                        if not queue:
                            break  # blocked: wait for the peer
                        got = queue.popleft()
                        if got != (action.chunk, action.micro_batch, action.replica):
                            raise ScheduleError(
                                f"stage {device}: {action} would receive the message meant for "
                                f"chunk {got[0]} micro-batch {got[1]} of replica {got[2]}; sends and receives on a "
                                "channel must be in the same order."
                            )
                order.append((device, action))
                position[device] += 1
                progress = True
    stuck = [d for d in range(P) if position[d] < len(schedule.actions[d])]
    if stuck:
        where = ", ".join(f"stage {d} at {schedule.actions[d][position[d]]}" for d in stuck)
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: {where} wait forever.")
    leftover = {k: len(q) for k, q in channels.items() if q}
    if leftover:
        raise ScheduleError(f"schedule {schedule.name!r} sends messages nobody receives: {leftover}.")
    return order


def validate(
    schedule: Schedule, replica_channels: bool = True, runs: Sequence[Schedule] | None = None
) -> list[tuple[int, Action]]:
    """Raise :class:`ScheduleError` unless ``schedule`` is sound; return the dry-run order.

    ``replica_channels``: see :func:`dry_run` (``False`` for untagged backends). A schedule an untagged
    backend could run (one replica, or ``replica_channels=False``) must also pass the NCCL dry run, on
    ``runs``: the executor runs ``schedule`` is made of (default: the schedule as one run; an
    asynchronous segment is its windows and drain)."""
    if len(schedule.actions) != schedule.stages:
        raise ScheduleError(f"expected {schedule.stages} action lists, got {len(schedule.actions)}.")
    _check_compute(schedule)
    _check_steps(schedule)
    for device, actions in enumerate(schedule.actions):
        _check_brackets(schedule, device, actions)
    order = dry_run(schedule, replica_channels)
    if schedule.replicas == 1 or not replica_channels:  # what NCCL can run (it has no replica channels)
        for headers in (True, False):
            rendezvous_dry_run(runs or [schedule], headers=headers)
    return order


def _check_brackets(schedule: Schedule, device: int, actions: tuple[Action, ...]) -> None:
    """Each compute action has the receive it needs before it and its send after it; one that takes its
    input from a neighbour on this device comes after the neighbour's compute that produces it."""
    last = schedule.virtual_stages - 1
    received: set[tuple[Kind, int | None, int, int]] = set()
    computed: set[tuple[Kind, int | None, int, int]] = set()
    for action in actions:
        vs = schedule.virtual_stage(device, action.chunk)
        key = (action.micro_batch, action.chunk, action.replica)
        needs: tuple[Kind, int] | None = None  # (receive kind, neighbour) the compute reads from
        if action.kind is Kind.FORWARD and vs > 0:
            needs = (Kind.RECV_ACTIVATION, vs - 1)
        elif action.kind.takes_gradient and vs < last:
            needs = (Kind.RECV_GRADIENT, vs + 1)
        if action.kind.is_recv:
            received.add((action.kind, *key))
        elif needs is not None:
            owner, chunk = schedule.locate(needs[1])
            producers = (Kind.FORWARD,) if action.kind is Kind.FORWARD else (Kind.BACKWARD, Kind.BACKWARD_INPUT)
            if owner != device and (needs[0], *key) not in received:
                raise ScheduleError(f"stage {device}: {action} has no {needs[0].value} before it.")
            if owner == device and not any((kind, action.micro_batch, chunk, action.replica) in computed for kind in producers):
                raise ScheduleError(
                    f"stage {device}: {action} runs before chunk {chunk} of this device computed what it takes "
                    "(the neighbouring virtual stage is on the same device)."
                )
        if action.kind.is_compute:
            computed.add((action.kind, *key))
        elif action.kind is Kind.SEND_ACTIVATION and (Kind.FORWARD, *key) not in computed:
            raise ScheduleError(f"stage {device}: {action} sends before its forward ran.")
        elif action.kind is Kind.SEND_GRADIENT and not any((kind, *key) in computed for kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT)):
            raise ScheduleError(f"stage {device}: {action} sends before its backward ran.")
