"""pipemare's and xpipe's live weights under autocast (issue 30): a forward's graph keeps the bfloat16 cast of
each weight it used, and autocast may cache that cast across forwards; still a backward must read the weights
the storage holds when it runs, and a forward the ones it holds then, as in float32.
(tests/unit/test_emulation_mode.py::test_bf16_mixed_equals_reference checks whole runs against the reference.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.engine.policies import AsyncOptions, PipeMareOptions, PipeMarePolicy, live, saved_weights

BF16 = torch.bfloat16


MOVES = ["exchange", "redirect", "copy"]


def linear_stage(monkeypatch, moves: str) -> tuple[nn.Module, PipeMarePolicy]:
    """Two linear layers (an input gradient that depends on the weights alone) under pipemare without
    correction, on stage 0 of 2: F(0), F(1), B(0), STEP, F(2), B(1), ...; exchanging storages, redirecting the
    backwards (as on torch 2.11) or copying."""
    if moves != "exchange":
        monkeypatch.setattr(live, "exchanges_storage", lambda: False)
    monkeypatch.setattr(live._LivePolicy, "moves_values", "copy" if moves == "copy" else "auto")
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    policy = PipeMarePolicy(module, optimizer, 0, 2, 1, AsyncOptions(PipeMareOptions(correction=False)))
    assert policy.moves == moves
    return module, policy


def backward(policy: PipeMarePolicy, g: int, y: torch.Tensor) -> None:
    with policy.backward(g):
        y.backward(torch.ones_like(y))
    policy.finished(g)


def fresh(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of a new forward and backward under autocast on the weights the module holds."""
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        y = module(x)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad


@pytest.mark.parametrize("moves", MOVES)
def test_a_backward_under_autocast_reads_the_weights_the_storage_holds_when_it_runs(moves, monkeypatch):
    module, policy = linear_stage(monkeypatch, moves)
    x = [torch.randn(5, 4, requires_grad=True) for _ in range(2)]
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        y = []
        for g in range(2):
            with policy.forward(g):
                y.append(module(x[g]))
    _, on_forward_weights = fresh(module, x[1])
    backward(policy, 0, y[0])
    policy.step()  # B(1) runs one STEP after F(1), on the stepped weights
    with policy.backward(1):
        y[1].backward(torch.ones_like(y[1]))
        _, on_backward_weights = fresh(module, x[1])
    assert torch.equal(x[1].grad, on_backward_weights)
    assert not torch.equal(x[1].grad, on_forward_weights)  # what the casts F(1) saved would have given


@pytest.mark.parametrize("moves", MOVES)
def test_a_forward_does_not_reuse_a_cast_autocast_cached_for_an_earlier_one(moves, monkeypatch):
    module, policy = linear_stage(monkeypatch, moves)
    x = torch.randn(5, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):  # torch's default caches a parameter's cast for the whole region
        with policy.forward(0):
            first = module(x)
        with policy.forward(1):
            module(x)
        backward(policy, 0, first)
        policy.step()
        with policy.forward(2):
            third = module(x)
    want, _ = fresh(module, x)
    assert torch.equal(third.detach(), want)
    assert not torch.equal(third, first)


def test_without_autocast_the_forward_saves_its_tensors_as_they_are(monkeypatch):
    """Where storages are exchanged, the hooks run under autocast only (a redirecting policy needs them always)."""
    module, policy = linear_stage(monkeypatch, "exchange")
    packed = []
    monkeypatch.setattr(saved_weights.BackwardWeights, "_pack", lambda self, saved: packed.append(saved) or saved)
    with policy.forward(0):
        module(torch.randn(5, 4, requires_grad=True))
    assert not packed
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False), policy.forward(1):
        module(torch.randn(5, 4, requires_grad=True))
    assert packed


class TransposedTie(nn.Module):
    """A layer that uses its weight transposed as well (a tied output layer written as ``weight.t()``)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        return nn.functional.linear(nn.functional.linear(x, self.weight.t()), self.weight)


def test_a_parameter_cast_after_another_operation_is_named_once(monkeypatch):
    torch.manual_seed(0)
    module = TransposedTie()
    policy = PipeMarePolicy(module, torch.optim.SGD(module.parameters(), lr=1.0), 0, 2, 1,
                            AsyncOptions(PipeMareOptions(correction=False)))
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        with pytest.warns(UserWarning, match="casts parameter 'weight' after another operation"):
            with policy.forward(0):
                module(torch.randn(5, 4, requires_grad=True))
        with policy.forward(1):  # said once
            module(torch.randn(5, 4, requires_grad=True))
