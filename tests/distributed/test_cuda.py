"""The GPU path: every schedule on 2 CUDA devices (NCCL) computes what the same job computes on the
CPU (gloo), checkpoints resume exactly, and mixed precision trains. Skipped without 2 CUDA devices;
on a GPU machine: ``python -m pytest -m cuda tests/distributed -q`` (docs/faq.md)."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.registry import names
from tests.harness.launch import launch
from tests.harness.lightning_run import train

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

BATCH, MICRO = 16, 4
SCHEDULES = {name: {"micro_batches": MICRO} for name in names()}
SCHEDULES["interleaved_1f1b"]["chunks_per_stage"] = 2
SCHEDULES["pipemare"]["pipemare"] = {"lr_warmup_steps": 5}
SCHEDULES["avgpipe"]["avgpipe"] = {"parallel_pipelines": 2, "advance_forward": 1}
#: what each stage owns in TrunkModel split in two (the other stage's copies are stale by design)
OWNERS = (("pre.", "model.0.", "model.2.", "model.4."), ("model.6.", "model.8.", "model.10.", "head."))


def job(schedule: str, accelerator: str, **extra) -> list[dict]:
    config = {"devices": 2, "accelerator": accelerator, "batch_size": BATCH, "epochs": 2,
              "strategy": {"schedule": schedule, **SCHEDULES[schedule]}, "model": {"optimizer": "adam"}, **extra}
    code, output, records = launch(config, timeout=300, fresh=True)
    assert code == 0, output[-3000:]
    return records


def assert_same_training(got: list[dict], want: list[dict], tol: float = 1e-4) -> None:
    for a, b, prefixes in zip(got, want, OWNERS):
        for key, value in b["state"].items():
            if key.startswith(prefixes):
                torch.testing.assert_close(a["state"][key].cpu(), value.cpu(), rtol=tol, atol=tol / 10, msg=key)
        assert [m["train_loss"] for m in a["metrics"]] == pytest.approx([m["train_loss"] for m in b["metrics"]], rel=tol)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_on_two_gpus_computes_what_it_computes_on_the_cpu(schedule):
    """NCCL's transport (untagged, one order per channel) and device placement change no number
    beyond float rounding; the synchronous schedules also equal one device."""
    on_gpus = job(schedule, "cuda")
    assert_same_training(on_gpus, job(schedule, "cpu"))
    if schedule in names("synchronous"):
        one_device = train({"batch_size": BATCH, "epochs": 2, "model": {"optimizer": "adam"}})
        assert_same_training(on_gpus, [one_device, one_device])


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream_2bw", "pipemare", "xpipe"])
def test_a_checkpoint_on_gpus_resumes_like_an_uninterrupted_run(schedule, tmp_path):
    whole = job(schedule, "cuda")
    ckpt = str(tmp_path / "epoch1.ckpt")
    job(schedule, "cuda", epochs=1, ckpt_out=ckpt)
    resumed = job(schedule, "cuda", ckpt_path=ckpt)
    for a, b, prefixes in zip(whole, resumed, OWNERS):
        for key, value in a["state"].items():
            if key.startswith(prefixes):
                torch.testing.assert_close(b["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("schedule", ["1f1b", "pipemare"])
def test_mixed_precision_trains_on_gpus(schedule, precision):
    records = job(schedule, "cuda", trainer={"precision": precision})
    losses = [m["train_loss"] for m in records[0]["metrics"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
