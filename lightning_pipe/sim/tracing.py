"""``PipeStrategy(trace_dir=...)``: record a few training steps of every rank and draw them.

Every rank records its actions (see :mod:`lightning_pipe.engine.recorder`) during training steps
``2 .. trace_steps + 1`` of the fit (the first step pays one-time costs such as allocations; a fit
of one step records that one). At the end of the fit every rank writes ``events-rank{r}.json``
into ``trace_dir``, and rank 0 gathers all events and writes ``timeline.png`` (one row per rank,
waits for receives hatched) and ``trace.json`` (Chrome trace; the step of each event is in its
``args``). Times are ``time.time()`` on each rank, shifted so that the first recorded action starts
at 0: exact on one host, as good as the hosts' clock synchronisation across hosts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_pipe.engine.recorder import ActionRecorder
from lightning_pipe.schedules.ir import Action, Kind, TimedAction


def events_from_rows(rows: list[dict[str, Any]]) -> tuple[list[TimedAction], list[int]]:
    """Inverse of :meth:`ActionRecorder.rows`: the events and their steps."""
    events = [
        TimedAction(r["device"], Action(Kind(r["kind"]), r["micro_batch"], r["chunk"], r.get("replica", 0)), r["start"], r["end"])
        for r in rows
    ]
    return events, [r["step"] for r in rows]


def read_trace(trace_dir: str | os.PathLike[str]) -> tuple[list[TimedAction], list[int]]:
    """Every rank's recorded events (``events-rank{r}.json``) of a ``trace_dir``, and their steps."""
    paths = sorted(Path(trace_dir).glob("events-rank*.json"))
    if not paths:
        raise FileNotFoundError(f"{trace_dir} holds no events-rank*.json; train with PipeStrategy(trace_dir=...) first.")
    rows = [row for path in paths for row in json.loads(path.read_text())]
    return events_from_rows(rows)


class RunTracer:
    """Decides which training steps are recorded and writes the files at the end of the fit.

    Args:
        trace_dir: directory for the files.
        steps: training steps to record.
        device: this rank's row (its global rank).
        clock: seconds, one wall clock for the processes of a host; on CUDA CUDA events resolved to
            that clock after each traced step (:func:`lightning_pipe.planning.trials.device_clock`), so
            spans are what the device did, not kernel launches.
    """

    def __init__(self, trace_dir: str, steps: int, device: int, clock: Callable[[], float] = time.time) -> None:
        self.trace_dir = trace_dir
        self.steps = steps
        self.recorder = ActionRecorder(device, clock)
        self.seen = 0  # training steps started so far

    def start_step(self) -> None:
        """Call before each training step's schedule runs."""
        # step 0 is recorded as well, for a fit of one step; write() drops it when later steps exist
        self.recorder.enabled = self.seen <= self.steps
        self.recorder.step = self.seen

    def end_step(self) -> None:
        if self.recorder.enabled:
            self.recorder.resolve()  # CUDA events into seconds: one synchronisation per traced step
        self.recorder.enabled = False
        self.seen += 1

    def write(self, rank: int, world_size: int, title: str) -> list[str]:
        """Collective over every rank: write this rank's events, and on rank 0 the picture and the
        Chrome trace. Returns the paths rank 0 wrote (``[]`` elsewhere)."""
        from lightning_pipe.sim.plot import chrome_trace, timeline_png

        rows = self.recorder.rows()
        if any(r["step"] >= 1 for r in rows):  # step 0 was only a fallback for one-step fits
            rows = [r for r in rows if r["step"] >= 1]
        os.makedirs(self.trace_dir, exist_ok=True)
        with open(os.path.join(self.trace_dir, f"events-rank{rank}.json"), "w") as f:
            json.dump(rows, f)
        everyone: list[Any] = [rows]
        if world_size > 1:
            everyone = [None] * world_size if rank == 0 else None
            dist.gather_object(rows, everyone, dst=0)
        if rank != 0:
            return []
        events, steps = events_from_rows([r for part in everyone for r in part])
        if not events:
            return []
        order = sorted(range(len(events)), key=lambda i: (events[i].start, events[i].device))
        events, steps = [events[i] for i in order], [steps[i] for i in order]
        png = timeline_png(events, os.path.join(self.trace_dir, "timeline.png"), title=title, device_label="rank",
                           show_waits=True)
        trace = chrome_trace(events, os.path.join(self.trace_dir, "trace.json"), device_label="rank",
                             args=[{"step": s} for s in steps])
        return [png, trace]
