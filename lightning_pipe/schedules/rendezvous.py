"""Dry run under NCCL's point-to-point rules: prove a schedule cannot deadlock on GPUs.

The validator's first dry run (:func:`~lightning_pipe.schedules.validate.dry_run`) models gloo: a
send never blocks, and each link and message kind has its own tag (:func:`~lightning_pipe.engine.p2p.lane_tag`). NCCL is stricter:

* **rendezvous**: a send completes only when the peer runs the matching receive, and vice versa;
* **one order per stream**: the operations a rank issues on one stream run in issue order, so an
  operation queued behind an unmatched one waits for it; the operations of one fused group
  (``batch_isend_irecv``) run together, in any order;
* tags are ignored: on one stream, messages match in issue order.

A process group is one NCCL communicator; a rank's operations on it share one stream, whoever their
peer is (Lightning passes ``device_id``, so groups initialise eagerly and never split per pair). So
the transport makes a two-rank group per channel (below), where a group's stream and a pair's stream
are the same thing; ``communicators="group"`` models groups that span the pipeline instead.

This module replays an executor's issue order under those rules. ``streams`` says how operations map
to streams: ``"channel"`` (what :class:`~lightning_pipe.engine.p2p.Transport` does on NCCL: one
two-rank process group per pair, direction and message kind, :class:`~lightning_pipe.engine.p2p.ChannelGroups`,
so activations and gradients of each direction of a pair have their own stream), ``"direction"`` (one
group for messages to a higher rank and one for messages to a lower rank) or ``"pair"`` (one stream
per pair, a single process group). ``fused``
issues every run of consecutive communication actions as one group per peer (Megatron-LM's and
``torch.distributed.pipelining``'s answer to the pair stream); otherwise sends are issued at their
action and receives at the compute that needs them: the latest :class:`~lightning_pipe.engine.executor.Executor`
posts them on NCCL. (It posts receives whose shapes it knows up to one compute ahead, in the same
order; on direction streams that can only let sends complete sooner, since a direction's stream holds
that direction's messages alone, in the order both sides agree on.) ``headers``: every activation is
preceded by a shape header the receiver reads on the host before it posts the payload's receive
(``False``: shapes known).

On the pair stream, unfused 1F1B deadlocks (in the steady state each neighbour issues a send before
its receive); fused runs repair 1F1B and the asynchronous schedules but not interleaved 1F1B or
avgpipe, whose runs do not pair up. Direction streams are deadlock-free for every schedule with one
chunk per device or a looped placement, but not for ZBV: its V sends chunk 0's activations and chunk
1's gradients from device 0 to device 1 in one order and needs them in another. Channel streams are
deadlock-free for every schedule (tests/unit/test_rendezvous.py proves it with hypothesis), and a
send never waits for an unrelated message travelling the other way or of the other kind.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedules.communication import peer
from lightning_pipe.schedules.ir import Action, Kind, Schedule

Streams = Literal["channel", "direction", "pair"]
Communicators = Literal["group", "pair"]
Message = tuple[str, int, int, int, str]  # (activation|gradient, replica, sender's virtual stage, micro-batch, part)


@dataclass(eq=False)
class _Op:
    """One send or receive of one message part from ``src`` to ``dst``."""

    src: int
    dst: int
    message: Message
    send: bool
    matched: bool = False


@dataclass(eq=False)
class _Group:
    """Operations issued together (one ``batch_isend_irecv`` group, or a single operation)."""

    ops: list[_Op]

    @property
    def done(self) -> bool:
        return all(op.matched for op in self.ops)


@dataclass
class _Device:
    actions: list[tuple[int, Action]]  # (part, action) in issue order
    position: int = 0
    begun: int = -1  # the last part whose start was handled
    waiting: list[_Op] = field(default_factory=list)  # the host is blocked until these are matched
    then: list[_Op] = field(default_factory=list)  # a payload receive to post once the header is read
    computing: bool = False  # the compute at ``position`` waits for its receive
    posted: dict[Action, _Op] = field(default_factory=dict)  # fused: receives in flight, by their RECV action
    sends_of_part: dict[int, list[_Op]] = field(default_factory=dict)


def _message(device: int, action: Action, schedule: Schedule, part: str) -> tuple[int, int, Message]:
    """``(src, dst, message)`` of a communication action of ``device``."""
    other, _ = peer(action.kind, device, action.chunk, schedule.stages, schedule.placement)
    vs = schedule.virtual_stage(device, action.chunk)
    activation = action.kind in (Kind.SEND_ACTIVATION, Kind.RECV_ACTIVATION)
    kind = "activation" if activation else "gradient"
    if action.kind.is_send:
        return device, other, (kind, action.replica, vs, action.micro_batch, part)
    return other, device, (kind, action.replica, vs - 1 if activation else vs + 1, action.micro_batch, part)


def rendezvous_dry_run(
    parts: Sequence[Schedule], streams: Streams = "channel", fused: bool = False, headers: bool = True,
    communicators: Communicators = "pair",
) -> list[tuple[int, Action]]:
    """Execute ``parts`` (run one after the other, e.g. an asynchronous segment's windows and its
    drain, each a separate :meth:`Executor.run <lightning_pipe.engine.executor.Executor.run>`) under
    NCCL's rules; return the global order ``[(device, action), ...]``, or raise
    :class:`ScheduleError` saying where each stuck device waits.

    Args:
        parts: schedules of one pipeline, in the order they run.
        streams: ``"channel"``, ``"direction"`` or ``"pair"`` (module docstring).
        fused: issue each run of communication actions as one group per peer (with ``headers=False``
            only: a fused group cannot wait for a header in the middle).
        headers: every activation carries a shape header first.
        communicators: ``"pair"``: a stream per pair of ranks and ``streams`` kind (what runs: the
            transport's :class:`~lightning_pipe.engine.p2p.ChannelGroups` are two-rank groups, one per
            pair, direction and message kind, and a two-rank group's one stream per rank serves one
            peer); ``"group"``: one stream per rank and ``streams`` kind, shared by the rank's operations
            with every peer (what groups spanning the pipeline would give: an eagerly initialised group
            is one communicator). avgpipe deadlocks there, which is why the groups are per pair.
    """
    if fused and headers:
        raise ValueError("a fused run cannot read shape headers in the middle; use headers=False with fused=True.")
    name, P = parts[0].name, parts[0].stages
    if P == 1:  # one device: its chunks' messages never leave the process
        return [(0, action) for part in parts for action in part.actions[0]]
    devices = [_Device([(t, a) for t, part in enumerate(parts) for a in part.actions[d]]) for d in range(P)]
    queues: dict[tuple[tuple[int, int, str], int], deque[_Group]] = {}  # (stream, issuing rank): groups
    order: list[tuple[int, Action]] = []

    def stream(op: _Op) -> tuple[int, int, str]:
        """The stream ``op`` is queued on, per issuing rank: ``(-1, -1, group)`` for a group's one stream
        per rank (``communicators="group"``), ``(low rank, high rank, group)`` for a pair's."""
        upward = "up" if op.dst > op.src else "down"
        group = {"channel": f"{upward} {op.message[0]}", "direction": upward, "pair": ""}[streams]
        if communicators == "group":
            return -1, -1, group
        return min(op.src, op.dst), max(op.src, op.dst), group

    def issue(device: int, ops: list[_Op]) -> None:
        """Issue ``ops`` together: one group per stream."""
        by_stream: dict[tuple[int, int, str], list[_Op]] = {}
        for op in ops:
            by_stream.setdefault(stream(op), []).append(op)
        for key, group in by_stream.items():
            queues.setdefault((key, device), deque()).append(_Group(group))

    def receive(d: int, action: Action, schedule: Schedule) -> None:
        """Block the host on the receive ``action`` (a header first, if any)."""
        src, dst, message = _message(d, action, schedule, "payload")
        payload = _Op(src, dst, message, send=False)
        if headers and action.kind is Kind.RECV_ACTIVATION:
            header = _Op(src, dst, message[:4] + ("header",), send=False)
            issue(d, [header])
            devices[d].waiting, devices[d].then = [header], [payload]
        else:
            issue(d, [payload])
            devices[d].waiting = [payload]

    def advance(d: int) -> bool:
        """Run device ``d`` until its host blocks; whether it moved."""
        state, moved = devices[d], False
        while True:
            if state.waiting:
                if not all(op.matched for op in state.waiting):
                    return moved
                state.waiting, moved = [], True
                if state.then:  # the header is read: post the payload's receive and wait for it
                    issue(d, state.then)
                    state.waiting, state.then = state.then, []
                    continue
                if state.computing:  # the compute that waited runs
                    state.computing = False
                    order.append((d, state.actions[state.position][1]))
                    state.position += 1
                continue
            if state.position >= len(state.actions):
                return moved
            part, action = state.actions[state.position]
            schedule = parts[part]
            if state.begun < part:  # a part begins: the sends of two parts ago must have been received
                state.begun = part
                for earlier in [t for t in state.sends_of_part if t <= part - 2]:
                    state.waiting += state.sends_of_part.pop(earlier)
                continue
            moved = True
            if action.kind.is_compute and (needed := _needed(d, action, schedule)) is not None:
                state.computing = True
                if fused:
                    state.waiting = [state.posted.pop(needed)]
                else:
                    receive(d, needed, schedule)
                continue
            if fused and (action.kind.is_send or action.kind.is_recv):
                end = state.position
                while end < len(state.actions) and state.actions[end][0] == part and (
                        state.actions[end][1].kind.is_send or state.actions[end][1].kind.is_recv):
                    end += 1
                ops = []
                for _, a in state.actions[state.position:end]:
                    src, dst, message = _message(d, a, schedule, "payload")
                    op = _Op(src, dst, message, send=a.kind.is_send)
                    if a.kind.is_recv:
                        state.posted[a] = op
                    else:
                        state.sends_of_part.setdefault(part, []).append(op)
                    ops.append(op)
                    order.append((d, a))
                issue(d, ops)
                state.position = end
                continue
            if action.kind.is_send:
                src, dst, message = _message(d, action, schedule, "payload")
                if headers and action.kind is Kind.SEND_ACTIVATION:
                    header = _Op(src, dst, message[:4] + ("header",), send=True)
                    issue(d, [header])
                    state.sends_of_part.setdefault(part, []).append(header)
                payload = _Op(src, dst, message, send=True)
                issue(d, [payload])
                state.sends_of_part.setdefault(part, []).append(payload)
            # unfused receives are posted by the compute that needs them
            order.append((d, action))
            state.position += 1

    def match(key: tuple[int, int, str], a: int, b: int) -> bool:
        """Match what the two ranks' head groups on one stream can; pop finished groups."""
        qa, qb = queues.get((key, a)), queues.get((key, b))
        if not qa or not qb:
            return False
        moved = False
        for (sender, sending), (receiver, receiving) in (((a, qa[0]), (b, qb[0])), ((b, qb[0]), (a, qa[0]))):
            # on a group's stream a head group may also hold operations with other peers
            sends = [op for op in sending.ops if op.send and not op.matched and op.dst == receiver]
            receives = [op for op in receiving.ops if not op.send and not op.matched and op.src == sender]
            for send, recv in zip(sends, receives):
                if send.message != recv.message:
                    raise ScheduleError(
                        f"schedule {name!r} under NCCL's rules: stage {recv.dst} would receive {_describe(send.message)} "
                        f"where it expects {_describe(recv.message)}; NCCL ignores tags, so the messages one rank "
                        "sends another must be received in the order they are sent."
                    )
                send.matched = recv.matched = True
                moved = True
        for queue in (qa, qb):
            while queue and queue[0].done:
                queue.popleft()
                moved = True
        return moved

    progress = True
    while progress:
        progress = any([advance(d) for d in range(P)])
        pairs = sorted({(key, a, b) for key, a in queues for other, b in queues if other == key and a < b and (
            key[0] < 0 or (key[0], key[1]) == (a, b))})
        progress = any([match(key, a, b) for key, a, b in pairs]) or progress
    stuck = [d for d in range(P) if devices[d].position < len(devices[d].actions) or devices[d].waiting]
    if stuck or any(group for queue in queues.values() for group in queue):
        where = "; ".join(_stuck(d, devices[d], queues) for d in stuck) or "sends left unreceived"
        raise ScheduleError(
            f"schedule {name!r} deadlocks under NCCL's rules (a send completes only when its receive runs; "
            f"operations on one stream run in issue order; streams: {streams}{', fused runs' if fused else ''}): "
            f"{where}."
        )
    return order


def _needed(device: int, action: Action, schedule: Schedule) -> Action | None:
    """The receive a compute action needs (``None``: it reads no message)."""
    vs = schedule.virtual_stage(device, action.chunk)
    if action.kind is Kind.FORWARD and vs > 0 and schedule.locate(vs - 1)[0] != device:
        return Action(Kind.RECV_ACTIVATION, action.micro_batch, action.chunk, action.replica)
    if action.kind.takes_gradient and vs < schedule.virtual_stages - 1 and schedule.locate(vs + 1)[0] != device:
        return Action(Kind.RECV_GRADIENT, action.micro_batch, action.chunk, action.replica)
    return None


def _describe(message: Message) -> str:
    kind, replica, sender, micro_batch, part = message
    of = f" of replica {replica}" if replica else ""
    return f"the {part} of the {kind} of micro-batch {micro_batch}{of} from virtual stage {sender}"


def _stuck(device: int, state: _Device, queues: dict[tuple[tuple[int, int, str], int], deque[_Group]]) -> str:
    at = f"stage {device} at {state.actions[state.position][1]}" if state.position < len(state.actions) else \
        f"stage {device} at its end"
    heads = [_describe(next(op for op in queue[0].ops if not op.matched).message)
             for (_, rank), queue in sorted(queues.items(), key=lambda item: item[0]) if rank == device and queue]
    return at + (f" (first unfinished: {'; '.join(heads)})" if heads else "")
