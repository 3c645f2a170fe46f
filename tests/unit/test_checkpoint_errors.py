"""Checkpoint errors name the file and the cause (issue 29): a truncated or corrupted file is a
:class:`CheckpointFileError` (not fsspec's bare ``OSError: [Errno 22]``), and a checkpoint with other
layer sizes the same :class:`CheckpointMismatchError` as missing keys, listing the mismatched keys
(not torch's raw ``size mismatch``)."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from torch import nn

from lightning_pipe.errors import CheckpointFileError, CheckpointMismatchError
from lightning_pipe.lightning.checkpointing import load_module_state, read
from tests.harness.lightning_run import train

EMULATED = {"devices": 1, "strategy": {"schedule": "1f1b", "stages": 2}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt") / "good.ckpt")
    train({**EMULATED, "max_steps": 1, "ckpt_out": path})
    return path


def truncated(source: str, target: str) -> str:
    with open(source, "rb") as f:
        data = f.read()
    with open(target, "wb") as f:
        f.write(data[: len(data) // 2])
    return target


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_an_unreadable_file_is_named_with_its_cause(checkpoint, tmp_path, damage):
    path = str(tmp_path / f"{damage}.ckpt")
    if damage == "truncated":
        truncated(checkpoint, path)
    else:
        with open(path, "wb") as f:
            f.write(os.urandom(4096) if damage == "garbage" else b"")
    with pytest.raises(CheckpointFileError) as error:
        read(TorchCheckpointIO(), path)
    message = str(error.value)
    assert message.startswith(f"cannot read the checkpoint {path} (") and "truncated or corrupted" in message, message


def test_fit_from_a_truncated_checkpoint_names_the_file(checkpoint, tmp_path):
    path = truncated(checkpoint, str(tmp_path / "cut.ckpt"))
    with pytest.raises(CheckpointFileError, match="cannot read the checkpoint .*cut.ckpt"):
        train({**EMULATED, "max_steps": 2, "ckpt_path": path})


def test_other_layer_sizes_list_the_mismatched_keys():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    state = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1)).state_dict()
    with pytest.raises(CheckpointMismatchError) as error:
        load_module_state(model, state, None, strict=True)
    assert ("mismatched shapes [0.weight: checkpoint (4, 2), model (3, 2), 0.bias: checkpoint (4,), model (3,), "
            "1.weight: checkpoint (1, 4), model (1, 3)] (3)") in str(error.value)
    with pytest.raises(CheckpointMismatchError):  # strict=False cannot load other sizes either
        load_module_state(model, state, None, strict=False)
    torch.testing.assert_close(model[0].weight.shape, torch.Size([3, 2]))


def test_fit_from_a_checkpoint_of_other_layer_sizes_names_the_file_and_keys(checkpoint):
    with pytest.raises(CheckpointMismatchError, match=r"good.ckpt: the checkpoint does not match the model: mismatched shapes "
                                                      r"\[pre.weight: checkpoint \(16, 8\), model \(12, 8\)"):
        train({**EMULATED, "max_steps": 2, "ckpt_path": checkpoint, "model": {"width": 12}})
