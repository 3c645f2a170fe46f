"""What the package says goes through the standard logger ``lightning_pipe``: filterable like any library's,
printed by default, and said once (by global rank 0) where every rank would repeat it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_pipe.lightning import auto, strategy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    # the package prints through a handler of its own when nothing configured logging; here pytest's handler listens
    monkeypatch.setattr(logging.getLogger("lightning_pipe"), "propagate", True)
    caplog.set_level(logging.INFO, logger="lightning_pipe")
    return caplog


def test_messages_come_from_the_lightning_pipe_logger_without_a_hand_written_prefix(records):
    strategy.rank_zero_info("1f1b, 2 stage(s)")
    auto.rank_zero_info("balance='auto' adopts")
    assert [(r.name, r.levelno, r.getMessage()) for r in records.records] == [
        ("lightning_pipe.lightning.strategy", logging.INFO, "1f1b, 2 stage(s)"),
        ("lightning_pipe.lightning.auto", logging.INFO, "balance='auto' adopts"),
    ]


def test_rank_zero_messages_stay_on_rank_zero(records, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    strategy.rank_zero_info("said by every rank")
    auto.rank_zero_info("said by every rank")
    assert not records.records


def test_printed_with_its_name_when_the_application_configures_no_logging():
    code = ("import logging, lightning_pipe; from lightning_pipe.lightning import strategy; strategy.rank_zero_info('hello'); "
            "logging.getLogger('lightning_pipe').setLevel(logging.WARNING); strategy.rank_zero_info('silenced')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("lightning_pipe:")]
    assert lines == ["lightning_pipe: hello"], done.stderr
