"""``PipeStrategy(pipelines=N, data_parallel="fsdp")``: each stage's trunk layers sharded across the N copies
of the stage (FSDP2) still equal one device at N × the batch size (issue 33)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_strategy import merged_state
from tests.harness.launch import launch
from tests.harness.lightning_run import train

STEPS = 4
TRUNK = [f"model.{2 * i}.{kind}" for i in range(6) for kind in ("weight", "bias")]  # TrunkModel's Linear layers


def assert_state_equal(reference: dict, records: list, pipelines: list[list[int]]) -> None:
    for pipeline in pipelines:
        state = merged_state([records[r] for r in pipeline])
        assert state.keys() == reference["state"].keys()
        for key, value in reference["state"].items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("schedule,extra", [("gpipe", {}), ("1f1b", {}), ("interleaved_1f1b", {"chunks_per_stage": 2})])
def test_two_sharded_pipelines_equal_one_device_at_double_batch(schedule, extra):
    """2 stages × 2 pipelines, Adam (its state sharded too): after 4 steps every weight, gathered whole,
    equals one device trained at twice the batch; the trunk's parameters are DTensors, the rest stays whole."""
    reference = train({"max_steps": STEPS, "batch_size": 16, "model": {"optimizer": "adam"}})
    code, output, records = launch({
        "devices": 4, "max_steps": STEPS, "batch_size": 8, "stages": 2, "pipelines_in_sampler": 2, "model": {"optimizer": "adam"},
        "strategy": {"schedule": schedule, "micro_batches": 4, "pipelines": 2, "data_parallel": "fsdp", **extra},
    }, timeout=300)
    assert code == 0, output[-3000:]
    assert_state_equal(reference, records, [[0, 1], [2, 3]])
    for record in records:  # each rank's own trunk layers are sharded, the layers outside the trunk are not
        assert record["sharded"] and set(record["sharded"]) <= set(TRUNK)
    assert sorted(set(records[0]["sharded"] + records[1]["sharded"])) == sorted(TRUNK)


def test_one_shard_equals_ddp():
    """pipelines=1: a one-rank mesh per stage; 1f1b with "fsdp" trains exactly as with "ddp" (and one device)."""
    common = {"devices": 2, "max_steps": STEPS, "batch_size": 16, "model": {"optimizer": "adam"}}
    runs = {}
    for data_parallel in ("ddp", "fsdp"):
        code, output, records = launch({**common, "strategy": {"schedule": "1f1b", "micro_batches": 4,
                                                                "data_parallel": data_parallel}}, timeout=240)
        assert code == 0, output[-3000:]
        runs[data_parallel] = records
    assert runs["fsdp"][0]["sharded"] and not runs["ddp"][0]["sharded"]
    ddp, fsdp = merged_state(runs["ddp"]), merged_state(runs["fsdp"])
    for key, value in ddp.items():
        torch.testing.assert_close(fsdp[key], value, rtol=1e-5, atol=1e-6, msg=key)
    reference = train({"max_steps": STEPS, "batch_size": 16, "model": {"optimizer": "adam"}})
    assert_state_equal(reference, runs["fsdp"], [[0, 1]])
