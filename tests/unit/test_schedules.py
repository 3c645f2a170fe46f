"""Schedule IR: generators against docs/algorithms.md §2-4, and the validator against broken schedules.

Expected action orders are written from the formulas in the spec, not by calling the generators.
Everything here is pure Python (no torch, no processes) and runs in a few seconds.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_pipe.registry import build_schedule
from lightning_pipe.schedules import (
    STEP,
    Action,
    B,
    F,
    Kind,
    Schedule,
    ScheduleError,
    dry_run,
    validate,
    with_communication,
)

FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

stages_st = st.integers(min_value=1, max_value=8)
micro_batches_st = st.integers(min_value=1, max_value=32)
chunks_st = st.integers(min_value=1, max_value=4)


@st.composite
def interleaved_shapes(draw, max_stages: int = 8, max_micro_batches: int = 32, max_chunks: int = 4):
    """``(P, M, v)`` with ``M`` a positive multiple of ``P`` and ``M <= max_micro_batches``."""
    P = draw(st.integers(1, max_stages))
    M = P * draw(st.integers(1, max_micro_batches // P))
    v = draw(st.integers(1, max_chunks))
    return P, M, v


# ---------------------------------------------------------------------------------------------------
# Independent helpers (spec formulas and structural checks)
# ---------------------------------------------------------------------------------------------------


def spec_gpipe(s: int, P: int, M: int) -> list[Action]:
    """Section 2: F(0), ..., F(M-1), then B(M-1), ..., B(0), then STEP."""
    return [F(j) for j in range(M)] + [B(M - 1 - i) for i in range(M)] + [STEP]


def spec_1f1b(s: int, P: int, M: int) -> list[Action]:
    """Section 3: k_s = min(P-1-s, M); F(0..k_s-1); for j = k_s..M-1: F(j), B(j-k_s); B(M-k_s..M-1); STEP."""
    k = min(P - 1 - s, M)
    order = [F(j) for j in range(k)]
    for j in range(k, M):
        order += [F(j), B(j - k)]
    order += [B(j) for j in range(M - k, M)]
    return order + [STEP]


def spec_interleaved_forward(k: int, P: int, v: int) -> Action:
    """Section 4: chunk = floor((k mod Pv)/P), micro-batch = floor(k/(Pv))*P + (k mod P)."""
    return F((k // (P * v)) * P + k % P, (k % (P * v)) // P)


def spec_interleaved_backward(k: int, P: int, v: int) -> Action:
    """Section 4: chunk = v-1-floor((k mod Pv)/P), same micro-batch formula as the forward."""
    return B((k // (P * v)) * P + k % P, v - 1 - (k % (P * v)) // P)


def spec_interleaved_warmup(d: int, P: int, M: int, v: int) -> int:
    """Section 4: K_d = min(2(P-d-1) + (v-1)P, Mv); if M = P, all forwards first."""
    return M * v if M == P else min(2 * (P - d - 1) + (v - 1) * P, M * v)


def spec_interleaved(d: int, P: int, M: int, v: int) -> list[Action]:
    total = M * v
    K = spec_interleaved_warmup(d, P, M, v)
    order = [spec_interleaved_forward(k, P, v) for k in range(K)]
    for i in range(total - K):
        order += [spec_interleaved_forward(K + i, P, v), spec_interleaved_backward(i, P, v)]
    order += [spec_interleaved_backward(k, P, v) for k in range(total - K, total)]
    return order + [STEP]


def max_in_flight(compute: list[Action]) -> int:
    """Most (chunk, micro-batch) pairs forwarded but not yet backwarded at any point."""
    live: set[tuple[int, int | None]] = set()
    peak = 0
    for a in compute:
        if a.kind is Kind.FORWARD:
            live.add((a.chunk, a.micro_batch))
            peak = max(peak, len(live))
        elif a.kind is Kind.BACKWARD:
            live.discard((a.chunk, a.micro_batch))
    return peak


def assert_training_invariants(schedule: Schedule) -> None:
    """Test-1 invariants: one STEP per device and it is last; chunks*M forwards and backwards, each once
    (a backward is one B, or a split one: I then W)."""
    P, M, v = schedule.stages, schedule.micro_batches, schedule.chunks
    expected = {(c, j) for c in range(v) for j in range(M)}
    assert len(schedule.actions) == P
    for d in range(P):
        actions = schedule.actions[d]
        kinds = Counter(a.kind for a in actions)
        assert kinds[Kind.STEP] == 1, f"stage {d}: {kinds[Kind.STEP]} STEPs"
        assert actions[-1] == STEP, f"stage {d}: last action is {actions[-1]}"
        forwards = [(a.chunk, a.micro_batch) for a in actions if a.kind is Kind.FORWARD]
        whole = [(a.chunk, a.micro_batch) for a in actions if a.kind is Kind.BACKWARD]
        inputs = [(a.chunk, a.micro_batch) for a in actions if a.kind is Kind.BACKWARD_INPUT]
        weights = [(a.chunk, a.micro_batch) for a in actions if a.kind is Kind.BACKWARD_WEIGHT]
        assert len(forwards) == v * M and set(forwards) == expected
        assert len(inputs) == len(weights) == len(set(inputs)) and set(inputs) == set(weights)
        assert len(whole) + len(inputs) == v * M and set(whole) | set(inputs) == expected
        for key in inputs:
            i = next(k for k, a in enumerate(actions) if a.kind is Kind.BACKWARD_INPUT and (a.chunk, a.micro_batch) == key)
            w = next(k for k, a in enumerate(actions) if a.kind is Kind.BACKWARD_WEIGHT and (a.chunk, a.micro_batch) == key)
            assert i < w, f"stage {d}: W of {key} before its I"


def oracle_virtual_stage(schedule: Schedule, d: int, c: int) -> int:
    """Written from the placements' definitions (docs/algorithms.md §0), not from ir.py."""
    P = schedule.stages
    if schedule.placement == "v" and c % 2 == 1:
        return c * P + (P - 1 - d)
    return c * P + d


def assert_sound(schedule: Schedule) -> None:
    """An oracle independent of validate.py: what an accepted training schedule must satisfy.

    * the test-1 invariants;
    * on each device, a backward (B, or I) of (j, c) follows F(j, c); every compute is preceded by
      exactly the receive it needs and followed by exactly the send it owes (and no other
      communication exists); a neighbour on the same device has computed what it hands over;
    * on every (sender, receiver, payload) channel, sends and receives list the same messages in
      the same order (checked statically);
    * a simulation where sends never block and a receive waits for its send completes.
    """
    assert_training_invariants(schedule)
    P, v = schedule.stages, schedule.chunks
    last = P * v - 1
    home = {oracle_virtual_stage(schedule, d, c): (d, c) for d in range(P) for c in range(v)}
    assert sorted(home) == list(range(P * v))

    def vstage(d: int, c: int) -> int:
        return oracle_virtual_stage(schedule, d, c)

    def remote(d: int, other_vs: int) -> bool:
        return 0 <= other_vs <= last and home[other_vs][0] != d

    sends: dict[tuple[int, int, str], list[tuple[int, int | None]]] = {}
    recvs: dict[tuple[int, int, str], list[tuple[int, int | None]]] = {}
    for d, actions in enumerate(schedule.actions):
        done: set[tuple[Kind, int, int | None]] = set()
        got: set[tuple[Kind, int, int | None]] = set()
        comm = Counter()
        for a in actions:
            key = (a.chunk, a.micro_batch)
            vs = vstage(d, a.chunk)
            if a.kind is Kind.FORWARD:
                if remote(d, vs - 1):
                    assert (Kind.RECV_ACTIVATION, *key) in got
                elif vs > 0:  # handed over in memory by this device's own chunk
                    assert (Kind.FORWARD, home[vs - 1][1], a.micro_batch) in done
                done.add((a.kind, *key))
            elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
                assert (Kind.FORWARD, *key) in done
                if remote(d, vs + 1):
                    assert (Kind.RECV_GRADIENT, *key) in got
                elif vs < last:
                    assert {(Kind.BACKWARD, home[vs + 1][1], a.micro_batch),
                            (Kind.BACKWARD_INPUT, home[vs + 1][1], a.micro_batch)} & done
                done.add((a.kind, *key))
            elif a.kind is Kind.BACKWARD_WEIGHT:
                assert (Kind.BACKWARD_INPUT, *key) in done
            elif a.kind.is_recv:
                comm[a] += 1
                got.add((a.kind, *key))
                payload = "act" if a.kind is Kind.RECV_ACTIVATION else "grad"
                other_vs = vs - 1 if payload == "act" else vs + 1
                assert remote(d, other_vs)
                # a message is labelled with the receiver's (chunk, micro-batch)
                recvs.setdefault((home[other_vs][0], d, payload), []).append((a.chunk, a.micro_batch))
            elif a.kind.is_send:
                comm[a] += 1
                needs = {Kind.FORWARD} if a.kind is Kind.SEND_ACTIVATION else {Kind.BACKWARD, Kind.BACKWARD_INPUT}
                assert any((kind, *key) in done for kind in needs)
                payload = "act" if a.kind is Kind.SEND_ACTIVATION else "grad"
                other_vs = vs + 1 if payload == "act" else vs - 1
                assert remote(d, other_vs)
                sends.setdefault((d, home[other_vs][0], payload), []).append((home[other_vs][1], a.micro_batch))
        # exactly the communication implied by the compute actions
        want = Counter()
        for a in actions:
            vs = vstage(d, a.chunk)
            if a.kind is Kind.FORWARD:
                if remote(d, vs - 1):
                    want[Action(Kind.RECV_ACTIVATION, a.micro_batch, a.chunk)] += 1
                if remote(d, vs + 1):
                    want[Action(Kind.SEND_ACTIVATION, a.micro_batch, a.chunk)] += 1
            elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
                if remote(d, vs + 1):
                    want[Action(Kind.RECV_GRADIENT, a.micro_batch, a.chunk)] += 1
                if remote(d, vs - 1):
                    want[Action(Kind.SEND_GRADIENT, a.micro_batch, a.chunk)] += 1
        assert comm == want, f"stage {d}: communication {comm} != implied {want}"
    assert set(sends) == set(recvs)
    for channel, sent in sends.items():
        assert recvs[channel] == sent, f"channel {channel}: sent {sent}, received {recvs[channel]}"

    # action-level simulation: a receive waits until the matching send (by virtual stage and
    # micro-batch, not by queue position: FIFO order was checked above) has executed
    pos = [0] * P
    sent: set[tuple[str, int, int | None]] = set()  # (payload, receiving virtual stage, micro-batch)
    progress = True
    while progress:
        progress = False
        for d in range(P):
            while pos[d] < len(schedule.actions[d]):
                a = schedule.actions[d][pos[d]]
                vs = vstage(d, a.chunk)
                if a.kind is Kind.SEND_ACTIVATION:
                    sent.add(("act", vs + 1, a.micro_batch))
                elif a.kind is Kind.SEND_GRADIENT:
                    sent.add(("grad", vs - 1, a.micro_batch))
                elif a.kind.is_recv:
                    payload = "act" if a.kind is Kind.RECV_ACTIVATION else "grad"
                    if (payload, vs, a.micro_batch) not in sent:
                        break
                pos[d] += 1
                progress = True
    stuck = {d: schedule.actions[d][pos[d]] for d in range(P) if pos[d] < len(schedule.actions[d])}
    assert not stuck, f"simulation deadlocks at {stuck}"


def assert_dry_run_complete(schedule: Schedule, order: list[tuple[int, Action]]) -> None:
    """Every action of every device appears exactly once, each device's actions in program order."""
    expected = Counter((d, a) for d, acts in enumerate(schedule.actions) for a in acts)
    assert Counter(order) == expected
    assert len(order) == sum(len(acts) for acts in schedule.actions)
    for d, acts in enumerate(schedule.actions):
        assert tuple(a for dd, a in order if dd == d) == acts


def make(name: str, P: int, M: int, v: int, compute: list[list[Action]], forward_only: bool = False) -> Schedule:
    """A hand-made schedule: compute lists with the communication they imply."""
    actions = tuple(with_communication(c, d, P, v) for d, c in enumerate(compute))
    return Schedule(name, P, M, v, actions, forward_only)


def replace(schedule: Schedule, device: int, actions: list[Action]) -> Schedule:
    lists = list(schedule.actions)
    lists[device] = tuple(actions)
    return Schedule(schedule.name, schedule.stages, schedule.micro_batches, schedule.chunks, tuple(lists), schedule.forward_only,
                    placement=schedule.placement)


# ---------------------------------------------------------------------------------------------------
# 1. Properties of the generated schedules
# ---------------------------------------------------------------------------------------------------


@FAST
@given(name=st.sampled_from(["gpipe", "1f1b"]), P=stages_st, M=micro_batches_st)
def test_flush_schedules_are_valid(name, P, M):
    schedule = build_schedule(name, P, M)
    assert (schedule.stages, schedule.micro_batches, schedule.chunks) == (P, M, 1)
    validate(schedule)  # build_schedule validated already; validating again must not raise
    assert_training_invariants(schedule)
    assert_sound(schedule)


@FAST
@given(shape=interleaved_shapes())
def test_interleaved_schedule_is_valid(shape):
    P, M, v = shape
    schedule = build_schedule("interleaved_1f1b", P, M, v)
    assert (schedule.stages, schedule.micro_batches, schedule.chunks) == (P, M, v)
    validate(schedule)
    assert_training_invariants(schedule)
    assert_sound(schedule)


@pytest.mark.parametrize("P,M", [(2, 3), (4, 6), (3, 1), (8, 12)])
def test_interleaved_requires_multiple_of_stages(P, M):
    with pytest.raises(ValueError, match="multiple of stages"):
        build_schedule("interleaved_1f1b", P, M, 2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_schedules_reject_chunks(name):
    with pytest.raises(ValueError, match="one chunk per device"):
        build_schedule(name, 2, 4, 2)


def test_unknown_schedule_name():
    with pytest.raises(ValueError, match="is not available"):
        build_schedule("zero_bubble", 2, 4)


# ---------------------------------------------------------------------------------------------------
# 2. Exact action orders (docs/algorithms.md §2-4)
# ---------------------------------------------------------------------------------------------------


def test_gpipe_order_matches_spec_exhaustively():
    for P in range(1, 9):
        for M in range(1, 33):
            schedule = build_schedule("gpipe", P, M)
            for s in range(P):
                assert schedule.compute_actions(s) == spec_gpipe(s, P, M), (P, M, s)


def test_1f1b_order_matches_spec_exhaustively():
    for P in range(1, 9):
        for M in range(1, 33):
            schedule = build_schedule("1f1b", P, M)
            for s in range(P):
                assert schedule.compute_actions(s) == spec_1f1b(s, P, M), (P, M, s)


@FAST
@given(P=stages_st, M=micro_batches_st)
def test_1f1b_warmup_then_strict_alternation(P, M):
    """Structure, read off without the formula: k_s leading forwards, then F/B alternate, then only B."""
    schedule = build_schedule("1f1b", P, M)
    for s in range(P):
        compute = schedule.compute_actions(s)
        kinds = "".join("F" if a.kind is Kind.FORWARD else "B" if a.kind is Kind.BACKWARD else "S" for a in compute)
        k = min(P - 1 - s, M)
        assert kinds == "F" * k + "FB" * (M - k) + "B" * k + "S"
        # forwards and backwards each run in micro-batch order
        assert [a.micro_batch for a in compute if a.kind is Kind.FORWARD] == list(range(M))
        assert [a.micro_batch for a in compute if a.kind is Kind.BACKWARD] == list(range(M))


@FAST
@given(shape=interleaved_shapes())
def test_interleaved_order_matches_spec(shape):
    P, M, v = shape
    schedule = build_schedule("interleaved_1f1b", P, M, v)
    for d in range(P):
        compute = schedule.compute_actions(d)
        assert compute == spec_interleaved(d, P, M, v), (P, M, v, d)
        # K_d warm-up forwards, plus the forward that opens the first steady pair
        leading = next(i for i, a in enumerate(compute) if a.kind is not Kind.FORWARD)
        assert leading == min(spec_interleaved_warmup(d, P, M, v) + 1, M * v)


def test_interleaved_order_matches_spec_small_grid_exhaustively():
    for P in range(1, 5):
        for M in range(P, 17, P):
            for v in range(1, 5):
                schedule = build_schedule("interleaved_1f1b", P, M, v)
                for d in range(P):
                    assert schedule.compute_actions(d) == spec_interleaved(d, P, M, v), (P, M, v, d)


def test_literal_1f1b_p4_m8():
    assert build_schedule("1f1b", 4, 8).describe() == "\n".join([
        "stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7 STEP",
        "stage 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7 STEP",
        "stage 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7 STEP",
        "stage 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 STEP",
    ])


def test_literal_1f1b_fewer_micro_batches_than_warmup():
    # P=4, M=2: stage 0 would warm up 3 forwards but there are only 2 (k_0 = min(3, 2) = 2)
    assert build_schedule("1f1b", 4, 2).describe() == "\n".join([
        "stage 0: F0 F1 B0 B1 STEP",
        "stage 1: F0 F1 B0 B1 STEP",
        "stage 2: F0 F1 B0 B1 STEP",
        "stage 3: F0 B0 F1 B1 STEP",
    ])


def test_literal_gpipe_p2_m3():
    assert build_schedule("gpipe", 2, 3).describe() == "stage 0: F0 F1 F2 B2 B1 B0 STEP\nstage 1: F0 F1 F2 B2 B1 B0 STEP"


def test_literal_interleaved_p2_m4_v2():
    # worked by hand from section 4: forward k -> (chunk, mb) = (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) (1,2) (1,3);
    # backward k -> (1,0) (1,1) (0,0) (0,1) (1,2) (1,3) (0,2) (0,3); K_0 = min(2 + 2, 8) = 4, K_1 = min(0 + 2, 8) = 2
    assert build_schedule("interleaved_1f1b", 2, 4, 2).describe() == "\n".join([
        "stage 0: F0 F1 F0c1 F1c1 F2 B0c1 F3 B1c1 F2c1 B0 F3c1 B1 B2c1 B3c1 B2 B3 STEP",
        "stage 1: F0 F1 F0c1 B0c1 F1c1 B1c1 F2 B0 F3 B1 F2c1 B2c1 F3c1 B3c1 B2 B3 STEP",
    ])


def test_literal_interleaved_m_equals_p_runs_all_forwards_first():
    assert build_schedule("interleaved_1f1b", 2, 2, 2).describe() == "\n".join([
        "stage 0: F0 F1 F0c1 F1c1 B0c1 B1c1 B0 B1 STEP",
        "stage 1: F0 F1 F0c1 F1c1 B0c1 B1c1 B0 B1 STEP",
    ])


def test_literal_communication_1f1b_p2_m2():
    schedule = build_schedule("1f1b", 2, 2)
    assert [str(a) for a in schedule.actions[0]] == [
        "F0", "SEND_ACT0", "F1", "SEND_ACT1", "RECV_GRAD0", "B0", "RECV_GRAD1", "B1", "STEP",
    ]
    assert [str(a) for a in schedule.actions[1]] == [
        "RECV_ACT0", "F0", "B0", "SEND_GRAD0", "RECV_ACT1", "F1", "B1", "SEND_GRAD1", "STEP",
    ]


# ---------------------------------------------------------------------------------------------------
# 3. Activation memory
# ---------------------------------------------------------------------------------------------------


@FAST
@given(P=stages_st, M=micro_batches_st)
def test_1f1b_in_flight_bound(P, M):
    schedule = build_schedule("1f1b", P, M)
    for s in range(P):
        peak = max_in_flight(schedule.compute_actions(s))
        assert peak <= min(P - s, M), (P, M, s, peak)
        assert peak == min(P - 1 - s, M) + (1 if M > P - 1 - s else 0)  # k_s + 1, or M when M <= k_s


@FAST
@given(P=stages_st, M=micro_batches_st)
def test_gpipe_keeps_every_micro_batch_in_flight(P, M):
    schedule = build_schedule("gpipe", P, M)
    for s in range(P):
        assert max_in_flight(schedule.compute_actions(s)) == M


@FAST
@given(shape=interleaved_shapes())
def test_interleaved_in_flight_bound(shape):
    """Section 4: about K_d + 1 chunk-activations; with the pairing (F(K+i), B(i)) it is at most K_d + 1."""
    P, M, v = shape
    schedule = build_schedule("interleaved_1f1b", P, M, v)
    for d in range(P):
        K = spec_interleaved_warmup(d, P, M, v)
        assert max_in_flight(schedule.compute_actions(d)) <= min(K + 1, M * v)


# ---------------------------------------------------------------------------------------------------
# 4. The validator rejects broken schedules
# ---------------------------------------------------------------------------------------------------


def test_rejects_backward_before_forward():
    compute = [[F(0), F(1), B(1), B(0), STEP], [F(0), B(0), B(1), F(1), STEP]]
    with pytest.raises(ScheduleError, match=r"stage 1: B1 runs before its forward"):
        validate(make("bad", 2, 2, 1, compute))


def test_rejects_missing_backward():
    compute = [[F(0), F(1), F(2), B(0), B(1), B(2), STEP], [F(0), B(0), F(1), B(1), F(2), STEP]]
    with pytest.raises(ScheduleError, match=r"stage 1: B2 of chunk 0 runs 0 times, expected 1"):
        validate(make("bad", 2, 3, 1, compute))


def test_rejects_duplicated_forward():
    compute = [[F(0), F(1), F(1), B(0), B(1), STEP], [F(0), B(0), F(1), B(1), STEP]]
    with pytest.raises(ScheduleError, match=r"stage 0: F1 of chunk 0 runs 2 times, expected 1"):
        validate(make("bad", 2, 2, 1, compute))


def test_rejects_unknown_micro_batch():
    compute = [[F(0), B(0), F(5), B(5), STEP]]
    with pytest.raises(ScheduleError, match=r"stage 0: .*F1 of chunk 0 runs 0 times|unknown"):
        validate(make("bad", 1, 2, 1, compute))


def test_rejects_wrong_number_of_devices():
    good = build_schedule("1f1b", 3, 3)
    broken = Schedule("1f1b", 3, 3, 1, good.actions[:2])
    with pytest.raises(ScheduleError, match="expected 3 action lists, got 2"):
        validate(broken)


def test_rejects_deadlock_built_with_with_communication():
    # Stage 0 waits for the gradient of micro-batch 0 before sending the activation of micro-batch 1;
    # stage 1 waits for the activation of micro-batch 1 before it runs B0 and sends that gradient.
    compute = [[F(0), B(0), F(1), B(1), STEP], [F(0), F(1), B(0), B(1), STEP]]
    schedule = make("cyclic", 2, 2, 1, compute)
    with pytest.raises(ScheduleError, match="deadlocks") as info:
        validate(schedule)
    message = str(info.value)
    assert "'cyclic'" in message
    assert "stage 0 at RECV_GRAD0" in message and "stage 1 at RECV_ACT1" in message
    with pytest.raises(ScheduleError, match="deadlocks"):
        dry_run(schedule)


def test_rejects_deadlock_hand_written_three_stages():
    # P=3, M=1: stage 1 asks for the gradient of micro-batch 0 before it forwards (and sends) that
    # micro-batch's activation, which stage 2 needs before it can produce the gradient.
    RA, SA, RG, SG = Kind.RECV_ACTIVATION, Kind.SEND_ACTIVATION, Kind.RECV_GRADIENT, Kind.SEND_GRADIENT
    actions = (
        (F(0), Action(SA, 0), Action(RG, 0), B(0), STEP),
        (Action(RA, 0), Action(RG, 0), F(0), Action(SA, 0), B(0), Action(SG, 0), STEP),
        (Action(RA, 0), F(0), B(0), Action(SG, 0), STEP),
    )
    schedule = Schedule("hand", 3, 1, 1, actions)
    with pytest.raises(ScheduleError, match="deadlocks") as info:
        validate(schedule)
    assert "stage 1 at RECV_GRAD0" in str(info.value) and "stage 2 at RECV_ACT0" in str(info.value)


def test_rejects_fifo_mismatch():
    # stage 0 sends activations 0 then 1; stage 1 receives 1 first (each compute still has its receive)
    compute = [[F(0), F(1), B(1), B(0), STEP], [F(1), F(0), B(1), B(0), STEP]]
    with pytest.raises(ScheduleError, match="same order") as info:
        validate(make("swapped", 2, 2, 1, compute))
    assert "stage 1: RECV_ACT1" in str(info.value) and "micro-batch 0" in str(info.value)


def test_rejects_fifo_mismatch_across_chunks():
    # Interleaved, P=2, v=2: device 1 forwards chunk 0 of micro-batch 1 before micro-batch 0, so it
    # receives on the device-0 -> device-1 activation channel out of order.
    good = build_schedule("interleaved_1f1b", 2, 2, 2)
    compute = [list(good.compute_actions(0)), list(good.compute_actions(1))]
    i, j = compute[1].index(F(0)), compute[1].index(F(1))
    compute[1][i], compute[1][j] = compute[1][j], compute[1][i]
    with pytest.raises(ScheduleError, match="same order"):
        validate(make("interleaved_1f1b", 2, 2, 2, compute))


def test_rejects_send_without_receive():
    good = build_schedule("gpipe", 2, 2)
    extra = list(good.actions[0]) + [Action(Kind.SEND_ACTIVATION, 0)]
    with pytest.raises(ScheduleError, match="sends messages nobody receives") as info:
        validate(replace(good, 0, extra))
    assert "'gpipe'" in str(info.value)


def test_rejects_send_from_last_stage():
    good = build_schedule("gpipe", 2, 2)
    extra = list(good.actions[1])
    extra.insert(extra.index(F(1)) + 1, Action(Kind.SEND_ACTIVATION, 1))
    with pytest.raises(ScheduleError, match="nobody receives"):
        validate(replace(good, 1, extra))


def test_rejects_receive_without_send():
    good = build_schedule("gpipe", 2, 2)
    extra = list(good.actions[1])
    extra.insert(len(extra) - 1, Action(Kind.RECV_ACTIVATION, 0))  # a second receive of micro-batch 0, never sent
    with pytest.raises(ScheduleError, match="deadlocks") as info:
        validate(replace(good, 1, extra))
    assert "stage 1 at RECV_ACT0" in str(info.value)


def test_rejects_compute_without_its_receive():
    good = build_schedule("1f1b", 2, 2)
    missing = [a for a in good.actions[1] if a != Action(Kind.RECV_ACTIVATION, 1)]
    with pytest.raises(ScheduleError, match=r"stage 1: F1 has no RECV_ACT before it"):
        validate(replace(good, 1, missing))


def test_rejects_send_before_compute():
    good = build_schedule("1f1b", 3, 2)
    acts = list(good.actions[1])
    send = acts.pop(acts.index(Action(Kind.SEND_GRADIENT, 0)))
    acts.insert(acts.index(B(0)), send)
    with pytest.raises(ScheduleError, match=r"stage 1: SEND_GRAD0 sends before its backward ran"):
        validate(replace(good, 1, acts))


@pytest.mark.parametrize("defect", ["missing", "first", "duplicated", "before_last_backward"])
def test_rejects_bad_step(defect):
    good = build_schedule("1f1b", 4, 8)
    acts = list(good.actions[0])
    assert acts[-1] == STEP
    if defect == "missing":
        acts.pop()
    elif defect == "first":
        acts.insert(0, acts.pop())
    elif defect == "duplicated":
        acts.append(STEP)
    else:
        acts[-1], acts[-2] = acts[-2], acts[-1]
    try:
        validate(replace(good, 0, acts))
    except ScheduleError:
        return
    raise AssertionError(f"validate accepted a schedule whose stage 0 has STEP {defect}")


def _valid_schedules(max_stages: int = 4, max_micro_batches: int = 8, max_chunks: int = 3):
    flush = st.tuples(
        st.sampled_from(["gpipe", "1f1b"]), st.integers(1, max_stages), st.integers(1, max_micro_batches), st.just(1)
    )
    interleaved = interleaved_shapes(max_stages, max_micro_batches, max_chunks).map(lambda s: ("interleaved_1f1b", *s))
    zero_bubble = st.one_of(
        st.tuples(st.just("zb_h1"), st.integers(1, max_stages), st.integers(1, max_micro_batches), st.just(1)),
        st.tuples(st.just("zbv"), st.integers(1, max_stages), st.integers(1, max_micro_batches), st.just(2)),
        st.integers(1, max_stages).flatmap(
            lambda P: st.tuples(st.just("dualpipev"), st.just(P), st.integers(2 * P, max(2 * P, max_micro_batches)), st.just(2))),
    )
    return st.one_of(flush, interleaved, zero_bubble)


@settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_valid_schedules(), data=st.data())
def test_mutations_are_rejected_or_still_sound(spec, data):
    """Swap two actions of one device (anywhere, or adjacent) or delete one: either the validator
    raises an informative ScheduleError or the result passes an independent soundness oracle.
    Conversely, the validator never rejects a mutation the oracle finds sound (no false alarms).

    Mutations touching STEP are left out: the validator does not check STEP (see test_rejects_bad_step).
    """
    name, P, M, v = spec
    good = build_schedule(name, P, M, v)
    device = data.draw(st.integers(0, P - 1), label="device")
    acts = list(good.actions[device])
    n = len(acts) - 1  # the last action, STEP, is never touched
    mutation = data.draw(st.sampled_from(["swap", "adjacent_swap", "delete"]), label="mutation")
    if mutation == "delete":
        i = data.draw(st.integers(0, n - 1), label="i")
        del acts[i]
    else:
        assume(n >= 2)
        if mutation == "swap":
            i, j = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True), label="i,j")
        else:
            i = data.draw(st.integers(0, n - 2), label="i")
            j = i + 1
        acts[i], acts[j] = acts[j], acts[i]
    mutated = replace(good, device, acts)
    try:
        order = validate(mutated)
    except ScheduleError as error:
        message = str(error)
        assert message.startswith(("stage ", "schedule ", "expected ")), message
        if "under NCCL's rules" in message:
            # stricter than the oracle, which models gloo: NCCL ignores tags and runs each stream in issue
            # order, so e.g. two gradients received in the other order than sent are a mix-up there
            return
        with pytest.raises(AssertionError):
            assert_sound(mutated)  # the oracle agrees it is broken
        return
    # accepted: it must be genuinely sound, and deletions are never sound
    assert mutation != "delete", f"validate accepted stage {device} without one of its actions"
    assert_sound(mutated)
    assert_dry_run_complete(mutated, order)


def test_mutation_oracle_catches_every_deletion_exhaustively():
    """Every single-action deletion (except STEP) of a few small schedules is rejected."""
    for name, P, M, v in [("gpipe", 3, 3, 1), ("1f1b", 3, 4, 1), ("interleaved_1f1b", 2, 4, 2), ("zb_h1", 3, 4, 1),
                          ("zbv", 2, 4, 2), ("dualpipev", 2, 4, 2)]:
        good = build_schedule(name, P, M, v)
        for d in range(P):
            for i in range(len(good.actions[d]) - 1):
                acts = list(good.actions[d])
                removed = acts.pop(i)
                with pytest.raises(ScheduleError):
                    validate(replace(good, d, acts))
                    pytest.fail(f"{name} P={P} M={M} v={v}: stage {d} without {removed} accepted")


def test_every_adjacent_swap_is_rejected_or_sound():
    """Exhaustively: every adjacent swap (STEP untouched) of a few small schedules; validator and oracle agree."""
    for name, P, M, v in [("gpipe", 3, 3, 1), ("1f1b", 4, 4, 1), ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 3, 3, 2),
                          ("zb_h1", 3, 4, 1), ("zbv", 2, 4, 2), ("dualpipev", 2, 5, 2)]:
        good = build_schedule(name, P, M, v)
        for d in range(P):
            for i in range(len(good.actions[d]) - 2):
                acts = list(good.actions[d])
                acts[i], acts[i + 1] = acts[i + 1], acts[i]
                mutated = replace(good, d, acts)
                try:
                    order = validate(mutated)
                except ScheduleError:
                    with pytest.raises(AssertionError):
                        assert_sound(mutated)
                    continue
                assert_sound(mutated)
                assert_dry_run_complete(mutated, order)


# ---------------------------------------------------------------------------------------------------
# 5. dry_run
# ---------------------------------------------------------------------------------------------------


@FAST
@given(spec=_valid_schedules(max_stages=8, max_micro_batches=32, max_chunks=4))
def test_dry_run_runs_every_action_exactly_once(spec):
    name, P, M, v = spec
    schedule = build_schedule(name, P, M, v)
    order = dry_run(schedule)
    assert_dry_run_complete(schedule, order)
    assert validate(schedule) == order
    # causality in the global order: every receive comes after its send
    seen: set[tuple[int, Action]] = set()
    home = {oracle_virtual_stage(schedule, d, c): (d, c) for d in range(P) for c in range(v)}
    for d, a in order:
        if a.kind.is_recv:
            vs = oracle_virtual_stage(schedule, d, a.chunk)
            other = vs - 1 if a.kind is Kind.RECV_ACTIVATION else vs + 1
            send_kind = Kind.SEND_ACTIVATION if a.kind is Kind.RECV_ACTIVATION else Kind.SEND_GRADIENT
            assert (home[other][0], Action(send_kind, a.micro_batch, home[other][1])) in seen
        seen.add((d, a))


def test_dry_run_single_device():
    schedule = build_schedule("1f1b", 1, 3)
    assert [str(a) for _, a in dry_run(schedule)] == ["F0", "B0", "F1", "B1", "F2", "B2", "STEP"]


def test_dry_run_delayed_sends_and_shuffled_lists():
    """Delaying sends keeps a schedule valid (sends never block); shuffling every list breaks it."""
    rng = random.Random(0)
    schedule = build_schedule("gpipe", 4, 6)
    # gpipe: delay each SEND_GRADIENT of stage 1 to just before its STEP; stage 0 only waits longer
    acts = [a for a in schedule.actions[1] if a.kind is not Kind.SEND_GRADIENT and a != STEP]
    sends = [a for a in schedule.actions[1] if a.kind is Kind.SEND_GRADIENT]
    mutated = replace(schedule, 1, acts + sends + [STEP])
    order = validate(mutated)
    assert_dry_run_complete(mutated, order)
    assert_sound(mutated)
    # and a (seeded) random permutation of every device list is rejected
    lists = [list(a[:-1]) for a in schedule.actions]
    for lst in lists:
        rng.shuffle(lst)
    shuffled = Schedule("gpipe", 4, 6, 1, tuple(tuple(lst) + (STEP,) for lst in lists))
    with pytest.raises(ScheduleError):
        validate(shuffled)


@pytest.mark.parametrize("stages,micro_batches,chunks", [(1, 1, 1), (2, 3, 1), (3, 7, 1), (2, 5, 2), (4, 4, 3)])
def test_forward_only_schedules_forward_everything_once(stages, micro_batches, chunks):
    name = "interleaved_1f1b" if chunks > 1 else "1f1b"
    schedule = build_schedule(name, stages, micro_batches, chunks, forward_only=True)
    for device in range(stages):
        compute = schedule.compute_actions(device)
        assert sorted((a.chunk, a.micro_batch) for a in compute) == sorted(
            (c, m) for c in range(chunks) for m in range(micro_batches)
        )
        assert all(a.kind is Kind.FORWARD for a in compute)
    bad = replace(schedule, 0, list(schedule.actions[0]) + [STEP])
    with pytest.raises(ScheduleError, match="forward-only schedule must not STEP"):
        validate(bad)


@FAST
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 3), st.data())
def test_a_short_last_window_is_sound_and_steps_once_more(P, M, windows, data):
    """A segment ending in a short window (a short last batch of m < M micro-batches) is valid: every
    stage steps once per window, the short mini-batch after its own last backward, in the drain."""
    from lightning_pipe.schedules import validate_async

    m = data.draw(st.integers(1, M))
    segment = validate_async("pipedream", P, M, windows, m)
    for d in range(P):
        actions = segment.compute_actions(d)
        assert sum(a.kind is Kind.STEP for a in actions) == windows
        assert actions[-1].kind is Kind.STEP and actions[-2] == B((windows - 1) * M + m - 1)


# ---------------------------------------------------------------------------------------------------
# zero-bubble schedules (docs/algorithms.md §4a)
# ---------------------------------------------------------------------------------------------------


def test_literal_zb_h1_p3_m4():
    """Written from the spec: 1F1B's warm-up, then F and I in pairs; stage s holds back its first s W's."""
    assert build_schedule("zb_h1", 3, 4).describe() == "\n".join([
        "stage 0: F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3 STEP",
        "stage 1: F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3 STEP",
        "stage 2: F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3 STEP",
    ])


@FAST
@given(P=stages_st, M=micro_batches_st)
def test_zb_h1_keeps_1f1b_peak_memory_and_its_critical_path(P, M):
    """At most P micro-batches in flight (forward done, W not) on any stage, 1F1B's peak (stage 0's); the
    I's come in 1F1B's backward order."""
    schedule = build_schedule("zb_h1", P, M)
    one_f_one_b = build_schedule("1f1b", P, M)
    for d in range(P):
        live, peak = 0, 0
        for a in schedule.actions[d]:
            live += (a.kind is Kind.FORWARD) - (a.kind is Kind.BACKWARD_WEIGHT)
            peak = max(peak, live)
        assert peak <= min(P, M)
        inputs = [(a.kind, a.micro_batch) for a in schedule.compute_actions(d) if a.kind in (Kind.FORWARD, Kind.BACKWARD_INPUT)]
        flush = [(Kind.BACKWARD_INPUT if a.kind is Kind.BACKWARD else a.kind, a.micro_batch)
                 for a in one_f_one_b.compute_actions(d) if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
        assert inputs == flush


def _torch_v_order(name: str, P: int, M: int, device: int) -> list[str]:
    """torch.distributed.pipelining's order of its ZBV or DualPipeV schedule for ``device`` (stage index ``s``:
    device ``s`` or ``2P-1-s``; an overlapped F+B: F, then B), as our actions' strings."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {"zbv": schedules.ScheduleZBVZeroBubble, "dualpipev": schedules.ScheduleDualPipeV}[name]
    reference = object.__new__(cls)  # only its order generator, no process group
    reference.pp_group_size, reference.num_stages, reference._n_microbatches = P, 2 * P, M
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    out = []
    for op in reference._calculate_single_rank_operations(device):
        if op is None:
            continue
        for part in getattr(op, "sub_actions", None) or (op,):
            chunk = 0 if part.stage_index < P else 1
            out.append(f"{kinds[part.computation_type.name]}{part.microbatch_index}" + ("c1" if chunk else ""))
    return out + ["STEP"]


@pytest.mark.parametrize("name,P,M", [("zbv", 2, 1), ("zbv", 2, 2), ("zbv", 2, 4), ("zbv", 2, 8), ("zbv", 3, 5),
                                      ("zbv", 4, 8), ("zbv", 4, 16), ("dualpipev", 2, 4), ("dualpipev", 2, 9),
                                      ("dualpipev", 3, 6), ("dualpipev", 4, 13), ("dualpipev", 5, 10)])
def test_v_orders_are_torch_pipelinings(name, P, M):
    schedule = build_schedule(name, P, M, 2)
    for d in range(P):
        assert [str(a) for a in schedule.compute_actions(d)] == _torch_v_order(name, P, M, d)


@FAST
@given(P=stages_st, M=micro_batches_st)
def test_zero_bubble_schedules_are_sound(P, M):
    for name, v, m in (("zb_h1", 1, M), ("zbv", 2, M), ("dualpipev", 2, max(M, 2 * P))):
        schedule = build_schedule(name, P, m, v)
        validate(schedule)
        assert_sound(schedule)


def test_zbv_places_its_chunks_as_a_v():
    schedule = build_schedule("zbv", 3, 6, 2)
    assert [schedule.virtual_stage(d, c) for c in range(2) for d in range(3)] == [0, 1, 2, 5, 4, 3]
    assert schedule.locate(5) == (0, 1) and schedule.locate(3) == (2, 1)
    # the turn of the V (virtual stages 2 and 3 on device 2) hands over in memory: no messages between them
    assert not [a for a in schedule.actions[2] if a.chunk == 1 and a.kind in (Kind.RECV_ACTIVATION, Kind.SEND_GRADIENT)]
    assert not [a for a in schedule.actions[2] if a.chunk == 0 and a.kind in (Kind.SEND_ACTIVATION, Kind.RECV_GRADIENT)]


def test_rejects_a_weight_gradient_before_its_input_gradient():
    good = build_schedule("zb_h1", 2, 2)
    acts = list(good.actions[1])
    i = next(k for k, a in enumerate(acts) if a.kind is Kind.BACKWARD_INPUT)
    w = next(k for k, a in enumerate(acts) if a.kind is Kind.BACKWARD_WEIGHT and a.micro_batch == acts[i].micro_batch)
    acts.insert(i, acts.pop(w))
    with pytest.raises(ScheduleError, match="before the I of its micro-batch"):
        validate(replace(good, 1, acts))


def test_rejects_a_backward_that_is_both_whole_and_split():
    good = build_schedule("zb_h1", 2, 2)
    acts = list(good.actions[0])
    w = next(k for k, a in enumerate(acts) if a.kind is Kind.BACKWARD_WEIGHT)
    acts[w] = B(acts[w].micro_batch)
    with pytest.raises(ScheduleError, match="one B, or one I and one W|both a B and an I/W"):
        validate(replace(good, 0, acts))


def test_rejects_a_chunk_that_takes_from_its_neighbour_on_the_device_too_early():
    good = build_schedule("zbv", 2, 2, 2)
    acts = list(good.actions[1])  # device 1 holds virtual stages 1 and 2: F(j, c1) needs F(j, c0) first
    f0 = acts.index(F(0))
    f0c1 = acts.index(F(0, 1))
    acts[f0], acts[f0c1] = acts[f0c1], acts[f0]
    with pytest.raises(ScheduleError, match="same device"):
        validate(replace(good, 1, acts))
