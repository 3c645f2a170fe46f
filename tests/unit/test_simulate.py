"""The schedule simulator against closed forms, and the timeline pictures."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.registry import build_schedule, names
from lightning_pipe.schedules import STEP, B, F, Kind, Schedule, ScheduleError
from lightning_pipe.sim.plot import chrome_trace, timeline_png
from lightning_pipe.sim.simulate import (
    Costs,
    TimedAction,
    closed_form_step_time,
    measured_costs,
    simulate,
    simulate_async,
    weight_copies,
)

ASYNC_SCHEDULES = names("asynchronous")

durations = st.floats(min_value=0.1, max_value=10.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 6), st.integers(1, 12), durations, durations)
def test_flush_step_time_is_the_closed_form(name: str, stages: int, micro_batches: int, f: float, b: float) -> None:
    sim = simulate(build_schedule(name, stages, micro_batches), Costs.uniform(stages, f, b))
    expected = closed_form_step_time(name, [f + b] * stages, micro_batches)
    assert sim.step_time == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx((micro_batches + stages - 1) * (f + b))
    # the idle fraction of docs/algorithms.md §2
    assert sim.bubble_fraction == pytest.approx((stages - 1) / (micro_batches + stages - 1), abs=1e-9)
    assert sim.busy == pytest.approx([micro_batches * (f + b)] * stages)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(1, 3), st.integers(2, 3), durations, durations)
def test_interleaved_step_time_is_the_closed_form(stages: int, groups: int, chunks: int, f: float, b: float) -> None:
    micro_batches = stages * groups
    sim = simulate(build_schedule("interleaved_1f1b", stages, micro_batches, chunks), Costs.uniform(stages * chunks, f, b))
    expected = closed_form_step_time("interleaved_1f1b", [chunks * (f + b)] * stages, micro_batches, chunks)
    assert sim.step_time == pytest.approx(expected, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(0, 10), durations)
def test_zb_h1_bubble_is_the_papers(stages: int, extra: int, t: float) -> None:
    """ZB-H1 with F = I = W = t and M >= P: 1F1B's bubble (P-1)(F+B) shrinks to (P-1)(F+I-W) (Qi et al., 2023)."""
    micro_batches = stages + extra
    sim = simulate(build_schedule("zb_h1", stages, micro_batches), Costs.uniform(stages, t, 2 * t))
    assert sim.step_time == pytest.approx(3 * t * micro_batches + (stages - 1) * t, rel=1e-9)
    assert sim.peak_activations == [stages] * stages  # 1F1B's peak, on every stage


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(0, 10), durations)
def test_zbv_nearly_removes_the_bubble(stages: int, extra: int, t: float) -> None:
    """ZBV with F = I = W per chunk and M >= 2P: the V's turn on the last device leaves one chunk forward of idle
    time per device at most, far below 1F1B's P - 1 slots."""
    micro_batches = 2 * stages + extra
    zbv = simulate(build_schedule("zbv", stages, micro_batches, 2), Costs.uniform(2 * stages, t / 2, t))
    ideal = 3 * t * micro_batches  # every device busy all the time
    one_f_one_b = simulate(build_schedule("1f1b", stages, micro_batches), Costs.uniform(stages, t, 2 * t)).step_time
    assert ideal <= zbv.step_time <= ideal + (stages - 1) * t
    assert zbv.step_time < one_f_one_b


def test_transfer_adds_latency_and_step_its_cost() -> None:
    stages, m, f, b, c, s = 3, 4, 1.0, 2.0, 0.25, 0.5
    sim = simulate(build_schedule("gpipe", stages, m), Costs.uniform(stages, f, b, transfer=c, step=s))
    # forwards and backwards each cross P-1 boundaries once on the critical path
    assert sim.step_time == pytest.approx((m + stages - 1) * (f + b) + 2 * (stages - 1) * c + s)
    steps = [e for e in sim.events if e.action.kind is Kind.STEP]
    assert len(steps) == stages and all(e.duration == pytest.approx(s) for e in steps)


def test_uneven_stages_bottleneck() -> None:
    costs = Costs(forward=[1.0, 3.0], backward=[2.0, 6.0])
    sim = simulate(build_schedule("1f1b", 2, 6), costs)
    assert sim.step_time == pytest.approx(closed_form_step_time("1f1b", [3.0, 9.0], 6))
    assert sim.busy == pytest.approx([18.0, 54.0])


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (4, 2), (3, 3)])
def test_peak_activations(stages: int, micro_batches: int) -> None:
    costs = Costs.uniform(stages, 1.0, 2.0)
    gpipe = simulate(build_schedule("gpipe", stages, micro_batches), costs)
    one_f_one_b = simulate(build_schedule("1f1b", stages, micro_batches), costs)
    assert gpipe.peak_activations == [micro_batches] * stages
    assert one_f_one_b.peak_activations == [min(stages - s, micro_batches) for s in range(stages)]
    evaluation = simulate(build_schedule("1f1b", stages, micro_batches, forward_only=True), costs)
    assert evaluation.peak_activations == [1] * stages


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(ASYNC_SCHEDULES), st.integers(2, 4), st.integers(1, 6),
    st.lists(st.tuples(durations, durations), min_size=4, max_size=4),
)
def test_async_steady_state_has_no_bubble(name: str, stages: int, micro_batches: int, times: list) -> None:
    if name == "pipedream_2bw" and micro_batches < stages:
        micro_batches = stages
    f, b = [t[0] for t in times[:stages]], [t[1] for t in times[:stages]]
    sim = simulate_async(name, stages, micro_batches, Costs(f, b))
    # docs/algorithms.md §5: time per micro-batch is the slowest stage's F + B
    worst = max(x + y for x, y in zip(f, b))
    assert sim.step_time == pytest.approx(micro_batches * worst, rel=1e-9)
    assert sim.step_time == pytest.approx(closed_form_step_time(name, [x + y for x, y in zip(f, b)], micro_batches))
    assert sim.peak_activations == [stages - s for s in range(stages)]  # w_s + 1 in flight


def test_async_uniform_is_bubble_free_and_counts_weight_copies() -> None:
    sim = simulate_async("pipedream", 4, 2, Costs.uniform(4, 1.0, 2.0), windows=8)
    assert sim.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert sim.weight_copies == [4, 3, 3, 2]  # tau_bar = ceil((P-1-s)/M) stashes + 1, plus the master
    # as held with the default options (docs/memory.md counts the same beyond the module's own weights)
    assert weight_copies("pipedream_2bw", 4, 4) == [4, 4, 4, 4]  # two versions and W(v-1) besides the stepped weights
    assert weight_copies("pipemare", 2, 4) == [3, 3] and weight_copies("xpipe", 2, 4) == [4, 4]
    assert weight_copies("gpipe", 2, 4) == [1, 1]
    assert weight_copies("avgpipe", 2, 4, replicas=3) == [4, 4]


def test_generic_lists_without_communication() -> None:
    """Merged or hand-written lists: compute only, any micro-batch numbering."""
    actions = ((F(10), F(11), B(10), B(11), STEP), (F(10), B(10), F(11), B(11), STEP))
    schedule = Schedule("custom", 2, 2, 1, actions)
    sim = simulate(schedule, Costs.uniform(2, 1.0, 1.0))
    ends = {(e.device, str(e.action)): e.end for e in sim.events}
    assert ends[(1, "F10")] == 2.0 and ends[(0, "B10")] == 4.0 and ends[(0, "B11")] == 6.0
    assert sim.weight_copies == []  # unknown name: no rule


def test_deadlock_is_reported() -> None:
    actions = ((B(0), F(0)), (F(0), B(0)))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(Schedule("broken", 2, 1, 1, actions), Costs.uniform(2, 1.0, 1.0))


def test_costs_must_fit_the_schedule() -> None:
    with pytest.raises(ValueError, match="virtual stage"):
        simulate(build_schedule("gpipe", 2, 2), Costs.uniform(3, 1.0, 1.0))


def test_pictures_are_written(tmp_path) -> None:
    sim = simulate(build_schedule("interleaved_1f1b", 2, 4, 2), Costs.uniform(4, 1e-3, 2e-3, 1e-4, 5e-4))
    png = timeline_png(sim.events, tmp_path / "t.png", title="interleaved")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    measured = [TimedAction(0, F(0), 0.0, 0.5), TimedAction(0, F(1), 0.5, 0.9), TimedAction(1, F(0), 0.0, 0.2)]
    waits = [TimedAction(1, e.action, 0.2, 0.6) for e in sim.events if e.action.kind is Kind.RECV_ACTIVATION][:1]
    timeline_png(measured + waits, tmp_path / "m.png", show_waits=True)
    assert (tmp_path / "m.png").stat().st_size > 1000
    path = chrome_trace(sim.events, tmp_path / "trace.json")
    with open(path) as f:
        trace = json.load(f)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(sim.events)
    assert {e["tid"] for e in complete} == {0, 1}
    assert min(e["ts"] for e in complete) == 0.0
    forward = next(e for e in complete if e["name"] == "F1c1")
    assert forward["args"] == {"micro_batch": 1, "chunk": 1}


def test_command_line_entry(tmp_path, capsys) -> None:
    from lightning_pipe.cli.simulate import simulate_schedule as main

    sim = main(schedule="xpipe", stages=2, micro_batches=2, png=str(tmp_path / "x.png"), trace=str(tmp_path / "x.json"))
    assert sim.step_time == pytest.approx(2 * 3e-3)
    assert (tmp_path / "x.png").stat().st_size > 0 and (tmp_path / "x.json").stat().st_size > 0
    assert "step time 6.000 ms" in capsys.readouterr().out


positive = st.floats(min_value=0.1, max_value=10.0, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", *ASYNC_SCHEDULES]),
       st.integers(2, 4), st.data())
def test_measured_costs_of_a_run_are_the_costs_that_made_it(name: str, stages: int, data) -> None:
    """A simulated run read as a measured one gives back its costs: per-virtual-stage forward and
    backward (a split one's share of W too), the STEP, and the transfer of every boundary some receive
    waited on. A boundary no receive ever waited on reads an upper bound (its messages were always
    there first), and the run simulated again with the costs read back is the same run."""
    chunks = 2 if name in ("interleaved_1f1b", "zbv", "dualpipev") else 1
    virtual = stages * chunks
    shares = st.floats(min_value=0.1, max_value=0.9)
    costs = Costs([data.draw(positive) for _ in range(virtual)], [data.draw(positive) for _ in range(virtual)],
                  [data.draw(positive) for _ in range(virtual - 1)], data.draw(positive),
                  [1.0] + [data.draw(shares) for _ in range(virtual - 1)] if name in ("zb_h1", "zbv", "dualpipev") else ())
    placement = "v" if name in ("zbv", "dualpipev") else "loop"

    def run(costs: Costs):
        if name in ASYNC_SCHEDULES:
            return simulate_async(name, stages, 2 * stages, costs, windows=4)
        return simulate(build_schedule(name, stages, 2 * stages, chunks), costs)

    original = run(costs)
    got = measured_costs(original.events, stages, chunks, placement=placement)
    assert got.forward == pytest.approx(costs.forward, rel=1e-9)
    assert got.backward == pytest.approx(costs.backward, rel=1e-9)
    assert list(got.weight_share) == pytest.approx(list(costs.weight_share), rel=1e-9)
    assert got.step == pytest.approx(costs.step, rel=1e-9)
    layout = build_schedule(name, stages, 2 * stages, chunks) if name not in ASYNC_SCHEDULES else None
    for boundary, transfer in enumerate(got.transfer):
        if layout is not None and layout.locate(boundary)[0] == layout.locate(boundary + 1)[0]:
            continue  # zbv's turn: both sides on one device, handed over in memory (no transfer to read)
        assert transfer == pytest.approx(costs.transfer[boundary], rel=1e-9) or transfer > costs.transfer[boundary]
    assert run(got).step_time == pytest.approx(original.step_time, rel=1e-9)


def test_command_line_takes_the_costs_of_a_measured_run(tmp_path, capsys) -> None:
    """``--costs_from trace_dir``: the per-stage costs recorded in a run (here a simulated one written
    as PipeStrategy(trace_dir=...) writes it) drive the simulation of another schedule."""
    from lightning_pipe.cli.simulate import simulate_schedule as main
    from lightning_pipe.engine import ActionRecorder

    costs = Costs([1e-3, 2e-3], [2e-3, 3e-3], [0.5e-3], 0.25e-3)
    for device in range(2):
        recorder = ActionRecorder(device)
        for event in simulate(build_schedule("1f1b", 2, 4), costs).events:
            if event.device == device:
                recorder.record(event.action, event.start, event.end)
        (tmp_path / f"events-rank{device}.json").write_text(json.dumps(recorder.rows()))
    sim = main(schedule="pipemare", stages=2, micro_batches=8, costs_from=str(tmp_path))
    assert sim.step_time == pytest.approx(simulate_async("pipemare", 2, 8, costs).step_time, rel=1e-9)
    assert "forward [1.0, 2.0], backward [2.0, 3.0], transfer [0.5]" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="fewer than 3 ranks"):
        main(schedule="1f1b", stages=3, costs_from=str(tmp_path))
    with pytest.raises(SystemExit, match="holds no events"):
        main(costs_from=str(tmp_path / "empty"))


@pytest.mark.parametrize("name", ["pipedream", "pipedream_2bw", "pipemare", "xpipe"])
@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 2), (4, 8)])
def test_weight_copies_bound_what_the_policies_hold(name, stages, micro_batches):
    """The registry's counts (the planner's memory model) are what the engine's policies hold at most;
    exactly that for 2BW, pipemare and xpipe."""
    import torch
    from torch import nn

    from lightning_pipe.engine import SequentialStage
    from lightning_pipe.engine.emulated import EmulatedAsyncSegments
    from lightning_pipe.engine.local import LocalPipeline
    from lightning_pipe.engine.policies import AsyncOptions
    from lightning_pipe.registry import SCHEDULES

    if SCHEDULES[name].requirement(stages, micro_batches):
        pytest.skip(SCHEDULES[name].requirement(stages, micro_batches))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(stages)])
    pipeline = LocalPipeline(stages)
    pipeline.chunks = [
        SequentialStage(model[s], input_fn=(lambda mb: mb[0]) if s == 0 else None,
                        loss_fn=(lambda out, mb: nn.functional.mse_loss(out, mb[1])) if s == stages - 1 else None)
        for s in range(stages)
    ]
    segments = EmulatedAsyncSegments(name, SCHEDULES[name].policy, pipeline, stages, micro_batches)
    owned = [{n for n, _ in model.named_parameters() if n.startswith(f"{s}.")} for s in range(stages)]
    segments.start_stages(model, torch.optim.Adam(model.parameters(), lr=1e-3), AsyncOptions(), None, None, 0, owned)
    for _ in range(3 * stages):
        segments.run_window([(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(micro_batches)], [1 / micro_batches] * micro_batches)
    segments.drain()
    held = [policy.max_copies + 1 for policy in segments.policies]  # + the module's own weights
    counted = weight_copies(name, stages, micro_batches)
    assert all(h <= c for h, c in zip(held, counted)), (held, counted)
    if name != "pipedream":
        assert held == counted


@pytest.mark.parametrize("arguments, message", [
    (["--stages", "0"], "--stages 0 must be at least 1."),  # was a ZeroDivisionError
    (["--micro_batches", "0"], "--micro_batches 0 must be at least 1."),
    (["--forward", "-1"], "--forward -1.0 must be at least 0 (milliseconds)."),  # said "pass durations in seconds"
    (["--schedule", "pipemare", "--windows", "0"], "--windows 0: the simulator needs at least 4 windows"),
    (["--schedule", "dualpipev", "--micro_batches", "4"], "dualpipev needs micro_batches >= 2 * stages"),  # a traceback
    (["--schedule", "interleaved_1f1b", "--micro_batches", "6"], "use micro_batches=8."),
])
def test_command_line_refuses_options_with_one_line(arguments, message, capsys) -> None:
    """Every option the simulator cannot run says so in one line on stderr and exits 1, as an unknown schedule did;
    before, these ended in a traceback (a ZeroDivisionError for a count of 0)."""
    from lightning_pipe.cli import main

    with pytest.raises(SystemExit) as done:
        main(["simulate", *arguments])
    assert done.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("lightning-pipe: error: ") and message in err and "Traceback" not in err
