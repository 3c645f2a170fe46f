"""Profiler and planner, in one process: fields, cache, DP optimality, memory limits, speeds."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.planning.planner import (
    GIB,
    Machine,
    PlanError,
    evaluate,
    explore,
    fixed_plan,
    in_flight,
    min_max_split,
    plan,
    refine_split,
    refinement_move,
    split_for,
)
from lightning_pipe.planning.profile import LayerProfile, Profile, capture_trunk_input, interpolate, profile_trunk


# ---------------------------------------------------------------------------------- profiler
class Counting(nn.Module):
    calls = 0

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        Counting.calls += 1
        return torch.tanh(self.linear(x))


def test_profile_fields_are_positive_and_the_cache_skips_measuring(tmp_path):
    trunk = nn.Sequential(Counting(8), nn.Linear(8, 32), Counting(32))
    sample = torch.randn(4, 8)
    cache = tmp_path / "profiles.json"
    Counting.calls = 0
    first = profile_trunk(trunk, sample, repeats=3, warmup=1, cache=cache, max_spread=None)  # trusted: always cached
    assert 3 <= first.warmup_rounds <= 60 and first.spread >= 0  # at least 3 rounds, then until settled
    assert first.timed_rounds == 3 and not first.noisy
    assert Counting.calls == 2 * (first.warmup_rounds + first.timed_rounds + 1)  # warm-up, timed, the saved-bytes run; two layers
    assert first.micro_batch == 4 and len(first.layers) == 3 and first.input_bytes == 4 * 8 * 4
    for layer in first.layers:
        assert layer.forward > 0 and layer.backward > 0 and layer.params > 0 and layer.saved > 0 and layer.output > 0
    assert first.layers[1].params == (8 * 32 + 32) * 4 and first.layers[1].output == 4 * 32 * 4
    assert first.layers[1].saved == 4 * 8 * 4  # Linear keeps its input, not its weight
    calls = Counting.calls
    again = profile_trunk(trunk, sample, cache=cache)
    assert Counting.calls == calls and again == first  # a cache hit runs nothing
    assert (again.warmup_rounds, again.spread) == (first.warmup_rounds, first.spread)  # kept in the cache
    other = profile_trunk(trunk, torch.randn(6, 8), repeats=1, warmup=0, cache=cache)
    assert other.timed_rounds == 1 and not other.noisy  # one round has no spread to judge
    assert Counting.calls == calls + 2 * (other.warmup_rounds + 1 + 1)  # another input shape is another key


def test_layers_off_the_device_are_profiled_as_copies_one_at_a_time(monkeypatch):
    from lightning_pipe.planning import profile as profile_module

    monkeypatch.setattr(profile_module, "_on", lambda layer, device: False)  # as if the trunk sat on another device
    trunk = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    before = {k: v.clone() for k, v in trunk.state_dict().items()}
    found = profile_trunk(trunk, torch.randn(4, 8), repeats=2, warmup=1)
    assert [l.name for l in found.layers] == ["Linear", "BatchNorm1d", "Linear"]
    assert all(l.forward > 0 and l.backward > 0 for l in found.layers)
    for key, value in trunk.state_dict().items():  # the copies ran, the trunk's own statistics did not move
        torch.testing.assert_close(value, before[key])


def test_capture_trunk_input_runs_the_modules_own_code_and_stops_at_the_trunk():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.trunk = nn.Sequential(nn.Linear(4, 4))
            self.after = 0

        def forward(self, tokens):
            out = self.trunk(self.embed(tokens) * 2)
            self.after += 1
            return out

    model = Model()
    tokens = torch.tensor([[1, 2], [3, 4]])
    captured = capture_trunk_input(model, model.trunk, lambda: model(tokens))
    torch.testing.assert_close(captured, model.embed(tokens).detach() * 2)
    assert model.after == 0 and not captured.requires_grad
    with pytest.raises(RuntimeError, match="without calling its trunk"):
        capture_trunk_input(model, model.trunk, lambda: None)


def test_interpolation_is_linear_in_the_micro_batch_size():
    a = synthetic([1.0, 2.0], micro_batch=2)
    b = synthetic([3.0, 6.0], micro_batch=4)
    mid = interpolate([b, a], 3)
    assert [l.forward + l.backward for l in mid.layers] == pytest.approx([2.0, 4.0])
    assert mid.layers[0].params == a.layers[0].params
    assert [l.forward + l.backward for l in interpolate([a], 4).layers] == pytest.approx([2.0, 4.0])


# ---------------------------------------------------------------------------------- planner
def synthetic(times, params=None, saved=None, micro_batch=1, output=0):
    params = params or [0] * len(times)
    saved = saved or [0] * len(times)
    layers = tuple(LayerProfile("L", t / 2, t / 2, p, a, output) for t, p, a in zip(times, params, saved))
    return Profile(micro_batch, "cpu", layers)


def brute_force(layers, stages, cost, feasible):
    best = math.inf
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = [0, *cuts, layers]
        spans = list(zip(bounds, bounds[1:]))
        if all(feasible(i, j, d) for d, (i, j) in enumerate(spans)):
            best = min(best, max(cost(i, j, d) for d, (i, j) in enumerate(spans)))
    return best


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.floats(0.01, 10.0), min_size=2, max_size=8),
    stages=st.integers(1, 4),
    speeds=st.lists(st.floats(0.25, 4.0), min_size=4, max_size=4),
    mem=st.lists(st.integers(0, 5), min_size=8, max_size=8),
    cap=st.integers(1, 20),
)
def test_dp_equals_brute_force(costs, stages, speeds, mem, cap):
    n = len(costs)
    assume(stages <= n)
    prefix = [0.0, *itertools.accumulate(costs)]
    mprefix = [0, *itertools.accumulate(mem[:n])]

    def cost(i, j, d):
        return (prefix[j] - prefix[i]) / speeds[d]

    def feasible(i, j, d):
        return mprefix[j] - mprefix[i] <= cap

    want = brute_force(n, stages, cost, feasible)
    got = min_max_split(n, stages, cost, feasible)
    if want == math.inf:
        assert got is None
        return
    value, counts = got
    assert value == pytest.approx(want)
    bounds = [0, *itertools.accumulate(counts)]
    assert len(counts) == stages and min(counts) >= 1 and bounds[-1] == n
    assert max(cost(i, j, d) for d, (i, j) in enumerate(zip(bounds, bounds[1:]))) == pytest.approx(want)
    assert all(feasible(i, j, d) for d, (i, j) in enumerate(zip(bounds, bounds[1:])))


def test_unbalanced_layers_get_balanced_stages_and_predictions_follow_the_formulas():
    profile = synthetic([8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0])
    found = split_for(profile, "1f1b", 2, 4)
    assert found.balance == [1, 7] and [s.time for s in found.stages] == pytest.approx([8.0, 8.0])
    assert found.step_time == pytest.approx(3 * 8 + 16)
    uniform = evaluate(profile, "1f1b", 2, 4, [4, 4])
    assert uniform.bottleneck == pytest.approx(11.0) and found.throughput > uniform.throughput
    assert split_for(profile, "pipedream", 2, 4).step_time == pytest.approx(4 * 8)
    inter = split_for(profile, "interleaved_1f1b", 2, 4, chunks=2)
    assert len(inter.balance) == 4 and inter.stages[1].device == 1 and inter.stages[2].device == 0


@settings(max_examples=30, deadline=None)
@given(costs=st.lists(st.floats(0.1, 10.0), min_size=4, max_size=9))
def test_interleaved_split_is_never_worse_than_uniform(costs):
    profile = synthetic(costs)
    found = split_for(profile, "interleaved_1f1b", 2, 4, chunks=2)
    base, extra = divmod(len(costs), 4)
    uniform = evaluate(profile, "interleaved_1f1b", 2, 4, [base + (k < extra) for k in range(4)], chunks=2)
    assert found.step_time <= uniform.step_time * (1 + 1e-12)


def test_speeds_move_layers_to_the_faster_device():
    profile = synthetic([1.0] * 12)
    assert split_for(profile, "1f1b", 2, 4).balance == [6, 6]
    fast_second = split_for(profile, "1f1b", 2, 4, Machine(speeds=[1.0, 3.0]))
    assert fast_second.balance == [3, 9]
    assert [s.time for s in fast_second.stages] == pytest.approx([3.0, 3.0])
    with pytest.raises(PlanError, match="speeds has 3 entries but the pipeline has 2 stages; give one per stage"):
        fixed_plan(profile, "1f1b", 2, 4, Machine(speeds=[1.0, 1.0, 1.0]))


def test_memory_limits_are_respected():
    # equal times, but the first six layers are heavy: a time-optimal 6/6 split would not fit
    profile = synthetic([1.0] * 12, params=[100] * 6 + [10] * 6)
    machine = Machine(memory=2000, kappa=4.0)
    found = split_for(profile, "1f1b", 2, 4, machine)
    assert found.balance == [5, 7] and max(found.memory) <= 2000
    assert split_for(profile, "1f1b", 2, 4, Machine(memory=1000)) is None


def test_recomputation_trades_a_forward_for_activation_memory():
    profile = synthetic([2.0] * 4, saved=[100] * 4, output=10)
    plain = evaluate(profile, "gpipe", 2, 4, [2, 2])
    recompute = evaluate(profile, "gpipe", 2, 4, [2, 2], Machine(recompute=True))
    # per stage: forward 1.0 per layer runs twice; activations 4 x 200 become 4 x 10 (inputs) + 200
    assert [s.time for s in recompute.stages] == pytest.approx([6.0, 6.0])
    assert plain.stages[1].memory - recompute.stages[1].memory == pytest.approx(4 * 200 - (4 * 10 + 200))


def test_in_flight_counts_match_the_schedules():
    assert in_flight("gpipe", 4, 8) == ((8,), (8,), (8,), (8,))
    assert in_flight("1f1b", 4, 8) == ((4,), (3,), (2,), (1,))
    assert in_flight("pipedream", 2, 4) == ((2,), (1,))
    # per-chunk peaks (chunks hold different layers); they bound the 5 and 3 of docs/memory.md
    assert in_flight("interleaved_1f1b", 2, 4, 2) == ((4, 2), (3, 1))


def test_nothing_fits_names_the_smallest_need():
    gib = int(GIB)
    profile = synthetic([1.0] * 12, params=[gib // 10] * 12)
    with pytest.raises(PlanError) as error:
        plan([profile], 8, 4, machine=Machine(memory=1.0 * GIB, kappa=4.0))
    message = str(error.value)
    assert message.startswith("no split of 12 layers over 4 stages fits 1.0 GiB per device; the smallest needs 1.2 GiB: ")
    assert "balance=[3, 3, 3, 3]" in message
    with pytest.raises(PlanError, match="fits 1.0 GiB per device; the smallest needs 1.2 GiB"):
        fixed_plan(profile, "gpipe", 4, 2, Machine(memory=1.0 * GIB))


def test_explore_picks_micro_batches_by_predicted_time_and_breaks_ties():
    # time grows with the micro-batch size plus a constant per micro-batch: an interior optimum
    small = synthetic([1.0 + 1.0] * 4, micro_batch=1)
    large = synthetic([1.0 + 8.0] * 4, micro_batch=8)
    plans = explore([small, large], 8, 2, schedules=["gpipe", "1f1b", "pipedream"])
    for schedule, found in plans.items():
        times = {m: split_for(interpolate([small, large], 8 / m), schedule, 2, m, batch=8).step_time for m in (1, 2, 4, 8)}
        assert found.step_time == pytest.approx(min(times.values())), schedule
    assert plans["pipedream"].throughput > plans["1f1b"].throughput  # no bubble
    # time proportional to the micro-batch size: asynchronous schedules tie over M and over each
    # other; ties go to fewer weight copies, then to larger micro-batches
    one, eight = synthetic([1.0] * 4, micro_batch=1), synthetic([8.0] * 4, micro_batch=8)
    best = plan([one, eight], 8, 2, schedules=["xpipe", "pipedream"])
    assert (best.schedule, best.micro_batches, best.weight_copies) == ("pipedream", 1, 3)
    assert plan([one, eight], 8, 2, schedules=["pipedream_2bw"]).micro_batches == 2  # 2bw needs M >= P


# ---------------------------------------------------------------------------------- refinement (section 12 step 4)
def test_refinement_moves_a_layer_off_the_measured_bottleneck_to_its_faster_neighbour():
    anything = lambda counts: True  # noqa: E731
    assert refinement_move([4, 4, 4], [1.0, 3.0, 2.0], anything) == [5, 3, 4]
    assert refinement_move([4, 4, 4], [2.0, 3.0, 1.0], anything) == [4, 3, 5]
    assert refinement_move([4, 4], [5.0, 1.0], anything) == [3, 5]
    assert refinement_move([1, 7], [5.0, 1.0], anything) is None  # the bottleneck holds one layer
    # the faster neighbour's move does not fit memory: the other neighbour takes the layer
    assert refinement_move([4, 4, 4], [1.0, 3.0, 2.0], lambda counts: counts[0] < 5) == [4, 3, 5]
    assert refinement_move([4, 4, 4], [1.0, 3.0, 2.0], lambda counts: False) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=4, max_size=12), st.integers(2, 4), st.integers(0, 6))
def test_refinement_keeps_only_moves_that_shrink_the_measured_bottleneck(layer_times, stages, moves):
    """A stage's measured time is the sum of its layers' true times (which the profile got wrong):
    the first split is measured, every kept move shrinks the bottleneck, the first move that does not
    ends the search, and at most ``moves`` moves are measured."""
    layers = len(layer_times)
    assume(layers >= stages)
    start = [layers // stages + (k < layers % stages) for k in range(stages)]

    def measure(counts):
        bounds = list(itertools.accumulate([0, *counts]))
        return [sum(layer_times[bounds[k]:bounds[k + 1]]) for k in range(stages)]

    log = []  # (split, its bottleneck, kept)
    counts, times = refine_split(start, measure, lambda counts: True, moves,
                                 lambda split, t, kept: log.append((split, max(t), kept)))
    assert log[0] == (start, max(measure(start)), True) and len(log) <= moves + 1
    kept = [bottleneck for _, bottleneck, k in log if k]
    assert all(a > b for a, b in zip(kept, kept[1:]))  # strictly shrinking
    assert all(k for _, _, k in log[:-1])  # only the last measurement may be rejected
    assert counts == [split for split, _, k in log if k][-1] and times == measure(counts) and sum(counts) == layers
    assert len({tuple(split) for split, _, _ in log}) == len(log)  # no split is measured twice


def test_zero_bubble_predictions_follow_their_bubbles():
    """Equal layers: zb_h1 predicts a third of 1f1b's bubble, the V schedules less still; all keep the model's
    compute (the plan simulates their lists; forward 1/3, input and weight gradients 1/3 each)."""
    profile = synthetic([1.0] * 8)
    one, zb, v = (fixed_plan(profile, name, 2, 4) for name in ("1f1b", "zb_h1", "zbv"))
    assert one.balance == zb.balance == [4, 4] and v.balance == [2, 2, 2, 2]
    assert one.step_time == pytest.approx(5 * 4.0)  # (M + P - 1) stage times
    assert zb.step_time == pytest.approx(4 * 4.0 + 4.0 / 3)  # the bubble: one forward of a stage
    assert v.step_time < zb.step_time
    assert [s.device for s in v.stages] == [0, 1, 1, 0]  # the V: device 0 holds the first and the last
