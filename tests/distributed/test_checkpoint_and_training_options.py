"""One ordinary checkpoint, resume in every direction, clipping, accumulation and tied weights."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_pipe.errors import CheckpointMismatchError
from tests.harness.launch import launch
from tests.harness.lightning_run import TrunkModel, make_data, train

PIPE = {"devices": 2, "strategy": {"schedule": "1f1b", "micro_batches": 4}}
CLIP = {"trainer": {"gradient_clip_val": 0.05}}  # SGD: Adam would hide wrong clipping


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_checkpoint_is_ordinary_and_resumes_exactly(tmp_path):
    ckpt = str(tmp_path / "pipe.ckpt")
    code, output, _ = launch({**PIPE, **CLIP, "epochs": 1, "ckpt_out": ckpt})
    assert code == 0, output[-3000:]

    # a plain one-device process loads it and predicts like the one-device run (global-norm clipping included)
    reference2 = train({**CLIP, "epochs": 1})
    loaded = TrunkModel.load_from_checkpoint(ckpt)
    assert_same_state(loaded.state_dict(), reference2["state"])
    x = make_data(10, seed=5).tensors[0]
    want = TrunkModel()
    want.load_state_dict(reference2["state"])
    torch.testing.assert_close(loaded(x), want(x), rtol=1e-5, atol=1e-6)
    raw = torch.load(ckpt, weights_only=True)  # nothing but tensors and plain containers
    assert len(raw["optimizer_states"][0]["state"]) == len(list(want.parameters()))

    # resume under the pipeline, and under one device, both equal the uninterrupted one-device run
    reference4 = train({**CLIP, "epochs": 2})
    code, output, records = launch({**PIPE, **CLIP, "epochs": 2, "ckpt_path": ckpt})
    assert code == 0, output[-3000:]
    for record, stage_keys in zip(records, (("model.0", "model.2", "pre."), ("model.6", "model.10", "head."))):
        for key, value in reference4["state"].items():
            if key.startswith(stage_keys):
                torch.testing.assert_close(record["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert record["global_step"] == reference4["global_step"] == 12
        assert record["metrics"][-1]["train_loss"] == pytest.approx(reference4["metrics"][-1]["train_loss"], rel=1e-5)
    single = train({**CLIP, "epochs": 2, "ckpt_path": ckpt})
    assert_same_state(single["state"], reference4["state"])


def test_one_device_checkpoint_resumes_under_the_pipeline(tmp_path):
    ckpt = str(tmp_path / "single.ckpt")
    train({"epochs": 1, "ckpt_out": ckpt})
    reference = train({"epochs": 2})
    out = str(tmp_path / "resumed.ckpt")
    code, output, _ = launch({**PIPE, "epochs": 2, "ckpt_path": ckpt, "ckpt_out": out})
    assert code == 0, output[-3000:]
    assert_same_state(torch.load(out, weights_only=True)["state_dict"], reference["state"])


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])  # zbv: the tied pair on one device (the V's ends), split backward
def test_tied_weights_accumulation_and_value_clipping_equal_one_device(tmp_path, schedule):
    config = {"max_steps": 3, "model": {"tie": True}, "trainer": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.01,
              "gradient_clip_algorithm": "value"}}
    reference = train(config)
    ckpt = str(tmp_path / "tied.ckpt")
    pipe = {**PIPE, "strategy": {**PIPE["strategy"], "schedule": schedule}}
    code, output, records = launch({**pipe, **config, "ckpt_out": ckpt})
    assert code == 0, output[-3000:]
    first, last = records
    if schedule != "zbv":  # (zbv runs both users of the tied weight on device 0)
        torch.testing.assert_close(first["state"]["pre.weight"], last["state"]["pre.weight"])  # both copies stay tied
    assert_same_state(torch.load(ckpt, weights_only=True)["state_dict"], reference["state"])


def test_checkpoint_of_another_model_names_the_keys(tmp_path):
    ckpt = str(tmp_path / "deep.ckpt")
    train({"max_steps": 1, "model": {"depth": 7}, "ckpt_out": ckpt})
    code, output, _ = launch({**PIPE, "max_steps": 2, "ckpt_path": ckpt})  # must fail (on the pool: a restart is a fork)
    assert code != 0
    assert "the checkpoint does not match the model: unexpected keys [model.12.weight, model.12.bias]" in output
    with pytest.raises(CheckpointMismatchError):
        from lightning_pipe.lightning.checkpointing import check_keys

        check_keys(["a"], ["b"])
    assert os.path.exists(ckpt)


def test_bf16_mixed_on_cpu_stays_close_to_one_device():
    config = {"max_steps": 4, "trainer": {"precision": "bf16-mixed"}}
    reference = train(config)
    code, output, records = launch({**PIPE, **config})
    assert code == 0, output[-3000:]
    got = [m["train_loss"] for m in records[0]["metrics"]]
    want = [m["train_loss"] for m in reference["metrics"]]
    assert got == pytest.approx(want, rel=2e-2)  # bf16 rounding differs with micro-batch shapes


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fp16_mixed_on_cuda_scales_each_micro_batch_loss():
    config = {"max_steps": 4, "trainer": {"precision": "16-mixed"}}
    code, output, records = launch({**PIPE, **config, "accelerator": "cuda"}, fresh=True)
    assert code == 0, output[-3000:]
    assert all(torch.isfinite(torch.tensor(m["train_loss"])) for m in records[0]["metrics"])


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_running_statistics_outside_the_trunk_are_saved_from_the_stage_that_computes_them(tmp_path, schedule):
    """BatchNorm without parameters before the trunk (the first stage computes it) and after it (the last stage): no
    parameter's gradient names the stage whose copy is right, and the checkpoint took both from stage 0, whose copy of
    the head's statistics never moved. Under zbv the last virtual stage, on rank 0, ran the step's code before the
    trunk again and updated the first one's statistics twice per micro-batch (the one-process emulation did so under
    every schedule). Now the stage that changed a buffer in the first step owns it, a later virtual stage's pass
    puts back what the code before the trunk updated, and the 2-process checkpoint equals the emulation's state."""
    ckpt = str(tmp_path / "pipe.ckpt")
    strategy = {"schedule": schedule, "micro_batches": 4}
    code, output, _ = launch({"devices": 2, "epochs": 1, "model": {"norms": True}, "strategy": strategy, "ckpt_out": ckpt})
    assert code == 0, output[-3000:]
    emulated = train({"epochs": 1, "model": {"norms": True}, "strategy": {**strategy, "stages": 2}})
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    assert_same_state(saved, emulated["state"])
    for norm in ("pre_norm", "head_norm"):
        assert int(saved[f"{norm}.num_batches_tracked"]) == 24  # 6 batches of 4 micro-batches, once each
