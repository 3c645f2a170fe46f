"""Evaluation whatever ``micro_batches`` and the batch size: uneven micro-batches (6, 5, 5 samples) put two
shape headers in flight on one link, and every transport checks the size of what arrives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.engine import Executor, SequentialStage, Watchdog, split_micro_batches
from lightning_pipe.errors import MessageMismatchError
from lightning_pipe.partition import stage_bounds
from lightning_pipe.registry import build_schedule
from lightning_pipe.schedules.ir import virtual_stage_of
from tests.distributed.test_engine import make_transport
from tests.harness.distributed import run_workers, values
from tests.harness.launch import launch
from tests.harness.lightning_run import train

#: the evaluation schedules differ only in chunks per device and their placement (every schedule
#: evaluates with its flushed one's forward-only variant)
EVALUATION_LAYOUTS = [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)]
MICRO_BATCHES = (2, 3, 5)
BATCH_SIZES = (7, 10, 16)


def make_trunk() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(6, 6), nn.Tanh())])


def evaluate_everywhere(rank: int, world_size: int, wire: str) -> list[tuple[str, int, int, float]]:
    """Every evaluation layout × micro-batch count × batch size on one transport; on the rank holding the
    last virtual stage, the largest difference from the unsplit trunk for each."""
    trunk = make_trunk()
    transport = make_transport(wire)
    results = []
    for schedule, chunks in EVALUATION_LAYOUTS:
        virtual = world_size * chunks
        bounds = stage_bounds([len(trunk) // virtual] * virtual)
        plan_probe = build_schedule(schedule, world_size, 2 * world_size, chunks, True)
        local = [virtual_stage_of(rank, c, world_size, plan_probe.placement) for c in range(chunks)]
        stages = [SequentialStage(trunk[slice(*bounds[vs])], input_fn=(lambda mb: mb) if vs == 0 else None) for vs in local]
        executor = Executor(rank, list(range(world_size)), stages, transport, Watchdog(timeout=30.0))
        for micro_batches in MICRO_BATCHES:
            for size in BATCH_SIZES:
                batch = torch.randn(size, 6, generator=torch.Generator().manual_seed(size))
                plan = build_schedule(schedule, world_size, micro_batches, chunks, True)
                with torch.no_grad():
                    outputs = executor.run(plan, split_micro_batches(batch, micro_batches))
                    if outputs:
                        error = (torch.cat(outputs) - trunk(batch)).abs().max().item()
                        results.append((schedule, micro_batches, size, error))
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("wire", ["gloo", "shm", "nccl"])
def test_every_evaluation_layout_takes_uneven_micro_batches(wire):
    ranks = values(run_workers(evaluate_everywhere, 2, wire, timeout=120))
    results = [r for rank in ranks for r in rank]
    assert len(results) == len(EVALUATION_LAYOUTS) * len(MICRO_BATCHES) * len(BATCH_SIZES)
    assert max(error for *_, error in results) < 1e-6, results


def disagreeing_batches(rank: int, world_size: int, wire: str) -> None:
    """Rank 1 loads 18 samples where rank 0 loads 16: it expects micro-batch 1 to be as long as micro-batch 0."""
    trunk = make_trunk()
    transport = make_transport(wire)
    stages = [SequentialStage(trunk[:4], input_fn=lambda mb: mb)] if rank == 0 else [SequentialStage(trunk[4:])]
    executor = Executor(rank, [0, 1], stages, transport, Watchdog(timeout=20.0))
    batch = torch.randn(16 if rank == 0 else 18, 6)
    with torch.no_grad():
        executor.run(build_schedule("1f1b", 2, 3, 1, True), split_micro_batches(batch, 3))


@pytest.mark.multiprocess
@pytest.mark.parametrize("wire", ["gloo", "shm"])
def test_a_message_of_the_wrong_size_names_the_micro_batch_and_stage(wire):
    (_, first), (status, message) = run_workers(disagreeing_batches, 2, wire, timeout=90)
    assert status == "error", message
    assert MessageMismatchError.__name__ in message
    assert "expected micro-batch 1's activation (RECV_ACT1) with shapes [(6, 6)]" in message, message
    assert "disagree on the micro-batches" in message, message


def test_local_transport_checks_shapes():
    """The in-process transport hands tensors over, and still checks them against the expected shapes."""
    from lightning_pipe.engine.local import LocalTransport
    from lightning_pipe.engine.p2p import ACTIVATION_TAG, Header

    queues, sent = {}, {}
    sender, receiver = LocalTransport(0, queues, sent), LocalTransport(1, queues, sent)
    sender.send_activation(torch.zeros(5, 6), 1, header=False)
    with pytest.raises(MessageMismatchError, match=r"sent shapes \[\(5, 6\)\] where \[\(6, 6\)\]"):
        receiver.post_payload(Header.of(torch.zeros(6, 6)).metas, 0, ACTIVATION_TAG)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule,micro_batches,eval_batch_size,transport", [
    ("1f1b", 3, 16, "process_group"), ("pipemare", 3, 10, "auto"), ("zbv", 5, 7, "auto"), ("avgpipe", 3, 10, "auto"),
])
def test_evaluation_with_uneven_micro_batches_equals_one_device(schedule, micro_batches, eval_batch_size, transport):
    """The sanity check, mid-epoch validation, validate, test and predict through Lightning (an asynchronous
    schedule trains other weights than one device: it evaluates untrained ones)."""
    asynchronous = schedule in ("pipemare", "avgpipe")
    common = {"max_steps": 0 if asynchronous else 2, "batch_size": 16, "evaluate": True, "eval_batch_size": eval_batch_size,
              "trainer": {"val_check_interval": 2, "num_sanity_val_steps": 2}}
    reference = train(common)
    code, output, records = launch({**common, "devices": 2, "strategy": {
        "schedule": schedule, "micro_batches": micro_batches, "transport": transport}})
    assert code == 0, output[-3000:]
    for record in records:
        for key in ("val_metrics", "validate", "test"):
            assert len(record[key]) == len(reference[key])
            for got, want in zip(record[key], reference[key]):
                assert got == pytest.approx(want, rel=1e-5, abs=1e-6), key
        torch.testing.assert_close(torch.cat(record["predict"]), torch.cat(reference["predict"]), rtol=1e-5, atol=1e-6)
