"""PipeStrategy(trace_dir=...): a measured run writes its timeline, and the recorded order of every
rank's actions is a run of the very action lists the schedule generated (DESIGN.md section 4)."""

from __future__ import annotations

import json
import os

import pytest

from lightning_pipe import PipeConfigError, PipeStrategy
from lightning_pipe.schedules import async_schedule
from lightning_pipe.sim.simulate import measured_costs
from lightning_pipe.sim.tracing import events_from_rows, read_trace
from tests.launch import launch


def test_trace_steps_must_record_something(tmp_path) -> None:
    with pytest.raises(PipeConfigError, match="trace_steps=0"):
        PipeStrategy(trace_dir=str(tmp_path), trace_steps=0)


@pytest.mark.multiprocess
def test_measured_run_writes_trace_and_follows_the_schedule(tmp_path) -> None:
    stages, micro_batches, steps = 2, 4, 4
    trace_dir = str(tmp_path / "trace")
    code, output, records = launch({
        "devices": stages, "max_steps": steps, "batch_size": 16,
        "strategy": {"schedule": "pipedream", "micro_batches": micro_batches, "trace_dir": trace_dir, "trace_steps": 3},
    }, timeout=240)
    assert code == 0, output[-3000:]
    assert len(records) == stages
    for name in ("timeline.png", "trace.json", "events-rank0.json", "events-rank1.json"):
        assert os.path.getsize(os.path.join(trace_dir, name)) > 0, name
    with open(os.path.join(trace_dir, "timeline.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    total = 0
    for rank in range(stages):
        with open(os.path.join(trace_dir, f"events-rank{rank}.json")) as f:
            events, recorded_steps = events_from_rows(json.load(f))
        total += len(events)
        assert sorted(set(recorded_steps)) == [1, 2, 3]  # the first step is skipped as warm-up
        assert all(e.device == rank and e.end >= e.start for e in events)
        for step in (1, 2, 3):
            # one window per training step; the last step of the fit also drains the pipeline
            expected = list(async_schedule("pipedream", stages, micro_batches, step).actions[rank])
            if step == steps - 1:
                expected += async_schedule("pipedream", stages, micro_batches, None, steps).actions[rank]
            measured = [e.action for e, s in zip(events, recorded_steps) if s == step]
            assert measured == expected, f"rank {rank} step {step}"
            starts = [e.start for e, s in zip(events, recorded_steps) if s == step]
            assert starts == sorted(starts)
    with open(os.path.join(trace_dir, "trace.json")) as f:
        trace = json.load(f)["traceEvents"]
    complete = [e for e in trace if e["ph"] == "X"]
    assert len(complete) == total
    assert {e["args"]["step"] for e in complete} == {1, 2, 3}
    # receives that waited are separate events, so compute and waiting can be told apart
    assert any(e["cat"] == "RECV_ACT" for e in complete) and any(e["cat"] == "RECV_GRAD" for e in complete)
    # the run's own costs, as the simulator takes them (simulate_cli --costs_from)
    recorded, recorded_steps = read_trace(trace_dir)
    costs = measured_costs(recorded, stages, steps=recorded_steps)
    assert all(t > 0 for t in (*costs.forward, *costs.backward, costs.step)) and len(costs.transfer) == 1


def test_avgpipe_rounds_are_recorded_and_every_fit_records_its_own(tmp_path) -> None:
    """One process: each recorded avgpipe round is the merged schedule (every replica, STEP, AVG),
    a second fit records its own steps, and an emulated pipeline refuses trace_dir."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_pipe.schedules import build_avgpipe
    from tests.lightning_run import TrunkModel, make_data

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
