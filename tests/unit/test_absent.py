"""Stand-ins for parameters outside the trunk on the stages that never use them."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.engine.stand_ins import is_absent, move_stand_ins, release, replace_outside, runs_outside_code


def test_which_ranks_run_the_code_outside_the_trunk():
    assert runs_outside_code([0], 4, looped=False) and runs_outside_code([3], 4, looped=False)
    assert not runs_outside_code([1], 4, looped=False) and not runs_outside_code([2], 4, looped=False)
    assert runs_outside_code([1], 4, looped=True)  # a looped trunk's code before the loop runs on every stage
    assert runs_outside_code([0, 7], 8, looped=False) and not runs_outside_code([1, 6], 8, looped=False)  # zbv's V


def test_a_stand_in_keeps_keys_shapes_and_ties_with_one_element_of_memory():
    model = nn.Sequential(nn.Embedding(1000, 64), nn.BatchNorm1d(64), nn.Linear(64, 1000))
    model[2].weight = model[0].weight  # tied, as an LM head
    keys = {k: v.shape for k, v in model.state_dict().items()}
    names = replace_outside(model, ["0.weight", "1.weight", "1.running_mean", "2.bias"])
    assert set(names) == {"0.weight", "2.weight", "1.weight", "1.running_mean", "2.bias"}  # the tie's alias too
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    assert model[2].weight is model[0].weight and isinstance(model[0].weight, nn.Parameter)
    assert model[0].weight.untyped_storage().nbytes() == 4 and is_absent(model[1].running_mean)
    assert not is_absent(model[1].bias)
    weight = model[0].weight
    move_stand_ins(model, torch.device("cpu"))  # where they are: nothing to do (a GPU's move is not tested here)
    assert model[0].weight is weight and is_absent(model[1].running_mean)


def test_release_turns_parameters_into_stand_ins_in_place():
    """After the first step a rank gives back what another stage trains: the same parameter objects
    (the optimizer's, a tie's) now hold one element, and an optimizer step leaves them alone."""
    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.Linear(64, 1000))
    model[2].weight = model[0].weight  # tied, as an LM head
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weight, keys = model[0].weight, {k: v.shape for k, v in model.state_dict().items()}
    assert release(model, ["2.weight", "2.bias"]) == ["0.weight", "2.weight", "2.bias"]  # the tie's alias too
    assert model[0].weight is weight and model[2].weight is weight and is_absent(model[2].bias)
    assert weight.untyped_storage().nbytes() == 4 and weight.grad is None
    assert {k: v.shape for k, v in model.state_dict().items()} == keys and not is_absent(model[1].weight)
    model[1](torch.randn(2, 64)).sum().backward()
    optimizer.step()  # the released parameters have no gradient: skipped, no state made for them
    assert set(optimizer.state) == {model[1].weight, model[1].bias}
