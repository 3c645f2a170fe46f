"""Which modules outside the trunk ``data_parallel="fsdp"`` shards from the second step on (issue 33):
``OutsideParameters.only_this_stage_trains`` (the multi-process tests in tests/distributed/test_fsdp.py check the
training that follows)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.engine.outside import OutsideParameters
from lightning_pipe.engine.sharding import calls_recorded
from lightning_pipe.engine.topology import Topology


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4))  # a container: one unit for both
        self.trunk = nn.Sequential(nn.Linear(4, 4))
        self.norm = nn.LayerNorm(4)  # called, but its bias is trained by another stage too
        self.head = nn.Linear(4, 10)
        self.tied = nn.Linear(4, 10)
        self.tied.weight = self.head.weight  # the same parameter in two modules
        self.read = nn.Linear(4, 4)  # its weight read directly, never called
        self.scale = nn.Module()
        self.scale.value = nn.Parameter(torch.tensor(1.0))  # a scalar: FSDP2 cannot shard it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.trunk(self.embed(x)))
        return self.head(h @ self.read.weight) * self.scale.value


def test_the_called_modules_that_only_this_stage_trains_outermost_first():
    model = Model()
    outside = OutsideParameters(model, "trunk", Topology(2, 1, 0))
    with calls_recorded(outside.modules()) as called:
        model(torch.tensor([[1, 2]])).sum().backward()
    assert called == {"embed", "embed.0", "embed.1", "norm", "head"}
    outside.users = {name: [0] for name, p in model.named_parameters() if p.grad is not None and not outside.in_trunk(name)}
    outside.users["norm.bias"] = [0, 1]
    # embed is one unit (its layers inside it are not picked again); norm's bias is another stage's too; head's
    # weight is tied to another module; read is never called; scale is a scalar
    assert outside.only_this_stage_trains(called) == ["embed"]
    del outside.users["norm.bias"]
    assert outside.only_this_stage_trains(called) == ["embed"]  # a parameter no stage trained stays whole
    outside.users["norm.bias"] = [0]
    assert outside.only_this_stage_trains(called) == ["embed", "norm"]
    assert outside.only_this_stage_trains(called - {"embed"}) == ["norm", "embed.0", "embed.1"]
    assert OutsideParameters(model, "trunk", Topology(2, 1, 1)).only_this_stage_trains(called) == []  # users unknown


def test_the_recording_ends_with_the_block():
    model = Model()
    outside = OutsideParameters(model, "trunk", Topology(2, 1, 0))
    with calls_recorded(outside.modules()) as called:
        pass
    model(torch.tensor([[1]]))
    assert called == set()
    assert "trunk" not in outside.modules() and "trunk.0" not in outside.modules() and "" not in outside.modules()
