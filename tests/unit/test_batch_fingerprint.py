"""What the stages of a pipeline compare at the end of a step (engine.stage.batch_fingerprint): the integer tensors and
plain values of the batch each loaded, not its floating-point inputs (a random augmentation may differ harmlessly)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import UserDict

import torch

from lightning_pipe.engine.stage import batch_fingerprint


def test_labels_that_differ_in_value_or_position_change_the_fingerprint():
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 3])
    same = batch_fingerprint((x, y))
    assert batch_fingerprint((torch.randn(4, 3), y.clone())) == same  # other inputs (augmented), the same labels
    assert batch_fingerprint((x, torch.tensor([0, 1, 3, 2]))) != same  # the labels swapped between two samples
    assert batch_fingerprint((x, torch.tensor([0, 1, 2, 4]))) != same
    assert batch_fingerprint({"x": x}) is None  # nothing to compare


def test_texts_give_the_same_fingerprint_in_every_process():
    batch = {"ids": ["a", "b"], "n": 3}
    code = f"from lightning_pipe.engine.stage import batch_fingerprint; print(batch_fingerprint({batch!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(batch_fingerprint(batch)) != "None"  # Python's str hashes differ between processes


def test_labels_inside_a_user_dict_or_a_dataclass_are_compared():
    """Hugging Face's BatchEncoding (a UserDict) and a dataclass batch were one opaque leaf to torch's pytree: their
    labels went unchecked."""
    ids = torch.tensor([[1, 2], [3, 4]])
    encoded = batch_fingerprint(UserDict({"input_ids": ids, "attention_mask": torch.ones(2, 2)}))
    assert encoded is not None and encoded != batch_fingerprint(UserDict({"input_ids": ids.flip(0)}))
    assert encoded == batch_fingerprint({"input_ids": ids})

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    assert batch_fingerprint(Batch(torch.randn(2, 3), ids[0])) == batch_fingerprint(Batch(torch.randn(2, 3), ids[0]))
    assert batch_fingerprint(Batch(torch.randn(2, 3), ids[0])) != batch_fingerprint(Batch(torch.randn(2, 3), ids[1]))
