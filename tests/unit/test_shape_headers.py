"""Shape headers only when shapes change: sender and receiver agree without a message, a short last
micro-batch gets its header, data-dependent shapes are refused with the option that allows them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.engine import SequentialStage, split_micro_batches
from lightning_pipe.engine.local import LocalPipeline, LocalTransport
from lightning_pipe.engine.p2p import Header, ShapeCache, signature
from lightning_pipe.errors import StageOutputError
from lightning_pipe.registry import build_schedule


def test_sender_and_receiver_decide_alike():
    sender, receiver = ShapeCache(), ShapeCache()
    parts = split_micro_batches((torch.zeros(14, 3), [1, 2]), 4)  # 4, 4, 3, 3 samples
    decisions = [(sender.needs_header("link", mb), receiver.needs_header("link", mb)) for mb in parts]
    assert decisions == [(True, True), (False, False), (True, True), (False, False)]
    assert receiver.header("link") is None  # announced, not read yet: no payload can be posted
    receiver.remember("link", Header.of(torch.zeros(4, 5)))
    assert receiver.header("link") is None  # the second header (3 samples) is still unread
    receiver.remember("link", Header.of(torch.zeros(3, 5)))
    assert receiver.header("link") == Header.of(torch.zeros(3, 5))
    receiver.reset()
    assert receiver.needs_header("link", parts[0])
    assert ShapeCache(always=True).needs_header("link", parts[0])
    assert signature((torch.zeros(2), 7, None)) == (((2,), torch.float32), 7, None)


def emulated_headers(batch_rows: int, micro_batches: int, always: bool = False, model: nn.Module | None = None):
    """Run 2 steps of 1F1B on a 3-stage in-process pipeline; count activation messages with a header."""
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    pipeline = LocalPipeline(3, shape_headers="always" if always else "on_change")
    parts = [model[0:2], model[2:4], model[4:5]]
    pipeline.chunks = [SequentialStage(parts[0], input_fn=lambda mb: mb[0]), SequentialStage(parts[1]),
                       SequentialStage(parts[2], loss_fn=lambda out, mb: nn.functional.mse_loss(out, mb[1]))]
    counted = []
    original = LocalTransport.send_activation

    def counting(self, value, dst, lane=0, header=True, micro_batch=-1):
        counted.append(header)
        return original(self, value, dst, lane, header, micro_batch)

    LocalTransport.send_activation = counting
    try:
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            batch = (torch.randn(batch_rows, 4, generator=g), torch.randn(batch_rows, 2, generator=g))
            pipeline.run(build_schedule("1f1b", 3, micro_batches), split_micro_batches(batch, micro_batches))
    finally:
        LocalTransport.send_activation = original
    return counted


def test_one_header_per_link_and_step_when_shapes_repeat():
    counted = emulated_headers(16, 4)
    assert len(counted) == 2 * 2 * 4 and sum(counted) == 2 * 2  # 2 steps, 2 links, 4 activations each
    assert sum(emulated_headers(16, 4, always=True)) == 16


def test_a_short_last_micro_batch_gets_its_header():
    assert sum(emulated_headers(14, 4)) == 2 * 2 * 2  # 4, 4, 3, 3 samples: headers before the 1st and 3rd


class DropsRows(nn.Module):
    """Output rows depend on the data: the shapes change though the inputs' do not."""

    def forward(self, x):
        return x[x[:, 0] > 0]


class MeanOut(nn.Module):
    """A last stage whose output keeps the targets' shape whatever the rows it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x).mean(dim=0, keepdim=True).expand(4, 2)


def test_data_dependent_shapes_ask_for_always():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), DropsRows(), nn.Linear(4, 4), nn.Tanh(), MeanOut())

    with pytest.raises(StageOutputError, match='shape_headers="always"'):
        emulated_headers(16, 4, model=model())
    assert sum(emulated_headers(16, 4, always=True, model=model())) == 16


def test_the_strategy_passes_always_to_every_emulated_stage():
    """Through Lightning: the data-dependent model trains with shape_headers="always" (emulation, 3 stages)."""
    import lightning as L

    from lightning_pipe import PipeStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.trunk = nn.Sequential(nn.Linear(4, 4), DropsRows(), nn.Linear(4, 4), nn.Tanh(), MeanOut())

        def training_step(self, batch, _):
            return nn.functional.mse_loss(self.trunk(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer = L.Trainer(strategy=PipeStrategy(schedule="1f1b", stages=3, micro_batches=4, balance=[2, 2, 1],
                                              shape_headers="always"),
                        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), loader)
    assert trainer.global_step == 2


@pytest.mark.parametrize("value", [
    torch.zeros(2, 3),
    (torch.zeros(2, 3), torch.ones(2, dtype=torch.long)),
    (torch.zeros(2, 3), (torch.ones(1, 2, 3), torch.ones(1, 2, 3))),  # nn.LSTM's (output, (h, c))
    (torch.zeros(2, 3), None),  # a block's (hidden, attention weights) without the weights
    [torch.zeros(2), [None, (torch.ones(3),)]],
])
def test_a_header_carries_the_structure_of_nested_stage_outputs(value):
    header = Header.decode(Header.of(value).encode(torch.device("cpu")))
    rebuilt = header.rebuild([torch.full(meta.shape, 7.0, dtype=meta.dtype) for meta in header.metas])

    def shape_of(item):  # lists arrive as tuples
        if isinstance(item, (tuple, list)):
            return tuple(shape_of(entry) for entry in item)
        return None if item is None else (tuple(item.shape), item.dtype)

    assert shape_of(rebuilt) == shape_of(value)


@pytest.mark.parametrize("value,match", [
    ((torch.zeros(2), "text"), r"returned a tuple holding str"),
    ((None, None), r"returned a tuple without tensors"),
    ({"hidden": torch.zeros(2)}, r"returned dict"),
])
def test_a_stage_output_that_cannot_cross_a_boundary_is_named(value, match):
    pipeline = LocalPipeline(2)
    pipeline.chunks = [lambda inputs, micro_batch: value,  # noqa: ARG005 - a first stage returning ``value``
                       SequentialStage(nn.Identity(), loss_fn=lambda out, mb: out.sum())]
    with pytest.raises(StageOutputError, match=match):
        pipeline.run(build_schedule("gpipe", 2, 1), [torch.zeros(2, 3)])
