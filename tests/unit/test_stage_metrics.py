"""Per-stage metrics (docs/metrics.md): every schedule logs each stage's compute, wait, bubble and
peak memory on the steps Lightning logs, and measures nothing on the others."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_pipe import PipeStrategy
from lightning_pipe.engine import Executor, SequentialStage, split_micro_batches
from lightning_pipe.engine.recorder import StepTimer
from lightning_pipe.registry import build_schedule
from tests.harness.lightning_run import train

TIMING = ("compute_ms", "wait_ms", "bubble", "peak_memory_mib")


def test_step_timer_totals_one_devices_step():
    layers = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    timer = StepTimer(torch.device("cpu"))
    executor = Executor(0, [0], [SequentialStage(layers, input_fn=lambda mb: mb, loss_fn=lambda out, mb: out.mean())],
                        recorder=timer)
    batch = split_micro_batches(torch.randn(16, 8), 4)
    executor.run(build_schedule("1f1b", 1, 4), batch)
    assert timer.totals().compute == 0.0  # not enabled: nothing recorded
    timer.enabled = True
    executor.run(build_schedule("1f1b", 1, 4), batch)
    times = timer.totals()
    assert times.compute > 0 and times.wait == 0 and times.span >= times.compute


def test_a_one_stage_run_logs_its_stage_on_logged_steps_only(monkeypatch):
    """log_every_n_steps=3 over 6 steps: measured on steps 3 and 6, untimed on the other four."""
    measured = []
    original = StepTimer.totals

    def counting(self):
        measured.append(True)
        return original(self)

    monkeypatch.setattr(StepTimer, "totals", counting)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*one-stage pipeline.*")
        record = train({"devices": 1, "max_steps": 6, "batch_size": 16, "strategy": {"schedule": "1f1b"},
                        "trainer": {"log_every_n_steps": 3}})
    assert len(measured) == 2
    last = record["metrics"][-1]
    assert last["pipe/stage0/compute_ms"] > 0 and last["pipe/stage0/wait_ms"] == 0
    assert 0 <= last["pipe/stage0/bubble"] < 1 and last["pipe/stage0/peak_memory_mib"] > 0


def test_stage_metrics_false_logs_nothing():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*one-stage pipeline.*")
        record = train({"devices": 1, "max_steps": 2, "batch_size": 16,
                        "strategy": {"schedule": "1f1b", "stage_metrics": False}, "trainer": {"log_every_n_steps": 1}})
    assert not any(key.startswith("pipe/") for key in record["metrics"][-1])


def test_an_emulated_pipeline_logs_its_policies_not_its_timing():
    record = train({"devices": 1, "max_steps": 2, "batch_size": 16, "trainer": {"log_every_n_steps": 1},
                    "strategy": {"schedule": "pipemare", "stages": 2, "micro_batches": 4}})
    last = record["metrics"][-1]
    assert {"pipe/stage0/staleness", "pipe/stage1/correction_norm"} <= set(last)
    assert not any(key.endswith(TIMING) for key in last)
    assert PipeStrategy(stage_metrics=False).options.stage_metrics is False


def test_one_pipeline_does_not_advise_sync_dist():
    """Lightning advises sync_dist=True for epoch-level values in distributed runs; with one pipeline
    every rank holds the replayed value already, so the advice would only mislead (docs/faq.md)."""
    from lightning.pytorch.trainer.connectors.logger_connector import result

    result.warning_cache.clear()  # Lightning warns once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train({"devices": 1, "max_steps": 2, "batch_size": 16, "evaluate": True,
               "strategy": {"schedule": "1f1b", "stages": 2}})
    assert not [w for w in caught if "sync_dist=True" in str(w.message)]


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "pipemare", "xpipe"])
def test_every_stale_schedule_logs_weight_lag_on_logged_steps_only(schedule, monkeypatch):
    """weight_lag = ||W_applied - W_used|| / ||W_applied|| per stage (docs/metrics.md): positive on stage 0, whose
    gradients are stale, and measured only while Lightning logs the step."""
    from lightning_pipe.engine.policies import base

    calls = []
    original = base.WeightPolicy._record_lag
    monkeypatch.setattr(base.WeightPolicy, "_record_lag", lambda self, lag: (calls.append(self.stage), original(self, lag)))
    record = train({"devices": 1, "max_steps": 6, "batch_size": 16, "model": {"optimizer": "sgd"},
                    "trainer": {"log_every_n_steps": 3}, "strategy": {"schedule": schedule, "stages": 2, "micro_batches": 4}})
    last = record["metrics"][-1]
    assert 0 < last["pipe/stage0/weight_lag"] < 1
    if schedule == "pipedream":  # the last stage's backward follows its forward before any STEP
        assert last["pipe/stage1/weight_lag"] == 0
    # logged steps 3 and 6, 4 backwards per stage each (pipemare: stage 1 is never stale, 0 without a pass)
    assert 0 < len(calls) <= 2 * 2 * 4 + 2 * 4  # the epoch's drain may add a stage's last backwards


def test_relative_distance():
    from lightning_pipe.engine.policies.base import relative_distance

    applied, used = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])], [torch.tensor([3.0, 1.0]), torch.tensor([4.0])]
    assert float(relative_distance(applied, used)) == pytest.approx(1 / 5)
    assert float(relative_distance(applied, applied)) == 0.0
