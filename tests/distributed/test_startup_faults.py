"""Start-up faults end every process of the job within ``startup_timeout``, with no orphan and one
sentence that names the fault (issue 29): the port taken by another process, listening or not (the
launcher's child rank used to be left waiting on the store for an hour), and a rank whose rank 0
never comes, as torchrun would start it (its store connection used to retry for an hour), and a rank 0
that hangs while it profiles for ``balance="auto"``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness.faults import Outcome, auto_balance_hang_case, run, startup_cases

STARTUP_TIMEOUT = 5.0
BASE = {"devices": 2, "max_steps": 2, "batch_size": 16, "strategy": {"schedule": "1f1b", "timeout": 10.0}}
AUTO_HANG = auto_balance_hang_case(BASE)
CASES = {case.name: case for case in [*startup_cases(BASE, STARTUP_TIMEOUT), AUTO_HANG]}
LIMIT = 150.0  # the hard bound of each job: start-up under load, then startup_timeout


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, case, LIMIT) for name, case in CASES.items()}
        return {name: future.result() for name, future in futures.items()}


def ended_with(outcome: Outcome, *words: str) -> None:
    assert outcome.code not in (0, "hung"), outcome.output[-3000:]
    assert outcome.orphans == [], outcome
    assert outcome.sentence is not None and outcome.sentence.startswith("StartupFailure: "), outcome.output[-3000:]
    for word in words:
        assert word in outcome.sentence, outcome.sentence


@pytest.mark.parametrize("holder", ["listening", "bound"])
def test_a_taken_port_fails_at_once_and_ends_the_started_ranks(outcomes, holder):
    name = "MASTER_PORT taken by a listening process" if holder == "listening" else "MASTER_PORT taken by a non-listening socket"
    outcome = outcomes[name]
    ended_with(outcome, "rank 0 cannot open the job's key-value store at 127.0.0.1:", "the port is taken")
    assert "ended the 1 rank(s) this process started" in outcome.output


@pytest.mark.parametrize("holder", ["nothing", "another program"])
def test_a_rank_whose_rank_0_never_comes_gives_up_after_startup_timeout(outcomes, holder):
    name = next(n for n in CASES if n.startswith("a lone rank 1") and holder in n)
    expected = "nothing listens there" if holder == "nothing" else "does not answer as the store"
    ended_with(outcome := outcomes[name], "rank 1 waited startup_timeout=5 s for rank 0's key-value store at 127.0.0.1:",
               expected)
    assert "3600000ms" not in outcome.output


def test_a_rank_0_hung_in_the_balance_auto_profile_is_named_within_startup_timeout(outcomes):
    outcome = outcomes[AUTO_HANG.name]
    assert outcome.code not in (0, "hung") and outcome.orphans == [], outcome.output[-3000:]
    assert "rank 1 waited startup_timeout=60 s for rank 0's balance='auto' plan" in outcome.output, outcome.output[-3000:]
    assert "Raise PipeStrategy(startup_timeout=...)" in outcome.output
    assert outcome.seconds is not None and outcome.seconds < 60 + 30, outcome
