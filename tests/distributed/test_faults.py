"""Faults end every rank within the timeout, name the failed rank, leave no process behind and lose
no checkpoint (docs/failures.md; the table there comes from benchmarks/faults.py)."""

from __future__ import annotations

import pytest

from tests.harness.faults import Case, cases, run

TIMEOUT = 6.0  # PipeStrategy(timeout=...): short, so the hung cases end quickly
CASES = {case.name: case for case in cases(TIMEOUT)}


def ended_well(case: Case) -> None:
    outcome = run(case, limit=TIMEOUT * 6 + 120)
    assert outcome.code != "hung" and outcome.orphans == [], outcome
    if case.expect_success:
        assert outcome.code == 0, outcome
    else:
        assert outcome.code != 0 and outcome.named, outcome
        assert outcome.seconds is not None and outcome.seconds <= TIMEOUT + 10, outcome
    if case.checkpoint:
        assert outcome.checkpoint_ok, outcome


@pytest.mark.parametrize("name", ["rank 0 stopped (SIGSTOP)", "rank 1 stopped (SIGSTOP)"])
def test_a_stopped_rank_ends_the_whole_job(name):
    """Rank 0 stopped: the other rank's store checks do not hang on it; rank 1 stopped: it does not
    outlive the job. Both end within timeout + 10 s, naming the stopped rank."""
    ended_well(CASES[name])


def test_a_killed_rank_is_named_by_the_survivor():
    ended_well(CASES["rank 1 killed (SIGKILL)"])


def test_a_slow_save_with_a_short_timeout_still_writes_its_checkpoint():
    ended_well(next(case for name, case in CASES.items() if name.startswith("checkpoint save slower")))


def test_a_save_killed_half_way_is_cleaned_up_by_the_next():
    ended_well(CASES["rank 0 killed while saving, then the next job saves there"])
