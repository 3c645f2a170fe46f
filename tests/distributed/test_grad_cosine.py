"""grad_cosine in a real 2-process run (tests/unit/test_grad_cosine.py checks it against a literal computation):
the same values as the one-process emulation, and the same weights as a run that does not measure."""

from __future__ import annotations

import pytest
import torch

from tests.harness.launch import launch
from tests.harness.lightning_run import train


def test_two_processes_log_what_the_emulation_logs_and_train_the_same_weights():
    config = {"max_steps": 4, "batch_size": 16, "trainer": {"log_every_n_steps": 2},
              "strategy": {"schedule": "pipedream", "micro_batches": 4, "grad_cosine_every": 2}}
    code, output, records = launch({**config, "devices": 2})
    assert code == 0, output[-3000:]
    emulated = train({**config, "devices": 1, "strategy": {**config["strategy"], "stages": 2}})
    got, want = records[0]["metrics"][-1], emulated["metrics"][-1]
    for s in range(2):
        assert got[f"pipe/stage{s}/grad_cosine"] == pytest.approx(want[f"pipe/stage{s}/grad_cosine"], abs=1e-5)
    code, output, plain = launch({**config, "devices": 2, "strategy": {**config["strategy"], "grad_cosine_every": 0}})
    assert code == 0, output[-3000:]
    for mine, theirs in zip(records, plain):
        assert theirs["state"] and all(torch.equal(mine["state"][k], theirs["state"][k]) for k in theirs["state"])
