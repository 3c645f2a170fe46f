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

from lightning_pipe.schedules.ir import Action, TimedAction


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

    def rows(self) -> list[dict]:
        """The events as plain dicts (JSON / pickling across processes)."""
        return [
            {"step": step, "device": e.device, "kind": e.action.kind.value, "micro_batch": e.action.micro_batch,
             "chunk": e.action.chunk, "replica": e.action.replica, "start": e.start, "end": e.end}
            for e, step in zip(self.events, self.steps)
        ]
