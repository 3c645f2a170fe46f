"""Bad configurations fail early with one sentence that says what to change; a rank that fails ends
the others with its error. Every job here must fail, so each runs in fresh processes (how a real job
ends is the point); they start side by side, as they mostly wait for one another."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.harness.launch import launch

JOBS: dict[str, dict[str, Any]] = {
    "micro_batches": {"devices": 2, "max_steps": 2, "batch_size": 4, "strategy": {"micro_batches": 8}},
    "no_trunk": {"devices": 2, "max_steps": 2, "strategy": {"module": "head"}},
    "devices": {"devices": 3, "max_steps": 2, "strategy": {"stages": 2}},
    **{f"hook{rank}": {"devices": 2, "max_steps": 4, "strategy": {"schedule": "1f1b", "timeout": 60},
                       "model": {"fail_hook": "on_train_start", "fail_rank": rank}} for rank in (0, 1)},
    **{f"stage{rank}": {"devices": 2, "max_steps": 5, "model": {"fail_at": 2, "fail_rank": rank}, "strategy": {"timeout": 60}}
       for rank in (0, 1)},
}


@pytest.fixture(scope="module")
def jobs() -> dict[str, tuple[int, str, list]]:
    """``launch(..., fresh=True)`` of every job above, three at a time."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(launch, config, 120, fresh=True) for name, config in JOBS.items()}
        return {name: future.result() for name, future in futures.items()}


def test_micro_batches_larger_than_batch_fails_before_launching(jobs):
    code, output, _ = jobs["micro_batches"]
    assert code != 0
    assert "micro_batches=8 is larger than the batch size 4; use micro_batches <= 4" in output
    assert "Initializing distributed" not in output and output.count("Traceback") == 1


def test_a_model_error_fails_before_any_other_rank_starts(jobs):
    """A trunk that is not an nn.Sequential: one error from the launching process, no rank started."""
    code, output, _ = jobs["no_trunk"]
    assert code != 0 and "head is a Linear, not an nn.Sequential" in output
    assert "Initializing distributed" not in output and output.count("Traceback") == 1


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_rank_failing_in_a_hook_ends_every_rank_with_peer_failure(jobs, fail_rank):
    """A user hook (on_train_start) raising on one rank: the other ends with PeerFailure naming it."""
    code, output, _ = jobs[f"hook{fail_rank}"]
    assert code != 0
    assert "ZeroDivisionError: deliberate failure in on_train_start" in output
    assert "PeerFailure: " in output and f"rank {fail_rank} raised ZeroDivisionError" in output
    assert "Connection closed by peer" not in output.split("PeerFailure")[0][-2000:]


def test_devices_mismatch_fails_before_launching(jobs):
    code, output, _ = jobs["devices"]
    assert code != 0
    assert "set devices=2 or change stages/pipelines" in output
    assert "Initializing distributed" not in output


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_stage_ends_every_rank_with_its_error(jobs, fail_rank):
    code, output, records = jobs[f"stage{fail_rank}"]
    assert code not in (0, -9), "the job must fail, and well before the test's own timeout"
    assert records == []
    assert "ZeroDivisionError: deliberate failure at batch 2" in output
    if fail_rank == 1:  # rank 0 (the launcher) learns the peer's error instead of 'connection closed'
        assert "PeerFailure: rank 0 stopped waiting for" in output and "rank 1 raised ZeroDivisionError" in output
