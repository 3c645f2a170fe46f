"""descent_ratio's trial updates (lightning_pipe.engine.descent): each is the optimizer's real step, and leaves
nothing of it behind."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe.engine.descent import descent_ratio, trial_update
from lightning_pipe.optim import CombinedOptimizer


def _optimizers(model: nn.Sequential) -> dict[str, torch.optim.Optimizer]:
    return {
        "adamw": torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1),
        "sgd-momentum": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "muon+adamw": CombinedOptimizer(torch.optim.Muon([model[0].weight], lr=0.02),
                                        torch.optim.AdamW([model[0].bias, *model[1].parameters()], lr=0.01)),
    }


def _backward(model: nn.Sequential, seed: int) -> None:
    model.zero_grad()
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()


def _equal(a, b) -> bool:  # noqa: ANN001
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum", "muon+adamw"])
def test_a_trial_update_is_the_real_step_and_leaves_nothing_behind(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = _optimizers(model)[name]
    for seed in range(2):  # a state to start from
        _backward(model, seed)
        optimizer.step()
    _backward(model, 2)
    params = list(model.parameters())
    gradient = [p.grad.clone() for p in params]
    values, state, versions = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), [p._version for p in params]

    update = trial_update(optimizer, params[:2], gradient[:2], scale=3.0)  # the first layer only, 3 × its gradient

    assert _equal(model.state_dict(), values) and _equal(optimizer.state_dict(), state)
    assert all(p.grad is not None and torch.equal(p.grad, g) for p, g in zip(params, gradient))
    assert [p._version for p in params] == versions  # no graph in flight would see a change
    params[2].grad = params[3].grad = None
    for p, g in zip(params[:2], gradient[:2]):
        p.grad = 3.0 * g
    optimizer.step()
    assert all(torch.equal(u, p.detach() - values[k]) for u, p, k in zip(update, params[:2], values))


def test_the_same_gradient_keeps_all_its_descent():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _backward(model, 0)
    gradient = [p.grad.clone() for p in model.parameters()]
    assert float(descent_ratio(optimizer, list(model.parameters()), gradient, gradient, 1.0)) == pytest.approx(1.0)
    assert descent_ratio(optimizer, list(model.parameters()), gradient, [None] * 4, 1.0) is None
