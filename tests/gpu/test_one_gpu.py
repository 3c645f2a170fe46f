"""The one-GPU checks (issue 30): every schedule through the one-device emulation on CUDA computes what
it computes on the CPU, mixed precision trains through a synchronous and an asynchronous schedule, and
under bf16-mixed the schedules whose backwards read live weights compute their reference's rule.

Skipped without CUDA. On a GPU machine: ``PYTHONPATH=. python -m pytest tests/gpu -q``. Its Python may
lack jsonargparse and hypothesis: nothing here, in tests/conftest.py or in tests/harness/lightning_run.py
imports them (tests/unit/test_gpu_path.py checks it).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from lightning_pipe.engine.policies.saved_weights import BackwardWeights
from lightning_pipe.errors import PipeConfigError
from lightning_pipe.registry import names
from tests.harness.benchmark_scripts import load_benchmark
from tests.harness.lightning_run import train
from tests.reference.async_cases import emulated, reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BATCH, STEPS = 16, 8
EMULATED = list(names())
OPTIONS = {"interleaved_1f1b": {"chunks_per_stage": 2}, "pipemare": {"pipemare": {"lr_warmup_steps": 5}},
           "avgpipe": {"avgpipe": {"parallel_pipelines": 2, "advance_forward": 1}}}


def run(accelerator: str, schedule: str | None, precision: str | None = "32-true", **extra) -> dict:
    """``STEPS`` steps of the harness's model, Adam, on one device; emulated 2 stages unless ``schedule`` is None."""
    strategy = None if schedule is None else {"schedule": schedule, "stages": 2, "micro_batches": 4,
                                              **OPTIONS.get(schedule, {})}
    config = {"accelerator": accelerator, "devices": 1, "max_steps": STEPS, "epochs": 2, "batch_size": BATCH,
              "model": {"optimizer": "adam"}, "trainer": {"precision": precision} if precision else {}, **extra}
    if strategy is not None:
        config["strategy"] = strategy
    return train(config)


def losses(record: dict) -> list[float]:
    return [m["train_loss"] for m in record["metrics"]]


def assert_same(got: dict, want: dict, tol: float) -> None:
    assert losses(got) == pytest.approx(losses(want), rel=tol, abs=tol)
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key].cpu(), value.cpu(), rtol=tol, atol=tol / 10, msg=key)


@pytest.mark.parametrize("schedule", EMULATED)
def test_every_schedule_emulated_on_cuda_computes_what_it_computes_on_the_cpu(schedule):
    """fp32: the device changes no number beyond float rounding (measured: 1.1e-7 on an H100)."""
    assert_same(run("cuda", schedule), run("cpu", schedule), tol=1e-4)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_synchronous_schedule_on_cuda_equals_plain_lightning_on_cuda(schedule):
    assert_same(run("cuda", schedule), run("cuda", None), tol=1e-4)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream_2bw"])
def test_bf16_mixed_trains(schedule):
    got = run("cuda", schedule, "bf16-mixed")
    assert all(math.isfinite(v) for v in losses(got))
    if schedule == "1f1b":  # synchronous: plain Lightning's numbers, up to bf16's rounding of micro-batch sums
        assert losses(got) == pytest.approx(losses(run("cuda", None, "bf16-mixed")), rel=5e-2)


@pytest.mark.parametrize("schedule", ["pipemare", "xpipe"])
def test_bf16_mixed_live_schedules_compute_their_reference_rule_on_cuda(schedule, monkeypatch):
    """Under bf16-mixed, pipemare's and xpipe's backwards read the weights their policy gives them when they run,
    not the bfloat16 casts (or, redirected, the weights) their forwards saved (engine/policies/saved_weights.py):
    on CUDA, with the kernels and fused weight arithmetic of a GPU, the final weights are the reference's (bit for
    bit on the CPU, tests/unit/test_emulation_mode.py), and ten times closer to them than the same run without
    the saved-tensor hooks, which reads what the forwards saved (3.4e-4 away on the CPU, exchanging or
    redirecting as torch 2.11 does)."""
    def weight_error(run: dict) -> float:
        return max(float((run["state"][key].cpu() - value.cpu()).abs().max()) for key, value in want_state.items())

    want_losses, want_state = reference(schedule, 4, 2, None, None, autocast=torch.bfloat16, device="cuda")
    got = emulated(schedule, 4, 2, accelerator="cuda", trainer={"precision": "bf16-mixed"})
    monkeypatch.setattr(BackwardWeights, "hooks", lambda self: contextlib.nullcontext())  # what the forwards saved
    stashed = emulated(schedule, 4, 2, accelerator="cuda", trainer={"precision": "bf16-mixed"})
    assert losses(got) == pytest.approx(want_losses, rel=1e-5)
    assert weight_error(stashed) > 1e-4  # what the rule changes, seen on this device
    assert weight_error(got) < weight_error(stashed) / 10


def test_fp16_mixed_trains_through_1f1b_with_loss_scaling_as_on_one_device():
    """One GradScaler for the emulated stages; an inf in the last stage's gradient at step 2 skips that step
    and halves the scale, as plain Lightning does."""
    overflow = {"model": {"optimizer": "adam", "overflow": {"param": "head.weight", "step": 2}}}
    got, want = run("cuda", "1f1b", "16-mixed", **overflow), run("cuda", None, "16-mixed", **overflow)
    assert got["scales"] == want["scales"] and got["scales"][2] == got["scales"][1] / 2
    assert losses(got) == pytest.approx(losses(want), rel=5e-3)


def test_fp16_mixed_is_refused_with_an_asynchronous_schedule():
    """Its weight policy steps inside the pipeline and cannot skip an overflowed step on every stage."""
    with pytest.raises(PipeConfigError, match="bf16-mixed"):
        run("cuda", "pipedream_2bw", "16-mixed")


def test_the_gpu_benchmark_runs_tiny_and_counts_host_syncs():
    """benchmarks/gpu.py on the GPU with the tiny model: every row timed, peak memory, host syncs and the allocator's
    calls to the driver counted."""
    benchmark = load_benchmark("gpu")
    rows = benchmark.main(["--device", "cuda", "--tiny", "--variants", "plain", "accumulation", "1f1b", "zbv"])
    assert [r.variant for r in rows] == ["plain", "accumulation", "1f1b", "zbv"]
    for row in rows:
        assert math.isfinite(row.ms_per_step) and row.peak_gib > 0 and row.syncs_per_step is not None
        assert set(row.allocator) == {"device_alloc", "device_free", "alloc_retries", "sync_all_streams"}
        assert all(count >= 0 for count in row.allocator.values())
    plain = rows[0].syncs_per_step
    for row in rows[2:]:  # issue 30's bound: plain Lightning's + 3 (measured: 0 against plain's 0.5)
        assert row.syncs_per_step <= plain + 3, (row.variant, row.sync_sites)
