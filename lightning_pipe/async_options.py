"""Options of the asynchronous schedules (see docs/async-semantics.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ASYNC_SCHEDULES = ("pipedream", "pipedream_2bw", "pipemare", "xpipe")
Prediction = Literal["auto", "adam", "momentum", "sgd"]


@dataclass(frozen=True)
class AsyncOptions:
    """Knobs of the asynchronous schedules; constants the papers leave open are defaults here.

    Args:
        pipemare_lr_reschedule: PipeMare T1, scale each stage's lr by ``tau_hat ** -(1 - min(k/K, 1))``.
        pipemare_lr_warmup_steps: ``K`` of T1, in stage steps.
        pipemare_correction: PipeMare T2, correct backward weights with the velocity ``delta``.
        pipemare_correction_decay: ``gamma`` of T2's velocity.
        xpipe_prediction: XPipe's update direction: from Adam's moments, SGD's momentum buffer, the
            last gradient, or ``"auto"`` (by optimizer type).
    """

    pipemare_lr_reschedule: bool = True
    pipemare_lr_warmup_steps: int = 100
    pipemare_correction: bool = True
    pipemare_correction_decay: float = 0.9
    xpipe_prediction: Prediction = "auto"
