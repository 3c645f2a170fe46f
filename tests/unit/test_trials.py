"""Short runs of copies of a stage (lightning_pipe.trials): what balance='auto' refinement measures."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.engine import Watchdog
from lightning_pipe.planning.trials import measure_stage, stand_in_loss


def test_a_stage_is_measured_on_copies():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    before = [p.detach().clone() for p in layers.parameters()]
    seconds = measure_stage(layers, 0, 1, [0], None, Watchdog(10.0), "1f1b", 4, torch.randn(16, 8), torch.device("cpu"))
    assert 0 < seconds < float("inf")  # a time was measured (how long is the benchmarks' business)
    assert all(torch.equal(a, b) and p.grad is None for a, b, p in zip(before, layers.parameters(), layers.parameters()))


def test_the_stand_in_loss_is_the_mean_of_the_floating_outputs():
    x = torch.ones(2, 3, requires_grad=True)
    loss = stand_in_loss((x * 2, torch.zeros(2, dtype=torch.long)), None)
    assert loss.item() == 2.0 and loss.requires_grad
    assert stand_in_loss(torch.zeros(3, dtype=torch.long), None).item() == 0.0
