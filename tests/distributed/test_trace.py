"""PipeStrategy(trace_dir=...): a measured run writes its timeline, and the recorded order of every
rank's actions is a run of the very action lists the schedule generated (DESIGN.md section 4)."""

from __future__ import annotations

import json
import os

from lightning_pipe.schedules import async_schedule
from lightning_pipe.sim.simulate import measured_costs
from lightning_pipe.sim.tracing import events_from_rows, read_trace
from tests.harness.launch import launch


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

