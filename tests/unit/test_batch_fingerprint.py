"""What the stages of a pipeline compare at the end of a step (engine.stage.batch_fingerprint): the integer tensors and
plain values of the batch each loaded, not its floating-point inputs (a random augmentation may differ harmlessly)."""

from __future__ import annotations

import subprocess
import sys

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
