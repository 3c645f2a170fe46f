"""The schedule IR: per-device ordered action lists.

A schedule is data. The executor runs it, the validator proves it sound, and later the simulator and
the timeline renderer read the very same lists, so a new schedule is one generator function.

Vocabulary (docs/algorithms.md §0): ``P`` devices ("stages") per pipeline, each holding ``v``
chunks; ``M`` micro-batches per step. Where a chunk sits is the schedule's *placement*: ``"loop"``
puts chunk ``c`` of device ``d`` at virtual stage ``c * P + d`` (Megatron's interleaving), ``"v"``
walks down the devices and back up, so odd chunks count backwards: ``(c + 1) * P - 1 - d`` (ZBV's
V shape, where the first and the last virtual stage share device 0).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

#: How chunks map to virtual stages (module docstring).
Placement = Literal["loop", "v"]


class Kind(enum.Enum):
    """What an :class:`Action` does."""

    FORWARD = "F"
    BACKWARD = "B"
    # zero-bubble schedules split BACKWARD in two (docs/algorithms.md §4a):
    BACKWARD_INPUT = "I"  # the gradient of the stage's input: what the previous stage waits for
    BACKWARD_WEIGHT = "W"  # the gradients of the stage's weights: deferrable to fill the bubble
    STEP = "STEP"
    RECV_ACTIVATION = "RECV_ACT"
    SEND_ACTIVATION = "SEND_ACT"
    RECV_GRADIENT = "RECV_GRAD"
    SEND_GRADIENT = "SEND_GRAD"
    AVG = "AVG"  # avgpipe: elastic averaging of the replica's weights against the center copy

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)

    @property
    def takes_gradient(self) -> bool:
        """The backward that receives the output's gradient and sends the input's (B, or I of a split one)."""
        return self in (Kind.BACKWARD, Kind.BACKWARD_INPUT)

    @property
    def is_backward(self) -> bool:
        return self in (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_ACTIVATION, Kind.RECV_GRADIENT)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_ACTIVATION, Kind.SEND_GRADIENT)


@dataclass(frozen=True)
class Action:
    """One instruction of a device's action list.

    Args:
        kind: what to do.
        micro_batch: the micro-batch index (``None`` for STEP).
        chunk: which of the device's chunks (virtual stages) the action belongs to.
        replica: which parallel pipeline the action belongs to (avgpipe runs several on the same
            devices, each with its own weights; every other schedule has one, ``0``).
    """

    kind: Kind
    micro_batch: int | None = None
    chunk: int = 0
    replica: int = 0

    def __str__(self) -> str:
        replica = f"r{self.replica}:" if self.replica else ""
        if self.kind in (Kind.STEP, Kind.AVG):
            return replica + self.kind.value
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{replica}{self.kind.value}{self.micro_batch}{chunk}"


def F(micro_batch: int, chunk: int = 0) -> Action:
    """Forward of ``micro_batch`` on ``chunk``."""
    return Action(Kind.FORWARD, micro_batch, chunk)


def B(micro_batch: int, chunk: int = 0) -> Action:
    """Backward of ``micro_batch`` on ``chunk``."""
    return Action(Kind.BACKWARD, micro_batch, chunk)


def I(micro_batch: int, chunk: int = 0) -> Action:  # noqa: E743 - the name zero-bubble papers use
    """Input-gradient half of the backward of ``micro_batch`` on ``chunk``."""
    return Action(Kind.BACKWARD_INPUT, micro_batch, chunk)


def W(micro_batch: int, chunk: int = 0) -> Action:
    """Weight-gradient half of the backward of ``micro_batch`` on ``chunk`` (after its ``I``)."""
    return Action(Kind.BACKWARD_WEIGHT, micro_batch, chunk)


STEP = Action(Kind.STEP)


def virtual_stage_of(device: int, chunk: int, stages: int, placement: Placement = "loop") -> int:
    """Global index of ``chunk`` on ``device`` under ``placement``."""
    if placement == "v" and chunk % 2:
        return (chunk + 1) * stages - 1 - device
    return chunk * stages + device


def locate_virtual_stage(virtual_stage: int, stages: int, placement: Placement = "loop") -> tuple[int, int]:
    """``(device, chunk)`` holding ``virtual_stage`` under ``placement``."""
    chunk, offset = divmod(virtual_stage, stages)
    if placement == "v" and chunk % 2:
        return stages - 1 - offset, chunk
    return offset, chunk


@dataclass(frozen=True)
class Schedule:
    """Action lists of every device of one pipeline for one training step.

    Args:
        name: the generator that made it (``"gpipe"``, ``"1f1b"``, ...).
        stages: devices per pipeline ``P``.
        micro_batches: micro-batches per step ``M``.
        chunks: chunks (virtual stages) per device ``v``.
        actions: ``actions[d]`` is the ordered list device ``d`` executes.
        forward_only: an evaluation schedule (no backward, no STEP).
        step_every: backwards (per chunk) between two STEPs; ``None``: one STEP after everything
            (a flushing schedule). Asynchronous segments step every ``M`` micro-batches.
        replicas: parallel pipelines whose actions share the devices' lists (avgpipe), each
            with ``micro_batches`` micro-batches of its own; ``1`` for every other schedule.
        placement: where chunks sit (module docstring): ``"loop"``, or ``"v"`` for ZBV.
    """

    name: str
    stages: int
    micro_batches: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    forward_only: bool = False
    step_every: int | None = None
    replicas: int = 1
    placement: Placement = "loop"

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual_stage(self, device: int, chunk: int) -> int:
        """Global index of ``chunk`` on ``device``."""
        return virtual_stage_of(device, chunk, self.stages, self.placement)

    def locate(self, virtual_stage: int) -> tuple[int, int]:
        """``(device, chunk)`` holding ``virtual_stage``."""
        return locate_virtual_stage(virtual_stage, self.stages, self.placement)

    def compute_actions(self, device: int) -> list[Action]:
        """The device's actions without communication (what a picture or a table shows)."""
        return [a for a in self.actions[device] if not (a.kind.is_send or a.kind.is_recv)]

    def describe(self) -> str:
        """One line per device, e.g. ``stage 0: F0 F1 B0 B1 STEP``."""
        return "\n".join(
            f"stage {d}: " + " ".join(map(str, self.compute_actions(d))) for d in range(self.stages)
        )


@dataclass(frozen=True)
class TimedAction:
    """One action of one device with its start and end (seconds); simulated and measured alike.

    For a receive, ``start``-``end`` is the time spent waiting for the message.
    """

    device: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start
