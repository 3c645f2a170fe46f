"""Short runs of copies of this rank's stage on the real devices, for choices made at setup.

Profiles are taken in a tight loop on one process; a pipeline's real steps differ (compute next to
a busy peer, messages, waits). ``balance="auto"``'s refinement (docs/algorithms.md §12 step 4) and
avgpipe's tuner trials (section 13 step 5, :mod:`lightning_pipe.planning.avgpipe_trials`) therefore measure a
few steps of the real executor and transport. Every rank runs copies of the layers its stage would
hold (the user's module, optimizer and data order are untouched), the first stage feeds them the
trunk's input of one batch, and the last stage's loss is a stand-in: the mean of its output (the
user's code before and after the trunk is not run).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pipe.engine import ActionRecorder, Executor, SequentialStage, Transport, Watchdog, split_micro_batches
from lightning_pipe.engine.recorder import EventClock
from lightning_pipe.registry import build_schedule
from lightning_pipe.schedules import Kind


def stand_in_loss(output: Any, _micro_batch: Any) -> Tensor:
    """The last stage's loss in a trial: the mean of every floating-point output tensor."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    return sum((t.float().mean() for t in tensors), torch.zeros(()))


def barrier() -> None:
    """A job-wide barrier (nothing without a process group of several ranks)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a clock reading means what it says."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device) -> Callable[[], Any]:
    """The clock for an :class:`~lightning_pipe.engine.recorder.ActionRecorder` on ``device``:
    ``time.time`` on the CPU; on CUDA an :class:`~lightning_pipe.engine.recorder.EventClock`, whose CUDA
    events time what the device did (not the kernel launches) without a synchronisation per action;
    call the recorder's ``resolve()`` before reading its events."""
    return EventClock(device) if device.type == "cuda" else time.time


def on_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it moved to ``device``."""
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, value)


def stage_copy(layers: nn.Module, stage: int, stages: int, device: torch.device) -> tuple[nn.Module, SequentialStage]:
    """A copy of ``layers`` on ``device`` in training mode, and the executor chunk that runs it: the first
    stage takes its micro-batch as input, the last ends in :func:`stand_in_loss`."""
    copies = copy.deepcopy(layers).to(device).train()
    first, last = stage == 0, stage == stages - 1
    return copies, SequentialStage(copies, input_fn=(lambda mb: mb) if first else None,
                                   loss_fn=stand_in_loss if last else None)


def measure_stage(
    layers: nn.Module, stage: int, stages: int, ranks: Sequence[int], transport: Transport | None, watchdog: Watchdog,
    schedule: str, micro_batches: int, inputs: Any, device: torch.device, steps: int = 2, warmup: int = 1,
) -> float:
    """This rank's median forward + backward seconds per micro-batch in a few real steps.

    Every rank of the pipeline calls this at once with its own ``layers`` (copied to ``device``;
    the argument is not modified): ``warmup`` untimed and ``steps`` timed steps of ``schedule`` (a
    synchronous one) with ``micro_batches`` micro-batches, the executor's recorder on. ``inputs``
    is the trunk input of one batch on the first stage (``None`` elsewhere). No optimizer steps.
    """
    copies, chunk = stage_copy(layers, stage, stages, device)
    recorder = ActionRecorder(stage, clock=device_clock(device))
    # only the first stage holds the micro-batches, so the others cannot tell when shapes change
    executor = Executor(stage, ranks, [chunk], transport, watchdog, recorder=recorder, shape_headers="always")
    plan = build_schedule(schedule, stages, micro_batches)
    parts = split_micro_batches(on_device(inputs, device), micro_batches) if stage == 0 else [None] * micro_batches
    for step in range(warmup + steps):
        recorder.enabled = step >= warmup
        executor.run(plan, parts)
        for p in copies.parameters():
            p.grad = None
    recorder.resolve()  # on CUDA: waits for the device, then reads the events

    def median(kind: Kind) -> float:
        durations = [e.duration for e in recorder.events if e.action.kind is kind]
        return statistics.median(durations) if durations else 0.0

    # a split backward (zero-bubble schedules) is its I and its W
    return median(Kind.FORWARD) + median(Kind.BACKWARD) + median(Kind.BACKWARD_INPUT) + median(Kind.BACKWARD_WEIGHT)
