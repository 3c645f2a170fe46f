"""PipeStrategy(trace_dir=...): a measured run writes its timeline, and the recorded order of every
rank's actions is a run of the very action lists the schedule generated (DESIGN.md section 4)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_pipe import PipeConfigError, PipeStrategy
from lightning_pipe.sim.tracing import events_from_rows


def test_trace_steps_must_record_something(tmp_path) -> None:
    with pytest.raises(PipeConfigError, match="trace_steps=0"):
        PipeStrategy(trace_dir=str(tmp_path), trace_steps=0)




def test_avgpipe_rounds_are_recorded_and_every_fit_records_its_own(tmp_path) -> None:
    """One process: each recorded avgpipe round is the merged schedule (every replica, STEP, AVG),
    a second fit records its own steps, and an emulated pipeline refuses trace_dir."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_pipe.schedules import build_avgpipe
    from tests.harness.lightning_run import TrunkModel, make_data

    trace_dir = tmp_path / "trace"

    def fit(strategy: PipeStrategy, steps: int, trainer: L.Trainer | None = None) -> L.Trainer:
        trainer = trainer or L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False,
                                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit_loop.epoch_loop.max_steps = steps
        trainer.fit(TrunkModel(), DataLoader(make_data(64), batch_size=16))
        return trainer

    def recorded() -> tuple[list, list[int]]:
        with open(trace_dir / "events-rank0.json") as f:
            return events_from_rows(json.load(f))

    strategy = PipeStrategy(schedule="avgpipe", micro_batches=2, avgpipe={"parallel_pipelines": 2}, trace_dir=str(trace_dir), trace_steps=2)
    trainer = fit(strategy, 3)
    round_ = list(build_avgpipe(1, 2, 2).actions[0])
    events, steps = recorded()
    assert sorted(set(steps)) == [1, 2] and {e.action.replica for e in events} == {0, 1}
    for step in (1, 2):
        assert [e.action for e, s in zip(events, steps) if s == step] == round_
    assert (trace_dir / "timeline.png").stat().st_size > 0
    os.remove(trace_dir / "events-rank0.json")
    fit(strategy, 6, trainer)  # three more steps: recorded anew
    events, steps = recorded()
    assert sorted(set(steps)) == [1, 2] and len(events) == 2 * len(round_)

    with pytest.raises(PipeConfigError, match="trace_dir times a pipeline"):
        fit(PipeStrategy(schedule="1f1b", stages=2, trace_dir=str(trace_dir)), 1)


def test_an_event_clock_is_resolved_into_host_seconds_once_per_step():
    """On CUDA a recorder's clock records events (no synchronisation per action); resolve() turns
    them into host seconds anchored at the first reading. A stand-in event keeps the test on the CPU."""
    from lightning_pipe.engine.recorder import ActionRecorder, EventClock
    from lightning_pipe.schedules import Action, Kind

    class FakeEvent:
        def __init__(self, at_ms: float) -> None:
            self.at_ms = at_ms

        def elapsed_time(self, other: "FakeEvent") -> float:
            return other.at_ms - self.at_ms

    class FakeClock(EventClock):
        def __init__(self) -> None:
            super().__init__(torch.device("cpu"))
            self.now_ms, self.synchronized = 0.0, 0

        def _event(self) -> FakeEvent:
            self.now_ms += 5.0
            return FakeEvent(self.now_ms)

        def synchronize(self) -> None:
            self.synchronized += 1

    clock = FakeClock()
    recorder = ActionRecorder(0, clock=clock)
    recorder.record(Action(Kind.FORWARD, 0), clock(), clock())
    recorder.record(Action(Kind.BACKWARD, 0), clock(), clock())
    assert clock.synchronized == 1  # only to anchor the host time
    recorder.resolve()
    assert clock.synchronized == 2
    assert [round(e.duration, 6) for e in recorder.events] == [0.005, 0.005]
    assert recorder.events[1].start - recorder.events[0].start == pytest.approx(0.010)
