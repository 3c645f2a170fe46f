"""Every device of one pipeline in this process: the emulation mode's engine.

:class:`LocalPipeline` holds one :class:`~.executor.Executor` per device, each with its own chunks
and (for asynchronous schedules) its own weight policy, and connects them with a
:class:`LocalTransport` whose messages are Python queues. It interleaves the devices' action lists
in a valid global order, the same rule as the validator's dry run
(:func:`lightning_pipe.schedules.dry_run`): visit the devices in turn and run each until its next
action is a receive whose message has not been sent yet. A device's state changes only through its
own actions, so the numbers do not depend on which valid order is used; they are those of the
distributed run, computed by the very same executor code.

The transport keeps NCCL's rules (:mod:`lightning_pipe.schedules.rendezvous`), so every emulated run
also runs the schedule as a GPU job would: no tags (one queue per channel, a direction of a pair and a
message kind, as :class:`~lightning_pipe.engine.p2p.ChannelGroups` has one process group per channel;
messages received strictly in the order they were sent) and rendezvous sends (a send's request
is complete only once its receive ran; the executor's wait on it fails otherwise).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.engine.executor import Executor, RunOptions
from lightning_pipe.engine.p2p import ACTIVATION_TAG, GRADIENT_TAG, TAGS_PER_LANE, Header, TensorMeta, flatten_activation
from lightning_pipe.engine.watchdog import Watchdog
from lightning_pipe.errors import MessageMismatchError
from lightning_pipe.schedules.communication import peer
from lightning_pipe.schedules.ir import Kind, Placement, Schedule, locate_virtual_stage, virtual_stage_of

Channel = tuple[int, int, str]  # (source device, destination device, message kind): one queue each, as on NCCL


class _Sent:
    """A send's request: complete once the receiver took the message (NCCL's rendezvous)."""

    def __init__(self, what: str, src: int, dst: int) -> None:
        self.what, self.src, self.dst = what, src, dst
        self.received = False

    def wait(self, timeout: object = None) -> None:
        if not self.received:
            raise RuntimeError(
                f"device {self.src} waits for device {self.dst} to take its {self.what}, which it has not taken: on "
                "NCCL a send completes only when its receive runs, so this order would hang a GPU job."
            )


class _Done:
    """A completed request: a local message is there when its receive runs."""

    def wait(self, timeout: object = None) -> None:
        return None


class LocalTransport:
    """The :class:`~.p2p.Transport` interface over in-process queues, for device ``rank``, with NCCL's rules.

    It is untagged and receives only at the compute action (``receives_ahead = False``); a receive takes the oldest message
    of its channel, as NCCL, which ignores tags, would deliver it: whatever that message is for, so a
    receive out of the channel's order gets the wrong micro-batch's tensors. It must only run after the
    send (the pipeline's order guarantees it).

    Args:
        rank: this device's index in the pipeline.
        queues: the pipeline's channels, shared by every device's transport.
        sent: messages ever sent per channel (the pipeline reads it to decide what may run).
    """

    tagged = False
    receives_ahead = False  # a receive takes its message at once: it must wait for its action

    def __init__(self, rank: int, queues: dict[Channel, deque[Any]], sent: dict[Channel, int]) -> None:
        self.rank = rank
        self.queues = queues
        self.sent = sent
        self._payload: dict[int, tuple[Tensor, ...]] = {}

    def _put(self, dst: int, what: str, message: Any) -> _Sent:
        channel = (self.rank, dst, what)
        request = _Sent(what, self.rank, dst)
        self.queues.setdefault(channel, deque()).append((message, request))
        self.sent[channel] = self.sent.get(channel, 0) + 1
        return request

    def _take(self, src: int, what: str) -> Any:
        queue = self.queues.get((src, self.rank, what))
        if not queue:
            raise RuntimeError(f"device {self.rank} receives a {what} from device {src} before it was sent.")
        message, request = queue.popleft()
        request.received = True
        return message

    # ``lane`` is accepted for the Transport interface; a channel here is already one link's queue
    def send_activation(self, value: Any, dst: int, lane: int = 0,
                        header: bool = True, micro_batch: int = -1) -> list[tuple[Any, Tensor]]:
        flat = flatten_activation(value)
        assert flat is not None, "stage outputs are checked before they are sent"
        tensors = tuple(t.detach() for t in flat[0])
        # the header stays in host memory: it is decoded here, in this process, so a copy to the device and
        # the .tolist() back would only cost a host synchronisation per header (issue 30)
        encoded = Header.of_flat(*flat).encode(torch.device("cpu")) if header else None
        return [(self._put(dst, "activation", (encoded, tensors)), tensors[0])]

    def send_gradients(self, grads: Sequence[Tensor], dst: int, lane: int = 0,
                       micro_batch: int = -1) -> list[tuple[Any, Tensor]]:
        grads = tuple(g.detach() for g in grads)
        return [(self._put(dst, "gradient", grads), grads[0] if grads else None)]

    def post_header(self, src: int, lane: int = 0) -> tuple[Any, Tensor]:
        header, tensors = self._take(src, "activation")
        if header is None:
            raise RuntimeError(f"device {self.rank} reads a shape header device {src} did not send: the two disagree "
                               "on which activations carry one.")
        self._payload[src] = tensors
        return _Done(), header

    def post_payload(self, metas: Sequence[TensorMeta], src: int, tag: int,
                     micro_batch: int = -1) -> list[tuple[Any, Tensor]]:
        kind = tag % TAGS_PER_LANE
        if kind == ACTIVATION_TAG and src in self._payload:  # its header was read
            tensors = self._payload.pop(src)
        elif kind == ACTIVATION_TAG:
            header, tensors = self._take(src, "activation")
            if header is not None:
                raise RuntimeError(f"device {self.rank} skips a shape header device {src} sent: the two disagree on "
                                   "which activations carry one.")
        elif kind == GRADIENT_TAG:
            tensors = self._take(src, "gradient")
        else:  # pragma: no cover - the executor only receives these two
            raise ValueError(f"unknown tag {tag}")
        if len(tensors) != len(metas):
            raise RuntimeError(f"device {self.rank} expected {len(metas)} tensors from device {src}, got {len(tensors)}.")
        arrived = [tuple(t.shape) for t in tensors]
        if arrived != [meta.shape for meta in metas]:  # what a receive buffer of the wrong size would hold
            raise MessageMismatchError(f"device {src} sent shapes {arrived} where {[m.shape for m in metas]} were expected")
        return [(_Done(), t) for t in tensors]


class LocalPipeline:
    """Runs schedules of a ``stages``-device pipeline in this process; used like one :class:`Executor`.

    Args:
        stages: devices of the emulated pipeline.
        chunks_per_stage: chunks each device holds (``interleaved_1f1b``, ``zbv``, ``dualpipev``).
        watchdog: passed to every executor (local waits never block).
        names: human names of the virtual stages, indexed by virtual stage.
        shape_headers: passed to every executor (:class:`~.executor.Executor`).
        placement: where the chunks sit (the schedule's; ``"v"`` for ``zbv``).
    """

    def __init__(
        self, stages: int, chunks_per_stage: int = 1, watchdog: Watchdog | None = None, names: Sequence[str] | None = None,
        shape_headers: str = "on_change", placement: Placement = "loop",
    ) -> None:
        self.stages, self.chunks_per_stage, self.placement = stages, chunks_per_stage, placement
        self.queues: dict[Channel, deque[Any]] = {}
        self.sent: dict[Channel, int] = {}
        self._claimed: dict[Channel, int] = {}  # receive actions already passed, per channel
        ranks = list(range(stages))
        self.executors = [
            Executor(
                d, ranks, [], LocalTransport(d, self.queues, self.sent), watchdog,
                names=[names[self._virtual_stage(d, c)] for c in range(chunks_per_stage)] if names else None,
                shape_headers=shape_headers,
            )
            for d in range(stages)
        ]

    @property
    def chunks(self) -> list[Callable[[Any, Any], Any]]:
        """The chunk callables of every virtual stage, indexed by virtual stage."""
        where = [locate_virtual_stage(vs, self.stages, self.placement) for vs in range(self.stages * self.chunks_per_stage)]
        return [self.executors[d].chunks[c] for d, c in where]

    @chunks.setter
    def chunks(self, callables: Sequence[Callable[[Any, Any], Any]]) -> None:
        for d, executor in enumerate(self.executors):
            executor.chunks = [callables[self._virtual_stage(d, c)] for c in range(self.chunks_per_stage)]

    def _virtual_stage(self, device: int, chunk: int) -> int:
        return virtual_stage_of(device, chunk, self.stages, self.placement)

    @contextmanager
    def current_weights(self) -> Iterator[None]:
        """Every device computes on the module's own weights within the block (see :meth:`Executor.current_weights`)."""
        with ExitStack() as stack:
            for executor in self.executors:
                stack.enter_context(executor.current_weights())
            yield

    @property
    def policies(self) -> list[Any]:
        return [executor.policy for executor in self.executors]

    def run(self, schedule: Schedule, micro_batches: Sequence[Any], options: RunOptions = RunOptions()) -> list[Any]:
        """Run every device's actions (arguments and result as :meth:`Executor.run`). Nothing is entered around
        actions (``options.last_backward`` and the chunk wrappers are not used): in one process nothing could
        overlap a gradient reduction, so a reducer does all its work after the run, and an emulated pipeline
        has no data-parallel copies to shard across."""
        if (schedule.stages, schedule.chunks, schedule.placement) != (self.stages, self.chunks_per_stage, self.placement):
            raise ValueError(
                f"this pipeline emulates {self.stages} stages × {self.chunks_per_stage} chunks placed {self.placement!r}; "
                f"the schedule has {schedule.stages} × {schedule.chunks} placed {schedule.placement!r}."
            )
        for executor in self.executors:
            executor.begin(schedule, micro_batches, options.without_wrappers())
        position = [0] * self.stages
        try:
            progress = True
            while progress:
                progress = False
                for d, executor in enumerate(self.executors):
                    actions = schedule.actions[d]
                    while position[d] < len(actions) and self._may_run(schedule, d, actions[position[d]]):
                        executor.execute(position[d])
                        position[d] += 1
                        progress = True
            stuck = [d for d in range(self.stages) if position[d] < len(schedule.actions[d])]
            if stuck:
                where = ", ".join(f"stage {d} at {schedule.actions[d][position[d]]}" for d in stuck)
                raise RuntimeError(f"the emulated pipeline cannot go on: {where} wait for messages never sent.")
            outputs = [executor.end() for executor in self.executors]
        except BaseException:
            self.abort()
            raise
        last_device, _ = schedule.locate(schedule.virtual_stages - 1)
        return outputs[last_device]

    def _may_run(self, schedule: Schedule, device: int, action: Any) -> bool:
        """A receive may pass once its channel holds a message no earlier receive has claimed."""
        if not action.kind.is_recv:
            return True
        other, _ = peer(action.kind, device, action.chunk, schedule.stages, schedule.placement)
        channel = (other, device, "activation" if action.kind is Kind.RECV_ACTIVATION else "gradient")
        claimed = self._claimed.get(channel, 0)
        if self.sent.get(channel, 0) <= claimed:
            return False
        self._claimed[channel] = claimed + 1
        return True

    def finish(self) -> None:
        """End of a segment: every message was received and nothing is in flight."""
        for executor in self.executors:
            executor.finish()
        leftover = {f"{src}->{dst} {kind}": len(q) for (src, dst, kind), q in self.queues.items() if q}
        if leftover:
            raise RuntimeError(f"the emulated pipeline ended a segment with messages nobody received: {leftover}.")

    def abort(self) -> None:
        """Forget everything in flight after a failure."""
        for executor in self.executors:
            executor.abort()
        self.queues.clear()
        self.sent.clear()
        self._claimed.clear()
