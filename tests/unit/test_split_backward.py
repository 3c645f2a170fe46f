"""The split backward (engine/split_backward.py): I then W computes bit for bit what one backward does,
W alone touches the weights, and graphs it cannot split fall back to the whole backward in I."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe.engine.split_backward import backward_input
from lightning_pipe.engine.stage import run_layers


class Tied(nn.Module):
    """One linear layer used twice, around another: two boundary nodes in one weight group, one below the other."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(torch.tanh(self.b(torch.tanh(self.a(x)))))


class TwoInputs(nn.Module):
    """A tuple input with an integer tensor (no gradient) and an unused parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, pair):
        x, flag = pair
        return self.linear(x) * (1 + flag.unsqueeze(1))


class Recomputed(nn.Module):
    """Activation recomputation (non-reentrant checkpoint): still exact, though every pass recomputes, which is
    why the strategy refuses it with the zero-bubble schedules."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))

    def forward(self, x):
        return run_layers(self.layers, x, recompute=True)


def _input(model: nn.Module, x: torch.Tensor):
    if isinstance(model, TwoInputs):
        return (x.clone().requires_grad_(), (x.sum(1) > 0).long())
    return x.clone().requires_grad_()


MODELS = {
    "mlp": lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8)),
    "transformer": lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
    "tied": Tied,
    "tuple input": TwoInputs,
    "recomputed": Recomputed,
}


@pytest.mark.parametrize("one_task", [False, True], ids=["a task per group", "one task"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_input_then_weight_equals_one_backward_bit_for_bit(name, one_task):
    """``one_task``: W's calls inside one autograd task, as on an accelerator (forced here on the CPU)."""
    torch.manual_seed(0)
    whole = MODELS[name]()
    split = copy.deepcopy(whole)
    x = torch.randn(3, 5, 8) if name == "transformer" else torch.randn(5, 8)
    for micro_batch in range(2):  # the second accumulates into .grad
        ins = _input(whole, x + micro_batch)
        out = whole(ins)
        grad = torch.randn_like(out)
        out.backward(grad)
        ins_split = _input(split, x + micro_batch)
        out_split = split(ins_split)
        leaf = ins_split[0] if isinstance(ins_split, tuple) else ins_split
        before = [None if p.grad is None else p.grad.clone() for p in split.parameters()]
        (dx,), deferred = backward_input([out_split], [grad], [leaf])
        after_input = [None if p.grad is None else p.grad.clone() for p in split.parameters()]
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before, after_input)), "I touched weights"
        assert deferred is not None
        deferred.run(one_task)
        want = (ins[0] if isinstance(ins, tuple) else ins).grad
        assert torch.equal(dx, want)
        for (key, p), q in zip(whole.named_parameters(), split.parameters()):
            assert (p.grad is None) == (q.grad is None), key
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), key


def test_a_weight_that_reaches_the_output_around_the_input_falls_back_to_one_backward():
    torch.manual_seed(0)
    linear, bias = nn.Linear(4, 4), nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    outputs = [linear(x), bias * 2]  # the second output does not depend on the input
    grads = [torch.ones(3, 4), torch.ones(4)]
    (dx,), deferred = backward_input(outputs, grads, [x])
    assert deferred is None  # the whole backward ran
    assert torch.equal(bias.grad, torch.full((4,), 2.0))
    assert linear.weight.grad is not None and torch.equal(dx, x.grad)


def test_a_weight_group_with_no_gradient_is_left_alone():
    torch.manual_seed(0)
    model = TwoInputs()
    x = torch.randn(2, 8, requires_grad=True)
    flag = torch.zeros(2, dtype=torch.long)
    out = model((x, flag))
    (_,), deferred = backward_input([out], [torch.zeros_like(out)], [x])
    deferred.run()
    assert model.unused.weight.grad is None
    assert torch.equal(model.linear.weight.grad, torch.zeros_like(model.linear.weight))
