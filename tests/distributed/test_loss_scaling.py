"""fp16 loss scaling across processes (issue 30, hazard 1): every stage skips an overflowed step together.

The GradScaler is ``torch.amp.GradScaler("cpu")`` (Lightning's ``precision="16-mixed"`` on the CPU).
One stage's gradient is made inf at one step; without the all-reduced found-inf flag (see
lightning_pipe/lightning/loss_scaling.py) the other stage would step and the scales would diverge.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_strategy import merged_state
from tests.harness.launch import launch
from tests.harness.lightning_run import train

OVERFLOW_STEP = 1
COMMON = {"max_steps": 4, "batch_size": 16, "fp16_cpu": True,
          "model": {"overflow": {"param": "head.weight", "step": OVERFLOW_STEP}}}


def test_one_stage_overflows_and_every_stage_skips():
    reference = train(COMMON)
    initial = reference["scales"][0]  # 2**16, unchanged by step 0; the overflow at step 1 halves it, once
    assert reference["scales"] == [initial, initial / 2, initial / 2, initial / 2]
    code, output, records = launch({**COMMON, "devices": 2, "strategy": {"schedule": "1f1b", "micro_batches": 4}})
    assert code == 0, output[-3000:]
    for record in records:  # both scalers saw the overflow of stage 1, and updated alike
        assert record["scales"] == reference["scales"]
    state = merged_state(records)
    for key, value in reference["state"].items():  # fp16 sums of micro-batches differ in the last bits only
        torch.testing.assert_close(state[key], value, rtol=2e-3, atol=2e-4, msg=key)



@pytest.mark.parametrize("schedule", ["pipedream_2bw"])
def test_an_asynchronous_schedule_refuses_fp16_loss_scaling(schedule):
    from lightning_pipe.errors import PipeConfigError

    with pytest.raises(PipeConfigError, match="bf16-mixed"):
        train({**COMMON, "strategy": {"schedule": schedule, "stages": 2, "micro_batches": 4}})


def test_one_replica_overflows_and_every_rank_of_every_pipeline_skips():
    """2 pipelines × 2 stages: only pipeline 0's last stage (rank 1) overflows. The gradient average spreads
    the inf to rank 3, never to the first stages: the all-reduced flag makes all four skip."""
    reference = train({**COMMON, "model": {"overflow": {"param": "head.weight", "step": OVERFLOW_STEP}}})
    code, output, records = launch({
        **COMMON, "devices": 4, "batch_size": 8, "stages": 2, "pipelines_in_sampler": 2,
        "model": {"overflow": {"param": "head.weight", "step": OVERFLOW_STEP, "rank": 1}},
        "strategy": {"schedule": "1f1b", "micro_batches": 2, "pipelines": 2},
    }, timeout=240)
    assert code == 0, output[-3000:]
    for record in records:
        assert record["scales"] == reference["scales"]
    for pipeline in ([0, 1], [2, 3]):
        state = merged_state([records[r] for r in pipeline])
        for key, value in reference["state"].items():
            torch.testing.assert_close(state[key], value, rtol=2e-3, atol=2e-4, msg=key)
