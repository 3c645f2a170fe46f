"""The worker pool behind launch() and run_workers(): failures, hangs and crashes end in a new pool,
and the next request runs as if nothing had happened; no state leaks from one request to the next."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.harness.distributed import call_on_pool, run_workers, values
from tests.harness.launch import launch
from tests.harness.pool import Pool


def _where(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment

    import lightning_pipe

    return {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "package": lightning_pipe.__file__,
        "external": LightningEnvironment().creates_processes_externally, "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(), "leak": os.environ.get("LP_POOL_TEST_LEAK"), "cwd": os.getcwd(),
        "seed": os.environ.get("PL_GLOBAL_SEED"), "world_env": os.environ.get("WORLD_SIZE"),
    }


def _leave_state_behind(rank: int, world_size: int) -> int:
    import lightning as L

    os.environ["LP_POOL_TEST_LEAK"] = "1"
    L.seed_everything(3, verbose=False)
    del os.environ["WORLD_SIZE"]  # as Lightning's teardown does
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    os.chdir("/")
    return rank


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return rank


def _hang_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def _die_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def _rank_and_world(rank: int, world_size: int) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


@pytest.fixture(scope="module")
def light_pool():
    """A pool of its own: the failures below restart it, not the session's pool."""
    pool = Pool(2)
    pool.start()
    yield pool
    pool.close(grace=5.0)


def _normal_request_works(pool: Pool) -> None:
    assert call_on_pool(pool, _rank_and_world, timeout=60) == [("ok", (0, 2)), ("ok", (1, 2))]


def test_workers_are_an_external_job_of_this_checkout(tmp_path, monkeypatch):
    import lightning_pipe

    monkeypatch.chdir(tmp_path)
    got = values(run_workers(_where, 2, timeout=60))
    for rank, where in enumerate(got):
        assert where["rank"] == rank and where["world"] == 2 and where["external"]
        assert where["package"] == lightning_pipe.__file__  # this worktree's package, not another install
        assert where["cwd"] == str(tmp_path)


def test_no_state_leaks_into_the_next_request():
    values(run_workers(_leave_state_behind, 2, timeout=60))
    for where in values(run_workers(_where, 2, timeout=60)):
        assert where["leak"] is None and where["seed"] is None and where["world_env"] == "2"
        assert where["threads"] == 1 and where["dtype"] == torch.float32 and where["cwd"] == os.getcwd()


def test_an_error_on_one_rank_restarts_the_pool(light_pool):
    _normal_request_works(light_pool)
    starts = light_pool.starts
    results = call_on_pool(light_pool, _fail_on_rank_1, timeout=60)
    assert results[0] == ("ok", 0)
    assert results[1][0] == "error" and "ValueError: deliberate failure on rank 1" in results[1][1]
    assert light_pool.starts == starts + 1
    _normal_request_works(light_pool)


def test_a_hung_request_times_out_and_the_next_one_runs(light_pool, capsys):
    _normal_request_works(light_pool)  # the pool is up: time only the request
    starts = light_pool.starts
    results = call_on_pool(light_pool, _hang_on_rank_1, timeout=3)
    assert results == [("ok", 0), ("timeout", None)]  # the deadline ended it: rank 1 sleeps for 10 minutes
    assert "in _hang_on_rank_1" in capsys.readouterr().out  # the hung rank's stack, written before the kill
    assert light_pool.starts == starts + 1
    _normal_request_works(light_pool)


def test_a_dead_worker_is_reported_with_its_exit_code(light_pool):
    results = call_on_pool(light_pool, _die_on_rank_1, timeout=60)
    assert results[0] == ("ok", 0) and results[1] == ("crashed", 3)
    _normal_request_works(light_pool)


def test_lightning_jobs_failing_or_hung_on_the_pool_return_what_a_fresh_job_returns():
    code, output, records = launch({"devices": 2, "max_steps": 2, "batch_size": 4, "strategy": {"micro_batches": 8}})
    assert code not in (0, -9) and records == [], output[-3000:]
    assert "micro_batches=8 is larger than the batch size 4; use micro_batches <= 4" in output
    code, output, records = launch({"devices": 2, "epochs": 10_000}, timeout=3)  # killed mid-run
    assert code == -9 and records == [], output[-3000:]
    assert "still running shortly before the 3 s timeout; stacks:" in output  # written before the kill
    code, output, records = launch({"devices": 2, "max_steps": 2})
    assert code == 0, output[-3000:]
    assert [r["rank"] for r in records] == [0, 1] and records[0]["global_step"] == 2
