"""Record when each action of a measured run starts and ends.

The executor calls :meth:`ActionRecorder.record` around every action it runs while the recorder is
enabled: compute, STEP and sends (the time to post them) as listed, and each receive at the moment
the compute that needs it waits for the message, so time waiting for a peer is separate from
compute. Times come from ``time.time()``, one wall clock shared by every process of a host (across
hosts they are as close as the hosts' clocks, e.g. NTP), so ranks' events can be laid side by side
without an alignment step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.schedules.ir import Action, Kind, TimedAction


class ActionRecorder:
    """Collects this rank's timed actions while :attr:`enabled`.

    Args:
        device: the row the events belong to (a stage, or a global rank with several pipelines).
        clock: seconds; ``time.time`` so that processes on one host agree.
    """

    def __init__(self, device: int, clock: Callable[[], float] = time.time) -> None:
        self.device = device
        self.clock = clock
        self.enabled = False
        self.step = 0  #: label of the events recorded now (e.g. the training step)
        self.events: list[TimedAction] = []
        self.steps: list[int] = []

    def record(self, action: Action, start: float, end: float) -> None:
        self.events.append(TimedAction(self.device, action, start, end))
        self.steps.append(self.step)

    def resolve(self) -> None:
        """With an :class:`EventClock`, turn the recorded CUDA events into seconds (one device
        synchronisation for everything recorded since the last call); nothing with a host clock."""
        if not isinstance(self.clock, EventClock):
            return
        self.clock.synchronize()
        self.events = [e if isinstance(e.start, float) else
                       TimedAction(e.device, e.action, self.clock.seconds(e.start), self.clock.seconds(e.end))
                       for e in self.events]
        self.clock.reset()

    def rows(self) -> list[dict]:
        """The events as plain dicts (JSON / pickling across processes)."""
        return [
            {"step": step, "device": e.device, "kind": e.action.kind.value, "micro_batch": e.action.micro_batch,
             "chunk": e.action.chunk, "replica": e.action.replica, "start": e.start, "end": e.end}
            for e, step in zip(self.events, self.steps)
        ]


class EventClock:
    """A clock for :class:`ActionRecorder` on CUDA: each reading records a CUDA event on the current
    stream instead of waiting for the device, so timing does not serialise the host with the GPU.
    :meth:`ActionRecorder.resolve` later turns the events into ``time.time`` seconds, anchored at a
    host reading taken with the first event (so ranks on one host still share a clock).

    Args:
        device: the CUDA device whose streams the events are recorded on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._anchor: tuple[Any, float] | None = None

    def __call__(self) -> Any:
        if self._anchor is None:  # one synchronisation per resolved batch of events, to pin the host time
            self.synchronize()
            self._anchor = (self._event(), time.time())
        return self._event()

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def seconds(self, event: Any) -> float:
        """Host seconds of a recorded event (after :meth:`synchronize`)."""
        assert self._anchor is not None
        origin, host = self._anchor
        return host + origin.elapsed_time(event) / 1e3

    def reset(self) -> None:
        """Anchor the next events afresh (GPU and host clocks drift apart over a long run)."""
        self._anchor = None


class StepTimer:
    """Totals of the actions one training step recorded on this rank, for per-stage metrics.

    Used like :class:`ActionRecorder` by the executor (``enabled``, ``clock``, ``record``) but keeps
    only what :meth:`totals` needs. On CUDA ``clock`` records a CUDA event on the current stream
    instead of reading the host clock, so nothing waits for the device until :meth:`totals`, once per
    measured step.

    Args:
        device: where the stage computes; CUDA devices are timed with events.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.events = device is not None and device.type == "cuda"
        self.enabled = False
        self.step = 0
        self._spans: list[tuple[Kind, Any, Any]] = []

    def clock(self) -> Any:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def record(self, action: Action, start: Any, end: Any) -> None:
        self._spans.append((action.kind, start, end))

    def reset(self) -> None:
        self._spans = []

    def totals(self) -> StepTimes:
        """Seconds computing (forward, backward, STEP, AVG), waiting for peers' messages, and from the
        first recorded action's start to the last one's end."""
        if not self._spans:
            return StepTimes(0.0, 0.0, 0.0)
        if self.events:
            torch.cuda.synchronize(self.device)

        def seconds(start: Any, end: Any) -> float:  # CUDA events, or host seconds (a trace's clock shared)
            return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start
        compute = sum(seconds(s, e) for kind, s, e in self._spans if kind.is_compute or kind in (Kind.STEP, Kind.AVG))
        wait = sum(seconds(s, e) for kind, s, e in self._spans if kind.is_recv)
        span = seconds(self._spans[0][1], self._spans[-1][2])
        return StepTimes(compute, wait, max(span, compute + wait))


@dataclass(frozen=True)
class StepTimes:
    """What :meth:`StepTimer.totals` measured, in seconds."""

    compute: float
    wait: float
    span: float


class Fanout:
    """Several recorders fed by one executor (e.g. a trace and the per-stage metrics), on the first one's clock."""

    def __init__(self, *recorders: Any) -> None:
        self.recorders = recorders

    @property
    def enabled(self) -> bool:
        return any(r.enabled for r in self.recorders)

    def clock(self) -> Any:
        return self.recorders[0].clock()

    def record(self, action: Action, start: Any, end: Any) -> None:
        for recorder in self.recorders:
            if recorder.enabled:
                recorder.record(action, start, end)
