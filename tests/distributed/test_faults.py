"""Faults end every rank within the timeout, name the failed rank, leave no process behind and lose
no checkpoint (docs/failures.md; the table there comes from benchmarks/faults.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness.faults import Case, Outcome, cases, run

TIMEOUT = 6.0  # PipeStrategy(timeout=...): short, so the hung cases end quickly
CASES = {case.name: case for case in cases(TIMEOUT)}
TESTED = ["rank 0 stopped (SIGSTOP)", "rank 1 stopped (SIGSTOP)", "rank 1 killed (SIGKILL)", "rank 1 killed (SIGKILL), over gloo",
          f"checkpoint save slower than timeout ({TIMEOUT * 1.5:.0f} s)", "rank 0 killed while saving, then the next job saves there"]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    """Every tested case's outcome. The jobs mostly wait (for timeouts, grace periods, a slow save), so
    two run side by side; their seconds are counted from each one's own fault."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, CASES[name], TIMEOUT * 6 + 120) for name in TESTED}
        return {name: future.result() for name, future in futures.items()}


def ended_well(case: Case, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[case.name]
    assert outcome.code != "hung" and outcome.orphans == [], outcome
    if case.expect_success:
        assert outcome.code == 0, outcome
    else:
        assert outcome.code != 0 and outcome.named, outcome
        assert outcome.seconds is not None and outcome.seconds <= TIMEOUT + 10, outcome
    if case.checkpoint:
        assert outcome.checkpoint_ok, outcome


@pytest.mark.parametrize("name", ["rank 0 stopped (SIGSTOP)", "rank 1 stopped (SIGSTOP)"])
def test_a_stopped_rank_ends_the_whole_job(name, outcomes):
    """Rank 0 stopped: the other rank's store checks do not hang on it; rank 1 stopped: it does not
    outlive the job. Both end within timeout + 10 s, naming the stopped rank."""
    ended_well(CASES[name], outcomes)


@pytest.mark.parametrize("name", ["rank 1 killed (SIGKILL)", "rank 1 killed (SIGKILL), over gloo"])
def test_a_killed_rank_is_named_by_the_survivor(name, outcomes):
    """Over shared memory (the default on one CPU host) the survivor sees the process gone; over gloo the
    connection close."""
    ended_well(CASES[name], outcomes)


def test_a_slow_save_with_a_short_timeout_still_writes_its_checkpoint(outcomes):
    ended_well(CASES[TESTED[4]], outcomes)


def test_a_save_killed_half_way_is_cleaned_up_by_the_next(outcomes):
    ended_well(CASES["rank 0 killed while saving, then the next job saves there"], outcomes)
