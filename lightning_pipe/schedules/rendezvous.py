"""Dry run under NCCL's point-to-point rules: prove a schedule cannot deadlock on GPUs.

The validator's first dry run (:func:`~lightning_pipe.schedules.validate.dry_run`) models gloo: a
send never blocks and each message kind has its own tag. NCCL is stricter (docs/how-it-works.md,
"Transport"):

* **rendezvous**: a send completes only when the peer runs the matching receive, and vice versa;
* **one order per pair**: the operations between two ranks run in the order they were issued, in
  both directions (one stream per pair), so a receive queued behind an unmatched send waits for it;
  the operations of one fused group (``batch_isend_irecv``) run together, in any order;
* tags are ignored: messages between two ranks in one direction match in issue order.

This module replays the executor's NCCL path (:class:`~lightning_pipe.engine.executor.Executor`):
every run of consecutive communication actions is issued as one fused group per peer, its payloads'
sends and receives together. An activation whose shapes the receiver cannot know yet needs a shape
header first: the run's headers travel in their own group per peer on a second communicator (their
own order per pair, apart from the payloads), and the host reads them before it issues the run's
payload group, since a payload receive can only be posted once its size is known. (Headers on the
payloads' communicator deadlock: a header queued behind a group the peer cannot finish before it
reads that header.) A compute action waits for the receives it needs; at the start of part ``t`` the
sends of part ``t - 2`` are waited for (an asynchronous window's rule). Both header modes are
checked: every activation with a header, and none (shapes known).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedules.communication import peer
from lightning_pipe.schedules.ir import Action, Kind, Schedule

Message = tuple[str, int, int, int, str]  # (activation|gradient, replica, sender's virtual stage, micro-batch, part)


@dataclass(eq=False)
class _Op:
    """One send or receive of one message part between ``src`` and ``dst``."""

    src: int
    dst: int
    message: Message
    send: bool
    matched: bool = False


@dataclass(eq=False)
class _Group:
    """Operations issued together to one peer (one ``batch_isend_irecv`` group, or one operation)."""

    ops: list[_Op]

    @property
    def done(self) -> bool:
        return all(op.matched for op in self.ops)


@dataclass
class _Device:
    actions: list[tuple[int, Action]]  # (part, action) in issue order
    position: int = 0
    begun: int = -1  # the last part whose start was handled
    computing: bool = False  # the action at ``position`` is a compute waiting for its receives
    waiting: list[_Op] = field(default_factory=list)  # host blocked until these are matched
    then: list[tuple[int, _Group]] = field(default_factory=list)  # payload groups to issue once unblocked
    receives: dict[tuple[Kind, int, int, int], _Op] = field(default_factory=dict)  # payload receives posted
    sends_of_part: dict[int, list[_Op]] = field(default_factory=dict)


def rendezvous_dry_run(parts: Sequence[Schedule], headers: bool = True) -> list[tuple[int, Action]]:
    """Execute ``parts`` (run one after the other, e.g. an asynchronous segment's windows and drain)
    under NCCL's rules; return the global order ``[(device, action), ...]`` or raise
    :class:`ScheduleError` naming where every stuck device waits.

    Args:
        parts: schedules of the same pipeline, in the order the executor runs them.
        headers: whether every activation carries a shape header the receiver must read first
            (``False``: shapes cached, the payload's receive is posted with the group).
    """
    first = parts[0]
    P = first.stages
    devices = [_Device([(t, a) for t, part in enumerate(parts) for a in part.actions[d]]) for d in range(P)]
    queues: dict[tuple[str, int, int], deque[_Group]] = {}  # (communicator, rank, peer): groups in issue order
    order: list[tuple[int, Action]] = []

    def issue(device: int, other: int, group: _Group, communicator: str = "payloads") -> None:
        queues.setdefault((communicator, device, other), deque()).append(group)

    def advance(d: int) -> bool:
        """Run device ``d`` until its host blocks; whether it moved."""
        state, moved = devices[d], False
        while True:
            if state.waiting:
                if not all(op.matched for op in state.waiting):
                    return moved
                state.waiting, moved = [], True
            for other, group in state.then:  # the headers are read: the run's payloads follow
                issue(d, other, group)
            state.then = []
            if state.position >= len(state.actions):
                return moved
            part, action = state.actions[state.position]
            if state.begun < part:  # a part begins: the sends of two parts ago must be received
                state.begun = part
                state.waiting = [op for t, ops in state.sends_of_part.items() if t <= part - 2 for op in ops]
                continue
            if action.kind.is_send or action.kind.is_recv:
                end = state.position
                while (end < len(state.actions) and state.actions[end][0] == part
                       and (state.actions[end][1].kind.is_send or state.actions[end][1].kind.is_recv)):
                    end += 1
                run = [a for _, a in state.actions[state.position:end]]
                headers_first, payloads = _groups(d, run, parts[part], headers, state, part)
                if headers_first:
                    for other, group in headers_first:
                        issue(d, other, group, "headers")
                    state.waiting = [op for _, group in headers_first for op in group.ops if not op.send]
                    state.then = payloads
                else:
                    for other, group in payloads:
                        issue(d, other, group)
                order.extend((d, a) for a in run)
                state.position, moved = end, True
                continue
            if action.kind.is_compute and not state.computing:
                state.computing = True
                state.waiting = _needs(d, action, parts[part], state)
                continue
            state.computing = False
            order.append((d, action))
            state.position, moved = state.position + 1, True

    def match(communicator: str, a: int, b: int) -> bool:
        """Match what the head groups of the pair's two queues can; pop finished groups."""
        qa, qb = queues.get((communicator, a, b)), queues.get((communicator, b, a))
        if not qa or not qb:
            return False
        moved = False
        for sending, receiving in ((qa[0], qb[0]), (qb[0], qa[0])):
            sends = [op for op in sending.ops if op.send and not op.matched]
            receives = [op for op in receiving.ops if not op.send and not op.matched]
            for send, receive in zip(sends, receives):
                if send.message != receive.message:
                    raise ScheduleError(
                        f"schedule {first.name!r} under NCCL's rules: stage {receive.dst} would receive "
                        f"{_describe(send.message)} where it expects {_describe(receive.message)}; messages "
                        "between two ranks must be received in the order they are sent."
                    )
                send.matched = receive.matched = True
                moved = True
        for queue in (qa, qb):
            while queue and queue[0].done:
                queue.popleft()
                moved = True
        return moved

    pairs = {(a, b) for a in range(P) for b in range(a + 1, P)}
    progress = True
    while progress:
        progress = any([advance(d) for d in range(P)])
        progress = any([match(c, a, b) for c in ("headers", "payloads") for a, b in sorted(pairs)]) or progress
    stuck = [d for d in range(P) if devices[d].position < len(devices[d].actions) or devices[d].waiting]
    unmatched = [op for queue in queues.values() for group in queue for op in group.ops if not op.matched]
    if stuck or unmatched:
        where = "; ".join(_stuck(d, devices[d], queues) for d in stuck) or "every device finished"
        raise ScheduleError(
            f"schedule {first.name!r} deadlocks under NCCL's rules (a send completes only when its receive "
            f"runs; between two ranks, operations run in issue order): {where}. Fuse the sends and "
            "receives each pair of neighbours issue at the same time, or reorder them."
        )
    return order


def _groups(device: int, run: list[Action], schedule: Schedule, headers: bool, state: _Device,
            part: int) -> tuple[list[tuple[int, _Group]], list[tuple[int, _Group]]]:
    """The groups of a run of communication actions, one per peer in order of first appearance:
    ``(header groups, payload groups)``; no header groups when no activation carries one."""
    P = schedule.stages
    header_ops: dict[int, list[_Op]] = {}
    payload_ops: dict[int, list[_Op]] = {}
    for action in run:
        other, _ = peer(action.kind, device, action.chunk, P)
        vs = schedule.virtual_stage(device, action.chunk)
        header_ops.setdefault(other, [])
        payloads = payload_ops.setdefault(other, [])
        activation = action.kind in (Kind.SEND_ACTIVATION, Kind.RECV_ACTIVATION)
        kind = "activation" if activation else "gradient"
        if action.kind.is_send:
            sent = [_Op(device, other, (kind, action.replica, vs, action.micro_batch, "payload"), True)]
            if activation and headers:
                sent.insert(0, _Op(device, other, (kind, action.replica, vs, action.micro_batch, "header"), True))
                header_ops[other].append(sent[0])
                payloads.append(sent[1])
            else:
                payloads += sent
            state.sends_of_part.setdefault(part, []).extend(sent)
        else:
            sender = vs - 1 if activation else vs + 1
            payload = _Op(other, device, (kind, action.replica, sender, action.micro_batch, "payload"), False)
            if activation and headers:
                header_ops[other].append(_Op(other, device, (kind, action.replica, sender, action.micro_batch, "header"), False))
            payloads.append(payload)
            state.receives[(action.kind, action.replica, action.chunk, action.micro_batch)] = payload
    first = [(other, _Group(ops)) for other, ops in header_ops.items() if ops]
    return first, [(other, _Group(ops)) for other, ops in payload_ops.items() if ops]


def _needs(device: int, action: Action, schedule: Schedule, state: _Device) -> list[_Op]:
    """The receives a compute action waits for."""
    vs = schedule.virtual_stage(device, action.chunk)
    if action.kind is Kind.FORWARD and vs > 0:
        return [state.receives.pop((Kind.RECV_ACTIVATION, action.replica, action.chunk, action.micro_batch))]
    if action.kind is Kind.BACKWARD and vs < schedule.virtual_stages - 1:
        return [state.receives.pop((Kind.RECV_GRADIENT, action.replica, action.chunk, action.micro_batch))]
    return []


def _describe(message: Message) -> str:
    kind, replica, sender, micro_batch, part = message
    of = f" of replica {replica}" if replica else ""
    return f"the {part} of the {kind} of micro-batch {micro_batch}{of} from virtual stage {sender}"


def _stuck(device: int, state: _Device, queues: dict[tuple[str, int, int], deque[_Group]]) -> str:
    if state.position < len(state.actions):
        at = f"stage {device} at {state.actions[state.position][1]}"
    else:
        at = f"stage {device} at its end"
    heads = [f"with stage {other}: {_describe(next(op for op in q[0].ops if not op.matched).message)}"
             for (_, rank, other), q in sorted(queues.items()) if rank == device and q]
    return at + (f" (first unfinished transfer {', '.join(heads)})" if heads else "")
