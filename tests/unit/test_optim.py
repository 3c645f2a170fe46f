"""CombinedOptimizer: several optimizers stepped as one, and resumed as one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe.optim import BasisRotationAdam, CombinedOptimizer


def model_and_optimizer() -> tuple[nn.Module, CombinedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return model, CombinedOptimizer(torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(x).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_steps_like_its_members_and_shares_their_groups_and_state():
    model, combined = model_and_optimizer()
    twin = copy.deepcopy(model)
    muon = torch.optim.Muon([p for p in twin.parameters() if p.ndim == 2], lr=0.02)
    adamw = torch.optim.AdamW([p for p in twin.parameters() if p.ndim != 2], lr=1e-2)
    train(model, combined, 3)
    for _ in range(3):
        twin(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
        muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert [id(g) for g in combined.param_groups] == [id(g) for o in combined.optimizers for g in o.param_groups]
    assert all(o.state is combined.state for o in combined.optimizers) and len(combined.state) == 6


def test_a_loaded_state_resumes_exactly():
    model, combined = model_and_optimizer()
    train(model, combined, 2)
    saved, weights = copy.deepcopy(combined.state_dict()), copy.deepcopy(model.state_dict())
    train(model, combined, 2)
    resumed, fresh = model_and_optimizer()
    resumed.load_state_dict(weights)
    fresh.load_state_dict(saved)
    assert all(o.state is fresh.state for o in fresh.optimizers)  # the members read the loaded state
    train(resumed, fresh, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


def test_a_parameter_in_two_members_is_refused():
    p = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="is in two of the combined optimizers"):
        CombinedOptimizer(torch.optim.SGD([p], lr=0.1), torch.optim.AdamW([p], lr=0.1))


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    return q


@pytest.mark.parametrize("frequency", [1, 3])
def test_basis_rotation_is_adam_in_the_gradients_eigenbasis(frequency):
    """Gradients U D_t Vᵀ with fixed orthogonal U, V and diagonal D_t: the bases find U and V, and each
    step is U (Adam's step on the diagonal) Vᵀ, also across refreshes (which reorder the second moments)."""
    u, v = random_orthogonal(5, 0), random_orthogonal(5, 1)
    weight = nn.Parameter(torch.zeros(5, 5, dtype=torch.float64))
    lr, (beta1, beta2), eps = 0.1, (0.9, 0.99), 1e-6  # eps keeps rounding noise off the diagonal (0/0) small
    optimizer = BasisRotationAdam([weight], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=0.0,
                                  precondition_frequency=frequency)
    g = torch.Generator().manual_seed(2)
    scale = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0], dtype=torch.float64)  # distinct, so the eigenbasis is unique
    m = s = torch.zeros(5, dtype=torch.float64)
    expected = torch.zeros(5, 5, dtype=torch.float64)
    for step in range(1, 8):
        d = scale * (1 + 0.1 * torch.rand(5, generator=g, dtype=torch.float64))  # the order stays
        weight.grad = u @ torch.diag(d) @ v.T
        optimizer.step()
        m, s = beta1 * m + (1 - beta1) * d, beta2 * s + (1 - beta2) * d * d
        step_size = lr * (1 - beta2**step) ** 0.5 / (1 - beta1**step)
        expected -= step_size * u @ torch.diag(m / (s.sqrt() + eps)) @ v.T
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-7, atol=1e-9)


def test_basis_rotation_refuses_what_is_not_a_matrix():
    with pytest.raises(ValueError, match="2-D weight matrices.*CombinedOptimizer"):
        BasisRotationAdam([nn.Parameter(torch.zeros(3))])
