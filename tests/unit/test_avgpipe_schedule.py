"""avgpipe's schedule as data: per-replica lists from docs/algorithms.md §10 and the device merge.

Pure Python, no processes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipe.registry import build_schedule
from lightning_pipe.schedules import (
    Action,
    Kind,
    MergeCosts,
    Schedule,
    ScheduleError,
    avgpipe_replica,
    build_avgpipe,
    validate,
    with_communication,
)
from lightning_pipe.schedules.avgpipe import warmup_forwards

FAST = settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def shapes(draw):
    """``(N, P, M, a)`` with ``N <= 3``, ``P <= 4``, ``M <= 4``, ``a <= M``."""
    M = draw(st.integers(1, 4))
    return draw(st.integers(1, 3)), draw(st.integers(1, 4)), M, draw(st.integers(0, M))


def test_replica_list_follows_the_formula():
    # P=3, M=4, a=1: stage 0 has k = min(4, 2 + 1) = 3 warm-up forwards, the last stage a_s = 0
    assert [str(a) for a in avgpipe_replica(0, 3, 4, 1, replica=1)] == [
        "r1:F0", "r1:F1", "r1:F2", "r1:F3", "r1:B0", "r1:B1", "r1:B2", "r1:B3", "r1:STEP", "r1:AVG"]
    assert [str(a) for a in avgpipe_replica(2, 3, 4, 1)] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "STEP", "AVG"]
    assert warmup_forwards(1, 3, 4, 0) == 1 and warmup_forwards(0, 3, 2, 5) == 2


def test_no_advance_one_replica_is_1f1b_plus_avg():
    for P, M in [(1, 1), (2, 3), (4, 4), (3, 8)]:
        merged = build_avgpipe(P, M, 1, 0)
        plain = build_schedule("1f1b", P, M)
        for d in range(P):
            assert merged.actions[d] == (*plain.actions[d], Action(Kind.AVG))


@FAST
@given(shape=shapes(), seed=st.integers(0, 3))
def test_merge_is_valid_and_an_interleaving(shape, seed):
    N, P, M, a = shape
    costs = None
    if seed:  # unequal stage and link costs change the merge; it must stay sound
        costs = MergeCosts(tuple(1.0 + (seed * s) % 3 for s in range(P)), tuple(2.0 + (s + seed) % 2 for s in range(P)),
                           tuple(0.5 * seed for _ in range(P - 1)), 0.1 * seed)
    schedule = build_avgpipe(P, M, N, a, costs)
    validate(schedule)  # counts, STEP/AVG placement, brackets, per-replica FIFO, no deadlock
    for d in range(P):
        for n in range(N):
            own = with_communication(avgpipe_replica(d, P, M, a, n), d, P, 1)
            assert tuple(x for x in schedule.actions[d] if x.replica == n) == own
        assert len(schedule.actions[d]) == sum(
            len(with_communication(avgpipe_replica(d, P, M, a, n), d, P, 1)) for n in range(N))


def test_merge_fills_one_replicas_warmup_with_another():
    """With two replicas, stage 1 runs replica 1's forward before replica 0's first backward is ready."""
    compute = build_avgpipe(2, 2, 2).compute_actions(1)
    assert [str(a) for a in compute[:4]] == ["F0", "r1:F0", "B0", "r1:B0"]


def test_validator_catches_replica_mixups():
    good = build_avgpipe(2, 2, 2)
    swapped = list(good.actions[1])
    # receive replica 1's activation where replica 0's is expected: its own tag would never match
    i = swapped.index(Action(Kind.RECV_ACTIVATION, 0, 0, 0))
    j = swapped.index(Action(Kind.RECV_ACTIVATION, 0, 0, 1))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    broken = Schedule("avgpipe", 2, 2, 1, (good.actions[0], tuple(swapped)), replicas=2)
    with pytest.raises(ScheduleError, match="has no RECV_ACT before it"):
        validate(broken)
    missing_avg = tuple(a for a in good.actions[0] if not (a.kind is Kind.AVG and a.replica == 1))
    with pytest.raises(ScheduleError, match="AVG must come once after every STEP"):
        validate(Schedule("avgpipe", 2, 2, 1, (missing_avg, good.actions[1]), replicas=2))


def test_strategy_name_and_option_errors():
    import lightning as L

    from lightning_pipe import PipeStrategy
    from lightning_pipe.errors import PipeConfigError

    trainer = L.Trainer(strategy="avgpipe", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.schedule == "avgpipe" and trainer.strategy.options.avgpipe.resolved_alpha == pytest.approx(0.45)
    for bad, message in [({"alpha": 1.5}, "alpha=1.5 must lie in"),
                         ({"parallel_pipelines": 0}, "parallel_pipelines=0 must be at least 1"),
                         ({"period": 0}, "period=0 must be at least 1"),
                         ({"averaging": "both"}, "must be 'async' or 'sync'"),
                         ({"advance_forward": -1}, "advance_forward=-1 must be at least 0"),
                         ({"trials": -1}, "trials=-1 must be at least 0")]:
        with pytest.raises(PipeConfigError, match=message):
            PipeStrategy(schedule="avgpipe", avgpipe=bad)
    with pytest.raises(PipeConfigError, match="micro_batches='auto' needs schedule='avgpipe'"):  # "auto" is avgpipe's tuner
        PipeStrategy(schedule="1f1b", micro_batches="auto")
    for name in ("parallel_pipelines", "advance_forward"):
        with pytest.raises(PipeConfigError, match=f"{name}='auto' needs schedule='avgpipe'"):
            PipeStrategy(schedule="1f1b", avgpipe={name: "auto"})


def test_flat_option_names_of_0_1_still_work_with_a_warning():
    """The 0.1 names (``avgpipe_alpha=...``) map onto the groups for one release, with a FutureWarning."""
    from lightning_pipe import AvgPipeOptions, PipeStrategy

    with pytest.warns(FutureWarning, match=r"avgpipe_alpha=\.\.\.\) is deprecated .* avgpipe=AvgPipeOptions\(alpha=\.\.\.\)"):
        strategy = PipeStrategy(schedule="avgpipe", avgpipe_alpha=0.5, parallel_pipelines=3)
    assert strategy.options.avgpipe == AvgPipeOptions(parallel_pipelines=3, alpha=0.5)
    with pytest.warns(FutureWarning, match="pipemare=PipeMareOptions"):
        strategy = PipeStrategy(schedule="pipemare", pipemare_correction=False)
    assert strategy.options.pipemare.correction is False
