"""Asynchronous schedules through Lightning equal the one-process reference of their update rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.engine import split_micro_batches
from lightning_pipe.engine.policies import AsyncOptions, PipeMareOptions
from tests.distributed.test_strategy import merged_state
from tests.harness.launch import launch
from tests.harness.lightning_run import TrunkModel, make_data
from tests.reference.async_reference import AsyncEmulator

EPOCHS, BATCH, MICRO = 2, 16, 4
OPTIONS = {"pipemare": {"lr_warmup_steps": 5}}


def reference(schedule: str, clip: float, interval: str) -> tuple[list[float], dict]:
    """The emulator on the same module split (pre + first trunk half | second half + head)."""
    model = TrunkModel(scheduler=interval)
    half = len(model.model) // 2
    stages = [nn.Sequential(model.pre, nn.ReLU(), *model.model[:half]), nn.Sequential(*model.model[half:], model.head)]
    optimizers = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers]
    per_step = schedulers if interval == "step" else None  # epoch schedulers: stepped below, after the drain
    emulator = AsyncEmulator(schedule, stages, optimizers, MICRO, lambda mb: mb[0],
                             lambda out, mb: nn.functional.cross_entropy(out, mb[1]), AsyncOptions(PipeMareOptions(**OPTIONS["pipemare"])),
                             per_step, clip_val=clip)
    x, y = make_data().tensors
    losses = []
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            batch = (x[start:start + BATCH], y[start:start + BATCH])
            losses.append(sum(emulator.train_window(split_micro_batches(batch, MICRO))) / MICRO)
        emulator.drain()
        if interval == "epoch":
            for scheduler in schedulers:
                scheduler.step()
    return losses, model.state_dict()


@pytest.mark.parametrize(
    "schedule,interval", [("pipedream", "step"), ("pipedream_2bw", "epoch"), ("pipemare", "step"), ("xpipe", "epoch")]
)
def test_lightning_equals_reference(schedule, interval):
    """Losses per step, final weights, per-stage step-interval schedulers (or Lightning's epoch ones),
    stage-local clipping, drains at epoch ends, diagnostics."""
    clip = 0.5
    code, output, records = launch({
        "devices": 2, "epochs": EPOCHS, "batch_size": BATCH, "model": {"scheduler": interval},
        "trainer": {"gradient_clip_val": clip, "log_every_n_steps": 1},
        "strategy": {"schedule": schedule, "micro_batches": MICRO, **OPTIONS},
    })
    assert code == 0, output[-3000:]
    want_losses, want_state = reference(schedule, clip, interval)
    for record in records:
        assert [m["train_loss"] for m in record["metrics"]] == pytest.approx(want_losses, rel=1e-5)
        assert record["global_step"] == len(want_losses)
        assert "pipe/stage0/staleness" in record["metrics"][-1] and "pipe/stage1/weight_copies" in record["metrics"][-1]
    owners = (("pre.", "model.0.", "model.2.", "model.4."), ("model.6.", "model.8.", "model.10.", "head."))
    for record, prefixes in zip(records, owners):
        for key, value in want_state.items():
            if key.startswith(prefixes):
                torch.testing.assert_close(record["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    last_stage = records[1]["metrics"][-1]["pipe/stage1/staleness"]
    # the last stage is never stale, except under 2BW, where every gradient is one step stale
    assert 0.9 < last_stage < 1.0 if schedule == "pipedream_2bw" else last_stage == 0.0


@pytest.mark.parametrize("schedule", ["pipedream_2bw", "pipemare"])
def test_resume_continues_like_an_uninterrupted_run(schedule, tmp_path):
    """The checkpoint (taken at the epoch-end drain) carries 2BW's previous version and PipeMare's
    velocity, so resuming gives the uninterrupted run's numbers."""
    common = {"devices": 2, "batch_size": BATCH, "strategy": {"schedule": schedule, "micro_batches": MICRO, **OPTIONS}}
    code, output, whole = launch({**common, "epochs": 2})
    assert code == 0, output[-3000:]
    ckpt = str(tmp_path / "epoch1.ckpt")
    code, output, _ = launch({**common, "epochs": 1, "ckpt_out": ckpt})
    assert code == 0, output[-3000:]
    code, output, resumed = launch({**common, "epochs": 2, "ckpt_path": ckpt})
    assert code == 0, output[-3000:]
    owners = (("pre.", "model.0.", "model.2.", "model.4."), ("model.6.", "model.8.", "model.10.", "head."))
    for a, b, prefixes in zip(whole, resumed, owners):
        for key, value in a["state"].items():
            if key.startswith(prefixes):  # each stage's own parameters (the others' copies are stale by design)
                torch.testing.assert_close(b["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)
        assert [m["train_loss"] for m in b["metrics"]] == pytest.approx([m["train_loss"] for m in a["metrics"]][6:], rel=1e-6)


def test_async_rejects_gradient_accumulation():
    code, output, _ = launch({"devices": 2, "max_steps": 2, "trainer": {"accumulate_grad_batches": 2},
                              "strategy": {"schedule": "pipemare", "micro_batches": MICRO}})
    assert code != 0 and "accumulate_grad_batches=2 has no meaning" in output


def test_sync_warmup_epochs_switch_in_the_same_run():
    """Epoch 0 is 1f1b (equal to one device), epoch 1 is asynchronous (stage 0 becomes stale)."""
    from tests.harness.lightning_run import train

    one_device = train({"epochs": 1, "batch_size": BATCH})
    code, output, records = launch({"devices": 2, "epochs": 2, "batch_size": BATCH, "trainer": {"log_every_n_steps": 1},
                                    "strategy": {"schedule": "pipemare", "micro_batches": MICRO, "sync_warmup_epochs": 1}})
    assert code == 0, output[-3000:]
    losses = [m["train_loss"] for m in records[0]["metrics"]]
    assert losses[:6] == pytest.approx([m["train_loss"] for m in one_device["metrics"]], rel=1e-5)
    assert records[0]["metrics"][5]["pipe/stage0/staleness"] == 0.0  # the synchronous warm-up
    assert records[0]["metrics"][-1]["pipe/stage0/staleness"] > 0
    # the warm-up's first step gave back the head on stage 0 and the input layer on stage 1, before the
    # weight policies existed; the asynchronous epoch still equals the emulation, which keeps everything
    assert [r["absent"] for r in records] == [["head.bias", "head.weight"], ["pre.bias", "pre.weight"]]
    emulated = train({"epochs": 2, "batch_size": BATCH, "trainer": {"log_every_n_steps": 1},
                      "strategy": {"schedule": "pipemare", "micro_batches": MICRO, "sync_warmup_epochs": 1, "stages": 2}})
    assert losses == pytest.approx([m["train_loss"] for m in emulated["metrics"]], rel=1e-6)
    state = merged_state(records)
    for key, value in emulated["state"].items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_async_rejects_parameters_shared_across_stages():
    code, output, _ = launch({"devices": 2, "epochs": 1, "batch_size": BATCH, "model": {"tie": True},
                              "strategy": {"schedule": "pipedream", "micro_batches": MICRO}})
    assert code != 0 and "parameters pre.weight are used on several stages" in output
