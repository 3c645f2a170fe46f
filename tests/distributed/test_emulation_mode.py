"""One-device emulation against real 2-process runs: the same numbers, and checkpoints that move
between them (tests/unit/test_emulation_mode.py checks the emulation against the references)."""

from __future__ import annotations

import pytest
import torch

from tests.harness.launch import launch
from tests.harness.lightning_run import train
from tests.reference.async_cases import (
    BATCH,
    EPOCHS,
    OPTIONS,
    emulated,
    reference_from_checkpoint,
    run_epochs,
)


def test_a_two_process_checkpoint_resumes_emulated_as_four_stages(tmp_path):
    """2 processes -> one process emulating 4 stages: the merged policy state carries over, and the run
    continues exactly as the reference started from the checkpoint says."""
    from tests.harness.launch import launch

    ckpt = str(tmp_path / "two-processes.ckpt")
    code, output, _ = launch({"devices": 2, "epochs": 1, "batch_size": BATCH, "ckpt_out": ckpt,
                              "strategy": {"schedule": "pipemare", "micro_batches": 2, **OPTIONS}})
    assert code == 0, output[-3000:]
    resumed = emulated("pipemare", 4, 2, ckpt_path=ckpt)
    reference, model = reference_from_checkpoint("pipemare", 4, ckpt)
    assert [m["train_loss"] for m in resumed["metrics"]] == pytest.approx(run_epochs(reference, [], None, 2, 1), rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_two_process_sharded_checkpoint_resumes_emulated_as_four_stages(tmp_path):
    """The same with save_distributed_checkpoint=True: each of the 2 ranks wrote its own parameters'
    velocity, and the one process emulating 4 stages reads every stage's entries by name."""
    from lightning_pipe import consolidate_checkpoint

    sharded = {"save_distributed_checkpoint": True}
    ckpt = tmp_path / "two-processes.ckpt"
    code, output, _ = launch({"devices": 2, "epochs": 1, "batch_size": BATCH, "ckpt_out": str(ckpt),
                              "strategy": {"schedule": "pipemare", "micro_batches": 2, **OPTIONS, **sharded}})
    assert code == 0, output[-3000:]
    resumed = emulated("pipemare", 4, 2, ckpt_path=str(ckpt), strategy=sharded)
    consolidate_checkpoint(ckpt, tmp_path / "one.ckpt")
    reference, model = reference_from_checkpoint("pipemare", 4, str(tmp_path / "one.ckpt"))
    assert [m["train_loss"] for m in resumed["metrics"]] == pytest.approx(run_epochs(reference, [], None, 2, 1), rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_emulation_equals_distributed_run():
    """The 2-process run and the emulation log the same losses, weights and per-stage diagnostics."""
    config = {"epochs": EPOCHS, "batch_size": BATCH, "model": {"scheduler": "step"},
              "trainer": {"gradient_clip_val": 0.5, "log_every_n_steps": 1},
              "strategy": {"schedule": "pipemare", "micro_batches": 4, **OPTIONS}}
    code, output, records = launch({**config, "devices": 2})
    assert code == 0, output[-3000:]
    got = train({**config, "strategy": {**config["strategy"], "stages": 2}})
    want = records[0]
    assert len(got["metrics"]) == len(want["metrics"])
    timing = ("compute_ms", "wait_ms", "bubble", "peak_memory_mib")  # the processes' own, not the computation's
    for mine, theirs in zip(got["metrics"], want["metrics"]):
        assert set(theirs) - set(mine) == {f"pipe/stage{s}/{key}" for s in range(2) for key in timing}
        for key in mine:
            # weight_lag is a norm of a difference of nearly equal weights: the two runs' last-digit rounding
            # differences (1e-7 of the weights) are percents of it
            rel = 0.1 if key.endswith("/weight_lag") else 1e-5
            assert mine[key] == pytest.approx(theirs[key], rel=rel, abs=1e-7), key
    owners = (("pre.", "model.0.", "model.2.", "model.4."), ("model.6.", "model.8.", "model.10.", "head."))
    for record, prefixes in zip(records, owners):
        for key, value in got["state"].items():
            if key.startswith(prefixes):
                torch.testing.assert_close(value, record["state"][key], rtol=1e-5, atol=1e-6, msg=key)
