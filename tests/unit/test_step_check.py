"""A step that uses the trunk in a way stages cannot split stops at the first training step instead of
training another model (lightning_pipe/partition/step_check.py); what can be split is left alone and
equals one device. The looped trunk's loops are in tests/unit/test_looped_trunks.py."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.errors import TrunkUsageError
from lightning_pipe.partition.step_check import StepCheck
from tests.harness.lightning_run import Losses


class Penalized(L.LightningModule):
    """A Sequential trunk between two outside layers; ``penalty`` adds an L2 term over ``"every"`` parameter (the
    trunk's included), over the ``"outside"`` layers only, or none."""

    def __init__(self, penalty: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.penalty = penalty
        self.pre, self.head = nn.Linear(10, 16), nn.Linear(16, 3)
        self.trunk = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])

    def forward(self, x):
        return self.head(self.trunk(self.pre(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.penalty is not None:
            params = self.parameters() if self.penalty == "every" else [*self.pre.parameters(), *self.head.parameters()]
            loss = loss + 1e-2 * sum(p.pow(2).sum() for p in params)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model: L.LightningModule, strategy: PipeStrategy | None) -> tuple[list[float], dict]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 10, generator=g), torch.randint(0, 3, (64,), generator=g))
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
                        use_distributed_sampler=False, **({"strategy": strategy} if strategy else {}))
    trainer.fit(model, DataLoader(data, batch_size=16))
    return losses.losses, model.state_dict()


@pytest.mark.parametrize("schedule", ["1f1b", "pipemare"])
def test_a_penalty_over_every_parameter_is_refused(schedule):
    """Each stage holds its own trunk layers: the term would cover one stage's (emulated on one device: every
    stage's, unlike the real pipeline), so the first step stops and names the parameters."""
    with pytest.raises(TrunkUsageError, match=r"uses parameters of trunk outside its call \(trunk\.\d\.0\.bias, .* "
                                              r"and \d+ more\), e\.g\. an L2 penalty.*weight_decay"):
        fit(Penalized("every"), PipeStrategy(schedule=schedule, stages=2, micro_batches=2))


def assert_pipelined_equals_one_device(make: Callable[[], L.LightningModule]) -> None:
    """Losses and final weights of 1f1b on 2 emulated stages against one device."""
    want = fit(make(), None)
    got = fit(make(), PipeStrategy(schedule="1f1b", stages=2, micro_batches=2))
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for key, value in want[1].items():
        torch.testing.assert_close(got[1][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_penalty_over_the_layers_outside_the_trunk_equals_one_device():
    assert_pipelined_equals_one_device(lambda: Penalized("outside"))


def test_a_check_marks_only_what_records_a_graph_and_stops_at_the_chunks_outputs():
    """Marked views of tensors that record a graph (a tuple's too); a parameter reached only through what the
    chunk's layers returned is not a use outside the trunk, one reached beside it is."""
    check = StepCheck()
    received = (torch.ones(2, requires_grad=True), torch.ones(2), 3)
    marked = check.mark(received, 0)
    assert marked[0] is not received[0] and marked[1] is received[1] and marked[2] == 3
    layer = nn.Linear(2, 2)
    out = layer(torch.ones(2))
    check.note_chunk_output(out)
    check.verify(out.sum(), "trunk", {id(p): n for n, p in layer.named_parameters()})  # through the layer: fine
    with pytest.raises(TrunkUsageError, match=r"uses parameters of trunk outside its call \(trunk\.weight\)"):
        check.verify(out.sum() + layer.weight.sum(), "trunk", {id(p): n for n, p in layer.named_parameters()})
    with pytest.raises(TrunkUsageError, match=r"reads the output of trunk\[0\] again"):
        check.verify(marked[0] * 2, "trunk", {})


class TwoCalls(Penalized):
    """Calls the model twice per step: on a second view of the batch (``"siamese"``), or again on the same input
    (``"again"``, e.g. for a logged accuracy)."""

    def __init__(self, calls: str) -> None:
        super().__init__(None)
        self.calls = calls

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        second = self(x.flip(0)) if self.calls == "siamese" else self(x)
        loss = F.cross_entropy(logits, y) + 0.5 * F.cross_entropy(second, y.flip(0) if self.calls == "siamese" else y)
        self.log("train_loss", loss)
        return loss


def test_a_second_call_of_the_trunk_on_another_input_is_refused():
    """Only the first call's activation travels between the stages: the last stage would run its layers on it again
    for the second input, so the step stops and says to concatenate the inputs."""
    with pytest.raises(TrunkUsageError, match=r"trunk was called twice in one step on different inputs.*torch\.cat"):
        fit(TwoCalls("siamese"), PipeStrategy(schedule="1f1b", stages=2, micro_batches=2))


def test_a_second_call_on_the_same_input_equals_one_device():
    assert_pipelined_equals_one_device(lambda: TwoCalls("again"))


class InputGradientPenalty(Penalized):
    """Penalises the gradient of the loss with respect to the inputs (double backpropagation)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x.clone().requires_grad_(True)
        loss = F.cross_entropy(self(x), y)
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        return loss + grad.pow(2).sum()


def test_a_gradient_with_respect_to_the_inputs_is_refused_with_the_reason():
    """torch's own message ('The differentiated Tensor ... appears to not have been used in the graph') said nothing of
    the pipeline: the last stage's step starts its graph at the received activation."""
    with pytest.raises(TrunkUsageError, match=r"the step differentiates with respect to a tensor from before trunk .* "
                                              r"cannot be taken inside a pipelined step"):
        fit(InputGradientPenalty(None), PipeStrategy(schedule="1f1b", stages=2, micro_batches=2))
