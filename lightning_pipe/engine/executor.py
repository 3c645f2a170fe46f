"""Run one device's action list.

The executor is the only place where compute and communication meet. It knows nothing about
Lightning: a chunk is any callable ``fn(inputs, micro_batch)`` (see :mod:`.stage`), the first
virtual stage receives ``inputs=None`` and reads its micro-batch, the last one returns a scalar
loss. Tests and benchmarks drive it directly.

Rules that keep it deadlock-free and overlapped:

* sends are asynchronous and are only waited for at the end of :meth:`Executor.run` (gloo sends
  complete when the peer receives, so waiting earlier can deadlock). The executor keeps only the
  requests, not the sent buffers: a request holds its tensor until the transfer ends (gloo's and
  NCCL's works stash it, the shared-memory send drops it once copied), so a sent gradient is freed
  when its transfer completes, not at the end of the step: O(P) boundary tensors alive, not O(M);
* before each compute action, receives up to the next compute action are posted, so transfers run
  while this rank computes. Gradients and activations whose shapes are known (most of them:
  :class:`~.p2p.ShapeCache`) travel early. An activation with a shape header can only have its payload
  posted once the header is read, which is when the compute that needs it waits: gloo's
  ``Work.is_completed()`` stays ``False`` until ``wait()`` and a timed-out ``wait`` closes the
  connection, so there is no way to learn earlier that a header has arrived;
* every wait goes through the :class:`~.watchdog.Watchdog`, so a failed peer ends this rank too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, ContextManager, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_pipe.engine.grad_cosine import GradientProbe, buffers_kept, cosine, detached, replayed_rng, rng_state
from lightning_pipe.engine.p2p import (
    ACTIVATION_TAG,
    GRADIENT_TAG,
    Header,
    MessageTransport,
    ShapeCache,
    flatten_activation,
    is_differentiable,
    lane_tag,
)
from lightning_pipe.engine.policies import WeightPolicy
from lightning_pipe.engine.recompute_guard import refuse_recomputation
from lightning_pipe.engine.recorder import ActionRecorder
from lightning_pipe.engine.split_backward import backward_input
from lightning_pipe.engine.watchdog import Watchdog
from lightning_pipe.engine.weight_worker import WORKER, overlaps
from lightning_pipe.errors import MessageMismatchError, StageOutputError
from lightning_pipe.schedules.ir import Action, Kind, Schedule

StageFn = Callable[[Any, Any], Any]
#: What crosses a stage boundary: a tensor, or tensors in tuples nested to any depth (``None`` entries allowed).
Activation = Tensor | tuple[Any, ...]
#: The actions that may run while a ``W`` runs in the background (weight_worker.py): none of them adds to or
#: reads a weight gradient (an ``I`` that cannot split waits before its whole backward). A tuple: its ``in``
#: compares identities, where a set would call the enum's Python ``__hash__`` at every action.
_BESIDE_BACKGROUND_W = (Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.SEND_ACTIVATION,
                        Kind.SEND_GRADIENT, Kind.RECV_ACTIVATION, Kind.RECV_GRADIENT)


@dataclass
class _InFlight:
    """What a forward leaves behind for its backward."""

    inputs: tuple[Tensor, ...] = ()
    output: Any = None
    weight: float = 1.0
    header: Header | None = None  # what the output's message announces
    input_grads: list[Tensor] = field(default_factory=list)
    probe: GradientProbe | None = None  # the micro-batch grad_cosine measures (lightning_pipe.engine.grad_cosine)


@dataclass
class _PendingReceive:
    kind: Kind
    src: int
    lane: int = 0  # the link's tag lane (lane_tag)
    micro_batch: int = 0
    channel: tuple[int, int] | None = None  # an activation's (replica, sending virtual stage)
    header: tuple[Any, Tensor] | None = None
    decoded: Header | None = None
    payload: list[tuple[Any, Tensor]] | None = None


def _as_tensors(value: Activation) -> tuple[Tensor, ...]:
    flat = flatten_activation(value)
    assert flat is not None, "activations are checked (_checked_header) before they are stored or sent"
    return flat[0]


def _checked_header(value: Any, where: str) -> Header:
    """The header of a stage output that can cross a boundary; else a :class:`StageOutputError` that says why not."""
    flat = flatten_activation(value)
    if flat is None:
        raise StageOutputError(
            f"{where} returned {_describe(value)}; a pipeline stage must return a tensor, or tensors in tuples or "
            "lists (None entries allowed). Move the layer that builds this value next to the layer that consumes it "
            "(change balance)."
        )
    if any(t.is_nested for t in flat[0]):
        raise StageOutputError(
            f"{where} returned a nested tensor, which cannot cross a pipeline boundary (nn.TransformerEncoder makes "
            "one in evaluation, from a src_key_padding_mask without a mask); build the encoder with "
            "nn.TransformerEncoder(..., enable_nested_tensor=False)."
        )
    return Header.of_flat(*flat)


def _describe(value: Any) -> str:
    """A stage output's type, and for a container the first entry that cannot cross a boundary."""
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        bad = next((v for v in value if flatten_activation(v) is None and v is not None), None)
        if bad is not None:
            return f"a {type(value).__name__} holding {_describe(bad)}"
        if not value or all(v is None for v in value):
            return f"a {type(value).__name__} without tensors"
    return type(value).__name__


ActionWrapper = Callable[[], ContextManager[Any]]
"""A context manager factory the executor enters around chosen actions (gradient reduction that overlaps them)."""


@dataclass(frozen=True)
class RunOptions:
    """What one run needs beyond the schedule and its micro-batches. The defaults suit a flushed step with no
    loss scaling and no gradient reduction to overlap; :class:`~.local.LocalPipeline` takes the same options."""

    loss_weights: Sequence[float] | None = None
    """Each micro-batch loss is multiplied by its weight before backward, indexed like ``micro_batches``
    (default ``1/M``, so accumulated gradients are the (replica's) mini-batch mean)."""
    step: Callable[[], None] | None = None
    """Called at every STEP action when there is no weight policy (e.g. ``optimizer.step``)."""
    scale_loss: Callable[[Tensor], Tensor] | None = None
    """Applied to the weighted loss before backward (fp16 loss scaling)."""
    first_micro_batch: int = 0
    """Stream index of ``micro_batches[0]`` (an asynchronous segment's later windows)."""
    carry_over: bool = False
    """Keep micro-batches in flight and sends pending after the run (asynchronous windows); call
    :meth:`Executor.finish` after the segment's drain."""
    last_backward: ActionWrapper | None = None
    """Wraps this device's last backward of the run, after which its gradients are final (e.g.
    :meth:`~lightning_pipe.engine.collectives.GradientReducer.armed`)."""
    chunk_last_backward: ActionWrapper | None = None
    """Wraps the last backward of each chunk of this device, after which the gradients of that chunk's own
    layers are final (FSDP2's reduce-scatter, :mod:`~.sharding`)."""
    chunk_early_forward: ActionWrapper | None = None
    """Wraps every forward of a chunk but the one whose backward is the chunk's last: forwards whose backward
    only adds to gradients that a later one completes (FSDP2 units kept gathered for the step run them
    without FSDP2's hooks, :mod:`~.sharding`)."""

    def without_wrappers(self) -> RunOptions:
        """The same run with nothing entered around its actions (a pipeline emulated in one process, where
        no reduction could overlap and there are no data-parallel copies to shard across)."""
        return replace(self, last_backward=None, chunk_last_backward=None, chunk_early_forward=None)


@runtime_checkable
class ScheduleRunner(Protocol):
    """What runs a schedule for one training step (or one window of an asynchronous segment):
    :class:`Executor` (this device's list) and :class:`~.local.LocalPipeline` (every device's, in one process)
    conform structurally. Arguments and result as :meth:`Executor.run`."""

    def run(self, schedule: Schedule, micro_batches: Sequence[Any], options: RunOptions = RunOptions()) -> list[Any]:
        """Run the schedule's actions; what the last virtual stage returned for each micro-batch forwarded."""
        ...

    def current_weights(self) -> ContextManager[None]:
        """Within: the weights evaluation and checkpoints read (an asynchronous policy's current version)."""
        ...

    def finish(self) -> None:
        """At the end of a segment: wait for the pending sends and forget what is in flight."""
        ...

    def abort(self) -> None:
        """Forget everything in flight after a failure."""
        ...


class Executor:
    """Executes a :class:`~lightning_pipe.schedules.Schedule` on one device of one pipeline (a :class:`ScheduleRunner`).

    Args:
        schedule_device: index of this device in the pipeline (``0 .. P-1``).
        ranks: global rank of every device of this pipeline.
        chunks: the callable of each chunk this device holds, indexed by chunk.
        transport: point-to-point layer (``None`` only for single-device pipelines).
        watchdog: bounds every wait; default: no error reports, 30 minutes.
        names: human names of the chunks for error messages (e.g. ``"stage 1 (trunk layers 4-7)"``).
        policy: the weight policy of an asynchronous schedule (``None``: the current weights, and
            STEP calls the ``step`` of the run's :class:`RunOptions`).
        recorder: while ``recorder.enabled``, every action's start and end are recorded (a receive
            when its compute waits for it); ``None``: nothing is timed.
        shape_headers: ``"on_change"``: an activation carries its shapes only when its micro-batch's
            shapes differ from the previous one's on the same link (:class:`~.p2p.ShapeCache`), so most
            receives are posted at once, with no header to read; ``"always"``: every activation does.
    """

    def __init__(
        self,
        schedule_device: int,
        ranks: Sequence[int],
        chunks: Sequence[StageFn],
        transport: MessageTransport | None = None,
        watchdog: Watchdog | None = None,
        names: Sequence[str] | None = None,
        policy: WeightPolicy | None = None,
        recorder: ActionRecorder | None = None,
        shape_headers: str = "on_change",
    ) -> None:
        self.device_index = schedule_device
        self.ranks = list(ranks)
        self.chunks = list(chunks)
        self.transport = transport
        self.watchdog = watchdog or Watchdog(timeout=1800.0)
        # NCCL's waits only order the CUDA stream, so the host keeps queueing compute (watchdog.stream_ordered)
        self._stream_ordered = bool(getattr(transport, "stream_ordered", False))
        self.names = list(names or [])
        self.policy = policy
        self.recorder = recorder
        self._recording: ActionRecorder | None = None
        self._started = 0.0
        self._options = RunOptions()  # the current run's (begin)
        self._in_flight: dict[tuple[int, int, int], _InFlight] = {}  # (replica, chunk, micro-batch)
        # a split backward's W and the device of its graph, by the same key
        self._deferred: dict[tuple[int, int, int], tuple[Callable[[], None], torch.device | None]] = {}
        self._overlap_w = False  # a W dispatched now may go to the background worker (weight_worker.py)
        self._send_windows: deque[list[Any]] = deque()  # the requests of each run's sends
        if shape_headers not in ("on_change", "always"):
            raise ValueError(f"shape_headers={shape_headers!r}: use 'on_change' or 'always'.")
        self._shapes = ShapeCache(always=shape_headers == "always")
        #: wraps grad_cosine's recompute of a forward (Lightning: ``self.log`` is not recorded a second time)
        self.recompute_context: Callable[[], ContextManager[Any]] = nullcontext
        if len(self.ranks) > 1 and transport is None:
            raise ValueError("a pipeline with more than one device needs a Transport.")

    # ------------------------------------------------------------------ public
    def run(self, schedule: Schedule, micro_batches: Sequence[Any], options: RunOptions = RunOptions()) -> list[Any]:
        """Run this device's actions for one step (or one window of an asynchronous segment).

        Args:
            schedule: the schedule (all devices run the same one).
            micro_batches: the micro-batches whose forwards this run starts; micro-batch ``g`` is
                ``micro_batches[g - options.first_micro_batch]``. Only the first and last stage read them, but
                with ``shape_headers="on_change"`` every stage must be given the same ones: their shapes
                decide, on both ends of a link, which activations carry a shape header. With
                several replicas (avgpipe), replica ``r``'s micro-batch ``j`` is at ``r * M + j``
                (``M = schedule.micro_batches``), and so are ``options.loss_weights``.
            options: loss weights, the step without a weight policy, loss scaling, an asynchronous window's
                place in its segment, and what to enter around chosen actions (:class:`RunOptions`).

        Returns:
            What the last virtual stage returned for every micro-batch forwarded in this run (in
            the order of ``micro_batches``), on the device holding it (the detached, unweighted loss when training; the raw output for
            a forward-only schedule); an empty list elsewhere.
        """
        self.begin(schedule, micro_batches, options)
        try:
            for index in range(len(schedule.actions[self.device_index])):
                self.execute(index)
            return self.end()
        except BaseException:
            self.abort()
            raise

    @contextmanager
    def current_weights(self) -> Iterator[None]:
        """Within the block, compute runs on the module's own weights, bypassing any weight policy:
        evaluation sees exactly what a checkpoint saved now holds, whatever version a training
        forward of the policy would see (2BW's previous one, xpipe's prediction)."""
        policy, self.policy = self.policy, None
        try:
            yield
        finally:
            self.policy = policy

    # ------------------------------------------------------------------ one action at a time
    # ``run`` is begin, execute every index, end. An in-process pipeline (engine/local.py) calls the
    # same three on several executors, interleaving their actions in one valid global order.
    def begin(self, schedule: Schedule, micro_batches: Sequence[Any], options: RunOptions = RunOptions()) -> None:
        """Prepare a run (arguments as in :meth:`run`)."""
        carry_over, loss_weights = options.carry_over, options.loss_weights
        if not carry_over and len(micro_batches) != schedule.micro_batches * schedule.replicas:
            raise ValueError(
                f"schedule expects {schedule.micro_batches * schedule.replicas} micro-batches, got {len(micro_batches)}."
            )
        self._schedule = schedule
        self._micro_batches = micro_batches
        self._options = options
        if not carry_over:  # a flushed run: every link starts empty on both sides
            self._shapes.reset()
        count = max(len(micro_batches) // schedule.replicas, 1)  # each replica's gradient is its mini-batch mean
        self._weights = list(loss_weights) if loss_weights is not None else [1.0 / count] * max(len(micro_batches), 1)
        # the last backward that accumulates weight gradients (a W, in a split one)
        backwards = [i for i, a in enumerate(schedule.actions[self.device_index])
                     if a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)]
        last_backward = options.last_backward
        self._last_backward = (backwards[-1], last_backward) if backwards and last_backward is not None else None
        actions = schedule.actions[self.device_index]
        last_of_chunk = {actions[i].chunk: i for i in backwards}
        chunk_last_backward, chunk_early_forward = options.chunk_last_backward, options.chunk_early_forward
        self._chunk_last_backward = (set(last_of_chunk.values()), chunk_last_backward) if chunk_last_backward else None
        self._chunk_early_forward = None
        if chunk_early_forward is not None:
            completing = {(actions[i].chunk, actions[i].micro_batch) for i in last_of_chunk.values()}
            early = {i for i, a in enumerate(actions) if a.kind is Kind.FORWARD and (a.chunk, a.micro_batch) not in completing}
            self._chunk_early_forward = (early, chunk_early_forward)
        self._received: dict[tuple[Kind, int, int], _PendingReceive] = {}
        self._header_decisions: dict[tuple[Kind, int, int, int], bool] = {}  # receives that could not be posted yet
        self._taken: set[tuple[Kind, int, int, int]] = set()  # receives their compute consumed this run
        self._outputs: dict[tuple[int, int], Any] = {}  # (replica, micro-batch)
        self._posted = 0
        # a send is received at the latest in the peer's next window, so older ones are complete
        while len(self._send_windows) > 1:
            self._wait_sends(self._send_windows.popleft())
        self._sends: list[Any] = []
        self._send_windows.append(self._sends)
        self._recording = self.recorder if self.recorder is not None and self.recorder.enabled else None
        # a weight policy's versions and a recording's action times need each W to run where it is dispatched
        self._overlap_w = self.policy is None and self._recording is None

    def execute(self, index: int) -> None:
        """Run action ``index`` of this device's list (after :meth:`begin`, in list order)."""
        actions = self._schedule.actions[self.device_index]
        action = actions[index]
        last = self._last_backward is not None and index == self._last_backward[0]
        chunk_last = self._chunk_last_backward is not None and index in self._chunk_last_backward[0]
        early = self._chunk_early_forward is not None and index in self._chunk_early_forward[0]
        if not (last or chunk_last or early):
            if action.kind not in _BESIDE_BACKGROUND_W:  # it adds to or reads weight gradients
                WORKER.join()
            self._execute(actions, index, action)
            return
        WORKER.join()  # a gradient-reduction context sees every gradient it reduces complete
        overlap, self._overlap_w = self._overlap_w, False  # and a W it wraps runs inside it, here
        try:
            with ExitStack() as wrapped:
                if last:
                    wrapped.enter_context(self._last_backward[1]())  # type: ignore[index]
                if chunk_last:
                    wrapped.enter_context(self._chunk_last_backward[1]())  # type: ignore[index]
                if early:
                    wrapped.enter_context(self._chunk_early_forward[1]())  # type: ignore[index]
                self._execute(actions, index, action)
        finally:
            self._overlap_w = overlap

    def _execute(self, actions: Sequence[Action], index: int, action: Action) -> None:
        if action.kind.is_compute:
            self._post_receives(actions, index)
        recording = self._recording
        if recording is None or action.kind.is_recv:  # receives are timed where they are waited for
            self._dispatch(action)
            return
        self._started = recording.clock()
        self._dispatch(action)
        recording.record(action, self._started, recording.clock())

    def end(self) -> list[Any]:
        """Finish a run; return what :meth:`run` returns."""
        if self._options.carry_over:
            WORKER.join()  # the caller reads the gradients next (finish waits for it too)
        else:
            self.finish()
        return [self._outputs[key] for key in sorted(self._outputs)]

    def abort(self) -> None:
        """Forget everything in flight after a failure."""
        WORKER.discard()
        self._in_flight.clear()
        self._deferred.clear()
        self._send_windows.clear()
        self._shapes.reset()

    def finish(self) -> None:
        """Wait for every pending send and forget the micro-batches in flight (end of a segment)."""
        WORKER.join()
        while self._send_windows:
            self._wait_sends(self._send_windows.popleft())
        self._in_flight.clear()
        self._deferred.clear()
        self._shapes.reset()

    def _wait_sends(self, sends: list[Any]) -> None:
        for work in sends:
            self.watchdog.wait(work, "a peer to receive this stage's messages", stream_ordered=self._stream_ordered)

    # ------------------------------------------------------------------ actions
    def _dispatch(self, action: Action) -> None:
        kind = action.kind
        if self.policy is not None and (kind.is_compute or kind in (Kind.STEP, Kind.AVG)):
            self.policy.select(action.replica)
        if kind is Kind.FORWARD:
            self._forward(action)
        elif kind.takes_gradient:
            self._backward(action)
        elif kind is Kind.BACKWARD_WEIGHT:
            deferred = self._deferred.pop((action.replica, action.chunk, action.micro_batch), None)
            if deferred is not None:  # None: the I before it could not split and ran the whole backward
                run, device = deferred
                if self._overlap_w and device is not None and overlaps(device):
                    WORKER.submit(run, device)
                else:
                    run()
        elif kind is Kind.SEND_ACTIVATION:
            key = (action.replica, action.chunk, action.micro_batch)
            # a forward-only schedule has no backward to keep the activation for
            flight = self._in_flight.pop(key) if self._schedule.forward_only else self._in_flight[key]
            channel = (action.replica, self._virtual_stage(action.chunk))
            header = self._shapes.needs_header(channel, self._micro_batches[self._slot(action)])
            if header:
                self._shapes.remember(channel, flight.header)
            else:
                self._shapes.check(self._shapes.header(channel), flight.header, self._name(action.chunk))
            peer = self._peer_rank(action)
            with self.watchdog.guard(f"rank {peer} to take {action}", peer):  # gloo may fail at the post itself
                sent = self.transport.send_activation(flight.output, peer, self._lane(action), header=header,
                                                      micro_batch=action.micro_batch)
                self._sends += self._requests(sent)
        elif kind is Kind.SEND_GRADIENT:
            flight = self._in_flight.pop((action.replica, action.chunk, action.micro_batch))
            peer = self._peer_rank(action)
            with self.watchdog.guard(f"rank {peer} to take {action}", peer):
                sent = self.transport.send_gradients(flight.input_grads, peer, self._lane(action),
                                                     micro_batch=action.micro_batch)
                self._sends += self._requests(sent)
        elif kind.is_recv:
            pass  # consumed by the compute action that needs it (see _take)
        elif kind is Kind.STEP:
            if self.policy is not None:
                self.policy.step()
            elif self._options.step is not None:
                self._options.step()
        elif kind is Kind.AVG:
            if self.policy is None:
                raise RuntimeError("an AVG action needs a weight policy that averages (engine.policies.averaging.ElasticAveraging).")
            self.policy.average()
        else:  # pragma: no cover - new kinds must be handled explicitly
            raise NotImplementedError(kind)

    @staticmethod
    def _requests(sent: list[tuple[Any, Tensor]]) -> list[Any]:
        """The requests of a send, without the buffers: each request keeps its own until done."""
        return [work for work, _ in sent]

    def _name(self, chunk: int) -> str:
        return self.names[chunk] if chunk < len(self.names) else f"stage {self.device_index} chunk {chunk}"

    def _virtual_stage(self, chunk: int) -> int:
        return self._schedule.virtual_stage(self.device_index, chunk)

    def _lane(self, action: Action) -> int:
        """The lane (:func:`~.p2p.lane_tag`) of the link a communication action's message travels on:
        its replica and the virtual stage that sends it."""
        vs = self._virtual_stage(action.chunk)
        sender = vs - 1 if action.kind is Kind.RECV_ACTIVATION else vs + 1 if action.kind is Kind.RECV_GRADIENT else vs
        return action.replica * self._schedule.virtual_stages + sender

    def _slot(self, action: Action) -> int:
        """Index of the action's micro-batch in this run's ``micro_batches`` and ``loss_weights``."""
        return action.replica * self._schedule.micro_batches + action.micro_batch - self._options.first_micro_batch

    def _forward(self, action: Action) -> None:
        chunk, mb = action.chunk, action.micro_batch
        vs = self._virtual_stage(chunk)
        flight = _InFlight(weight=self._weights[self._slot(action)] if self._weights else 1.0)
        inputs = None
        if vs > 0:
            inputs = self._local_activation(action) if self._is_local(vs - 1) else self._take_activation(action)
            flight.inputs = tuple(t for t in _as_tensors(inputs) if t.requires_grad)
        micro_batch = self._micro_batches[self._slot(action)]
        if self.policy is not None and self.policy.take_cosine_request():  # before the forward draws from the RNG
            flight.probe = GradientProbe(detached(inputs), micro_batch, rng_state(self._policy_device()))
        with self.policy.forward(mb) if self.policy else nullcontext():
            output = self.chunks[chunk](inputs, micro_batch)
        if vs == self._schedule.virtual_stages - 1:
            if self._schedule.forward_only:
                self._outputs[(action.replica, mb)] = output
                return
            if not isinstance(output, Tensor) or output.numel() != 1:
                raise StageOutputError(f"{self._name(chunk)} must return a scalar loss, got {type(output).__name__}.")
            self._outputs[(action.replica, mb)] = output.detach()
        else:
            flight.header = _checked_header(output, self._name(chunk))
        flight.output = output
        self._in_flight[(action.replica, chunk, mb)] = flight

    def _backward(self, action: Action) -> None:
        """B, or I of a split backward: the input's gradient now, the weights' at the matching W."""
        chunk, mb = action.chunk, action.micro_batch
        vs = self._virtual_stage(chunk)
        key = (action.replica, chunk, mb)
        flight = self._in_flight[key]
        grads = None
        if vs < self._schedule.virtual_stages - 1:
            grads = self._local_gradients(action) if self._is_local(vs + 1) else self._take_gradients(action)
        with self.policy.backward(mb) if self.policy else nullcontext(), self._forwards_refused(chunk):
            roots, root_grads = self._backward_roots(flight, grads)
            if flight.probe is not None and action.kind is Kind.BACKWARD and roots and self.policy.params:
                # the stale gradient on the same graph, kept for the regular backward, which runs unchanged
                flight.probe.stale = torch.autograd.grad(roots, self.policy.used_tensors(mb), root_grads,
                                                         retain_graph=True, allow_unused=True)
            if action.kind is Kind.BACKWARD:
                if roots:
                    torch.autograd.backward(roots, root_grads)
            elif flight.inputs and roots:
                input_grads, deferred = backward_input(roots, root_grads, flight.inputs, before_whole_backward=WORKER.join)
                for tensor, grad in zip(flight.inputs, input_grads):
                    tensor.grad = grad
                if deferred is not None:
                    self._deferred[key] = (deferred.run, deferred.device)
            elif roots:  # no input gradient to send (the first virtual stage): W runs the whole backward
                self._deferred[key] = (lambda: torch.autograd.backward(roots, root_grads), roots[0].device)
        if self.policy is not None:
            self.policy.finished(mb)
        flight.output = None  # free the graph before anything else runs
        if flight.probe is not None and flight.probe.stale is not None:
            fresh = self._applied_gradient(chunk, flight, grads)
            self.policy.record_cosine(cosine(flight.probe.stale, fresh))
            self.policy.record_descent(flight.probe.stale, fresh)
        flight.probe = None
        if vs > 0:
            flight.input_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in flight.inputs]
            flight.inputs = ()
        else:
            self._in_flight.pop(key)

    def _forwards_refused(self, chunk: int) -> ContextManager[Any]:
        """Around a backward under a policy that keeps no forward weights: a recomputed forward is refused."""
        if self.policy is None or self.policy.keeps_forward_weights:
            return nullcontext()
        return refuse_recomputation(self._name(chunk), type(self.policy).__name__)

    def _policy_device(self) -> torch.device:
        """The device of the policy's weights (whose RNG stream a measured forward's recompute replays)."""
        return next(iter(self.policy.params.values())).device if self.policy.params else torch.device("cpu")

    def _applied_gradient(self, chunk: int, flight: _InFlight, grads: list[Tensor] | None) -> Sequence[Tensor | None]:
        """grad_cosine's other side: the measured micro-batch's gradient at the weights the STEP updates, from
        the same input activation and the same output gradient (the last stage: its own weighted loss),
        with the RNG stream its forward saw. Touches no ``.grad``, RNG stream or buffer of training."""
        probe, policy = flight.probe, self.policy
        with self.recompute_context(), policy.bind_applied(), buffers_kept(policy.root), \
                replayed_rng(probe.rng, self._policy_device()), torch.enable_grad():
            output = self.chunks[chunk](probe.inputs, probe.micro_batch)
            if grads is not None:
                _checked_header(output, self._name(chunk))
            again = _InFlight(output=output, weight=flight.weight, header=flight.header)
            roots, root_grads = self._backward_roots(again, grads)
            if not roots:
                return [None] * len(policy.params)
            return torch.autograd.grad(roots, policy.applied_tensors(), root_grads, allow_unused=True)

    def _backward_roots(self, flight: _InFlight, grads: list[Tensor] | None) -> tuple[list[Tensor], list[Tensor | None]]:
        """What backward starts from: the weighted (and scaled) loss, or the outputs that carry a gradient."""
        if grads is None:
            loss = flight.output * flight.weight
            if self._options.scale_loss is not None:
                loss = self._options.scale_loss(loss)
            return ([loss], [None]) if loss.requires_grad else ([], [])
        outputs = [t for t, m in zip(_as_tensors(flight.output), flight.header.metas) if is_differentiable(m)]
        return outputs, list(grads) if outputs else []

    # ------------------------------------------------------------------ neighbours on this device
    def _is_local(self, virtual_stage: int) -> bool:
        """Whether ``virtual_stage`` is one of this device's chunks (the turn of ZBV's V): it hands
        over in memory, without messages."""
        return self._schedule.locate(virtual_stage)[0] == self.device_index

    def _local_activation(self, forward: Action) -> Activation:
        _, chunk = self._schedule.locate(self._virtual_stage(forward.chunk) - 1)
        key = (forward.replica, chunk, forward.micro_batch)
        source = self._in_flight.pop(key) if self._schedule.forward_only else self._in_flight[key]
        tensors = [t.detach().requires_grad_(is_differentiable(m))
                   for t, m in zip(_as_tensors(source.output), source.header.metas)]
        return source.header.rebuild(tensors)

    def _local_gradients(self, backward: Action) -> list[Tensor]:
        _, chunk = self._schedule.locate(self._virtual_stage(backward.chunk) + 1)
        return self._in_flight.pop((backward.replica, chunk, backward.micro_batch)).input_grads

    # ------------------------------------------------------------------ receives
    def _peer_rank(self, action: Action) -> int:
        vs = self._virtual_stage(action.chunk)
        other = vs - 1 if action.kind in (Kind.RECV_ACTIVATION, Kind.SEND_GRADIENT) else vs + 1
        return self.ranks[self._schedule.locate(other)[0]]

    def _post_receives(self, actions: Sequence[Action], index: int) -> None:
        """Post receives in list order up to the compute action after ``actions[index]``. On an untagged
        backend (NCCL) the order is the messages' order on their direction's stream, so posting stops at
        an activation whose shape header must be read first: its compute posts it, header then payload,
        before anything after it."""
        if self.transport is None or not self.transport.receives_ahead:
            return  # in-process queues: a receive takes its message at once, so it waits for its action
        limit = next((k for k in range(index + 1, len(actions)) if actions[k].kind.is_compute), len(actions))
        while self._posted <= limit and self._posted < len(actions):
            action = actions[self._posted]
            if action.kind.is_recv and not self._post(action, ahead=True):
                break
            self._posted += 1

    def _post(self, action: Action, ahead: bool = False) -> bool:
        """Post one receive; ``False`` if it cannot be posted yet (gradient shapes unknown, or, ``ahead``
        of its compute on an untagged backend, a shape header to read first)."""
        key = (action.kind, action.replica, action.chunk, action.micro_batch)
        if key in self._received or key in self._taken:
            return True
        src = self._peer_rank(action)
        pending = _PendingReceive(action.kind, src, self._lane(action), action.micro_batch)
        if action.kind is Kind.RECV_ACTIVATION:
            pending.channel = (action.replica, self._virtual_stage(action.chunk) - 1)
            header = self._header_decisions.pop(key, None)
            if header is None:  # decided once per message, in the link's order, as the sender does
                header = self._shapes.needs_header(pending.channel, self._micro_batches[self._slot(action)])
            known = None if header else self._shapes.header(pending.channel)
            untagged_header = header and ahead and not self.transport.tagged
            if (not header and known is None) or untagged_header:  # the previous header is not read yet,
                self._header_decisions[key] = header  # or this one must be read before anything after it
                return False
            with self.watchdog.guard(f"{action} from rank {src}", src):
                if header:
                    pending.header = self.transport.post_header(src, pending.lane)
                else:
                    pending.decoded = known
                    pending.payload = self.transport.post_payload(known.metas, src, lane_tag(ACTIVATION_TAG, pending.lane),
                                                                  action.micro_batch)
        else:
            flight = self._in_flight.get((action.replica, action.chunk, action.micro_batch))
            if flight is None:
                return False
            metas = [m for m in flight.header.metas if is_differentiable(m)]
            with self.watchdog.guard(f"{action} from rank {src}", src):
                pending.payload = self.transport.post_payload(metas, src, lane_tag(GRADIENT_TAG, pending.lane),
                                                              action.micro_batch)
        self._received[key] = pending
        return True

    def _post_payload(self, pending: _PendingReceive) -> None:
        pending.decoded = Header.decode(pending.header[1])
        self._shapes.remember(pending.channel, pending.decoded)
        with self.watchdog.guard(f"an activation from rank {pending.src}", pending.src):
            pending.payload = self.transport.post_payload(
                pending.decoded.metas, pending.src, lane_tag(ACTIVATION_TAG, pending.lane), pending.micro_batch
            )

    def _take(self, action: Action) -> _PendingReceive:
        key = (action.kind, action.replica, action.chunk, action.micro_batch)
        if key not in self._received:
            if not self._post(action):
                raise RuntimeError(f"{action} cannot be received before its forward ran.")
        pending = self._received.pop(key)
        self._taken.add(key)
        what = f"{action} from rank {pending.src}"
        start = self._recording.clock() if self._recording is not None else 0.0
        try:
            if pending.payload is None:
                self.watchdog.wait(pending.header[0], f"the header of {what}", pending.src, self._stream_ordered)
                self._post_payload(pending)
            for work, _ in pending.payload:
                self.watchdog.wait(work, what, pending.src, self._stream_ordered)
        except MessageMismatchError as error:
            expected = [m.shape for m in pending.decoded.metas] if pending.decoded is not None else "its shapes"
            message = "activation" if action.kind is Kind.RECV_ACTIVATION else "gradient"
            raise MessageMismatchError(
                f"{self._name(action.chunk)} expected micro-batch {action.micro_batch}'s {message} ({action}) with shapes "
                f"{expected}, but {error}: the ranks disagree on the micro-batches (does every rank of a pipeline load "
                "the same batches, with the same sizes?) or on the schedule."
            ) from error
        if self._recording is not None:  # the wait, then the compute that needed it
            self._started = self._recording.clock()
            self._recording.record(action, start, self._started)
        return pending

    def _take_activation(self, forward: Action) -> Activation:
        pending = self._take(Action(Kind.RECV_ACTIVATION, forward.micro_batch, forward.chunk, forward.replica))
        tensors = []
        for (_, tensor), meta in zip(pending.payload, pending.decoded.metas):
            tensors.append(tensor.requires_grad_() if is_differentiable(meta) else tensor)
        return pending.decoded.rebuild(tensors)

    def _take_gradients(self, backward: Action) -> list[Tensor]:
        pending = self._take(Action(Kind.RECV_GRADIENT, backward.micro_batch, backward.chunk, backward.replica))
        return [tensor for _, tensor in pending.payload]
