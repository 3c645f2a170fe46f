"""SIGTERM to the job's process group (a preemption) ends every rank within the timeout with one
sentence, writing the checkpoints the callbacks ask for (issue 29): with Lightning's own handler, a
job with OnExceptionCheckpoint hung, its checkpoint unwritten."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness.faults import Outcome, run, sigterm_cases, startup_sigterm_cases

BASE = {"devices": 2, "max_steps": 6, "batch_size": 16, "strategy": {"schedule": "1f1b", "timeout": 10.0}}
CASES = {case.name: case for case in sigterm_cases(BASE)}
STARTUP_CASES = {case.name: case for case in startup_sigterm_cases(BASE)}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, case, 150.0) for name, case in {**CASES, **STARTUP_CASES}.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_sigterm_stops_every_rank_and_writes_what_is_asked(outcomes, name):
    case, outcome = CASES[name], outcomes[name]
    assert outcome.code == 0, outcome.output[-3000:]  # Lightning's stop on SIGTERM exits 0
    assert outcome.orphans == [] and outcome.named, outcome.output[-3000:]
    if case.written is not None:
        assert outcome.checkpoint_ok, outcome.output[-3000:]
    else:
        assert "no checkpoint was written, as no callback saves on an exception" in outcome.output


@pytest.mark.parametrize("name", list(STARTUP_CASES))
def test_sigterm_during_startup_ends_every_rank_at_once(outcomes, name):
    outcome = outcomes[name]
    assert outcome.code == 128 + 15, outcome.output[-3000:]  # nothing to save yet: the signal's own exit status
    assert outcome.orphans == [] and outcome.named, outcome.output[-3000:]
    assert outcome.seconds is not None and outcome.seconds < 10, outcome.output[-3000:]
    assert "Traceback" not in outcome.output, outcome.output[-3000:]
