"""The NCCL transport model: every schedule is deadlock-free under NCCL's rules with one stream per
channel (direction and message kind), and the model catches what the gloo dry run cannot (pure
Python, no processes)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_pipe.registry import SCHEDULES, build_schedule, names
from lightning_pipe.schedules import Kind, Schedule, ScheduleError, build_avgpipe, dry_run, validate_async
from lightning_pipe.schedules.rendezvous import rendezvous_dry_run

FAST = settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def synchronous_cases(draw):
    name = draw(st.sampled_from(names("synchronous")))
    P = draw(st.integers(1, 8))
    M = draw(st.integers(1, 32))
    row = SCHEDULES[name]
    chunks = 1
    while row.requirement(P, M) is not None:  # interleaved: a multiple of P; dualpipev: at least 2P
        M += 1
    if row.fixed_chunks is not None:
        chunks = row.fixed_chunks
    elif row.chunked:
        chunks = draw(st.integers(1, 4))
    return build_schedule(name, P, M, chunks)


@FAST
@given(schedule=synchronous_cases(), headers=st.booleans())
def test_every_synchronous_schedule_runs_under_nccl_rules(schedule: Schedule, headers: bool):
    order = rendezvous_dry_run([schedule], headers=headers)
    assert sorted(map(str, (a for _, a in order))) == sorted(str(a) for actions in schedule.actions for a in actions)


@FAST
@given(name=st.sampled_from(names("asynchronous")), P=st.integers(1, 8), M=st.integers(1, 32),
       windows=st.integers(1, 4), short=st.integers(0, 31), headers=st.booleans())
def test_every_asynchronous_segment_runs_window_by_window(name, P, M, windows, short, headers):
    """Windows and the drain run as separate executor runs; a short last window too."""
    assume(SCHEDULES[name].requirement(P, M) is None)
    last = None if short == 0 or short >= M else short
    validate_async.cache_clear()
    validate_async(name, P, M, windows, last)  # runs the model on the windows one by one


@FAST
@given(P=st.integers(2, 6), M=st.integers(1, 12), replicas=st.integers(1, 4), advance=st.integers(0, 2))
def test_avgpipe_rounds_that_keep_one_fifo_order_run_under_nccl_rules(P, M, replicas, advance):
    """What the avgpipe runtime accepts on NCCL (one FIFO order across replicas) also cannot deadlock."""
    schedule = build_avgpipe(P, M, replicas, advance)
    try:
        dry_run(schedule, replica_channels=False)
        refused = False
    except ScheduleError:
        refused = True  # refused on NCCL before anything runs (engine/avgpipe_rounds.py)
    assume(not refused)
    rendezvous_dry_run([schedule], headers=True)
    rendezvous_dry_run([schedule], headers=False)


def test_one_stream_per_pair_deadlocks_1f1b():
    """The classic: in 1F1B's steady state stage 0 sends an activation before it receives a gradient,
    stage 1 sends that gradient before it receives the activation; on one stream both wait forever."""
    schedule = build_schedule("1f1b", 2, 4)
    dry_run(schedule)  # gloo: fine
    with pytest.raises(ScheduleError, match=r"deadlocks under NCCL's rules .*streams: pair\)"):
        rendezvous_dry_run([schedule], streams="pair", headers=False)
    rendezvous_dry_run([schedule], streams="direction", headers=False)


def test_fused_runs_repair_1f1b_but_not_interleaved_on_one_stream_per_pair():
    """Why the transport splits directions instead of fusing runs (Megatron's way): interleaved 1F1B's
    runs do not pair up, so fused groups still wait on each other."""
    rendezvous_dry_run([build_schedule("1f1b", 4, 8)], streams="pair", fused=True, headers=False)
    with pytest.raises(ScheduleError, match="deadlocks"):
        rendezvous_dry_run([build_schedule("interleaved_1f1b", 2, 4, 2)], streams="pair", fused=True, headers=False)
    rendezvous_dry_run([build_schedule("interleaved_1f1b", 2, 4, 2)], streams="direction", fused=True, headers=False)


def test_reordering_two_kinds_of_message_on_one_direction_is_caught_on_direction_streams():
    """Interleaved 1F1B on 2 devices sends both activations and gradients from device 0 to device 1.
    gloo tells them apart by tag; NCCL ignores tags, so on one stream per direction, sending one later
    than the receiver expects is a mix-up the NCCL model reports (and the gloo dry run accepts). The
    transport's channel streams (one per kind as well) keep the two apart."""
    schedule = build_schedule("interleaved_1f1b", 2, 4, 2)
    actions = list(schedule.actions[0])
    first_act = next(i for i, a in enumerate(actions) if a.kind is Kind.SEND_ACTIVATION and a.chunk == 0 and a.micro_batch == 2)
    next_grad = next(i for i in range(first_act, len(actions)) if actions[i].kind is Kind.SEND_GRADIENT and actions[i].chunk == 1)
    mutated_actions = actions[:first_act] + actions[first_act + 1:next_grad + 1] + [actions[first_act]] + actions[next_grad + 1:]
    mutated = Schedule(schedule.name, 2, 4, 2, (tuple(mutated_actions), schedule.actions[1]))
    dry_run(mutated)  # gloo: each kind keeps its own order
    with pytest.raises(ScheduleError, match="in the order they are sent"):
        rendezvous_dry_run([mutated], streams="direction", headers=False)
    rendezvous_dry_run([mutated], streams="channel", headers=False)


def test_reordering_two_messages_of_one_channel_is_caught():
    schedule = build_schedule("zb_h1", 2, 4)
    actions = list(schedule.actions[0])
    sends = [i for i, a in enumerate(actions) if a.kind is Kind.SEND_ACTIVATION][:2]
    actions[sends[0]], actions[sends[1]] = actions[sends[1]], actions[sends[0]]
    mutated = Schedule(schedule.name, 2, 4, 1, (tuple(actions), schedule.actions[1]))
    with pytest.raises(ScheduleError, match="in the order they are sent"):
        rendezvous_dry_run([mutated], headers=False)


def test_a_single_device_sends_nothing_across_processes():
    schedule = build_schedule("interleaved_1f1b", 1, 2, 2)
    assert len(rendezvous_dry_run([schedule])) == len(schedule.actions[0])


def test_fused_runs_cannot_wait_for_headers():
    with pytest.raises(ValueError, match="headers=False"):
        rendezvous_dry_run([build_schedule("1f1b", 2, 2)], fused=True, headers=True)


def test_the_emulation_transport_delivers_in_channel_order_without_tags():
    """The one-device emulation's transport keeps NCCL's rules: one queue per channel (direction and
    kind), and a send's request is complete only once its receive ran."""
    import torch

    from lightning_pipe.engine.local import LocalTransport
    from lightning_pipe.engine.p2p import ACTIVATION_TAG, GRADIENT_TAG, Header

    queues, sent = {}, {}
    metas = Header.of(torch.ones(2)).metas
    first, second = LocalTransport(0, queues, sent), LocalTransport(1, queues, sent)
    (request, _), = first.send_activation(torch.ones(2), dst=1, header=False)
    first.send_activation(torch.full((2,), 2.0), dst=1, header=False)
    first.send_gradients([torch.zeros(2)], dst=1)
    with pytest.raises(RuntimeError, match="has not taken"):
        request.wait()
    (_, gradient), = second.post_payload(metas, 0, GRADIENT_TAG)  # its own channel: no need to wait
    assert torch.equal(gradient, torch.zeros(2))
    (_, activation), = second.post_payload(metas, 0, ACTIVATION_TAG)
    assert torch.equal(activation, torch.ones(2))  # the oldest of its channel, whatever the receiver meant
    request.wait()
    assert sent == {(0, 1, "activation"): 2, (0, 1, "gradient"): 1}


def test_zbv_needs_a_stream_per_message_kind():
    """ZBV's V sends chunk 0's activations and chunk 1's gradients from device 0 to device 1 in one order
    and takes them in another: on one stream per direction NCCL would deliver the wrong message."""
    schedule = build_schedule("zbv", 2, 4, 2)
    with pytest.raises(ScheduleError, match="in the order they are sent"):
        rendezvous_dry_run([schedule], streams="direction", headers=False)
    rendezvous_dry_run([schedule], streams="channel", headers=False)
    rendezvous_dry_run([schedule], streams="channel", headers=True)


def test_groups_spanning_the_pipeline_deadlock_avgpipe_so_the_transport_makes_them_per_pair():
    """A process group is one communicator whose stream a rank shares among all its peers. With one group
    per direction and kind spanning the pipeline, a receive from the previous stage queued in front of a
    send to the next one deadlocks avgpipe's rounds; with the transport's two-rank groups (a stream per
    pair and channel) they run (issue 30, hazard 5)."""
    from lightning_pipe.engine.p2p import ring_pairs

    schedule = build_avgpipe(4, 3, 2, 0)  # 4 stages, 3 micro-batches, 2 replicas, no forward advance
    dry_run(schedule, replica_channels=False)  # one FIFO order across replicas: accepted on NCCL
    with pytest.raises(ScheduleError, match="deadlocks under NCCL's rules"):
        rendezvous_dry_run([schedule], streams="channel", communicators="group")
    rendezvous_dry_run([schedule], streams="channel", communicators="pair")
    # every message of every schedule travels between ring neighbours, which are the pairs given groups
    assert ring_pairs(2) == [(0, 1)] and ring_pairs(4) == [(0, 1), (0, 3), (1, 2), (2, 3)]


@pytest.mark.parametrize("name,extra", [("1f1b", {}), ("interleaved_1f1b", {"chunks": 2}), ("zbv", {"chunks": 2}),
                                        ("dualpipev", {"chunks": 2})])
def test_the_usual_schedules_also_run_on_groups_spanning_the_pipeline(name, extra):
    rendezvous_dry_run([build_schedule(name, 4, 8, **extra)], streams="channel", communicators="group")
