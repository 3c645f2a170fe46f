"""Random numbers a step draws before the trunk are drawn alike by every stage (engine.random_state): mixup's weight and
permutation mix the inputs on the first stage and the labels on the last. Shown on a pipeline emulated in one process,
where the stages run the step one after the other from one generator; tests/distributed/test_strategy.py shows it for
separate processes."""

from __future__ import annotations

import random

import lightning as L
import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.engine.random_state import StepSeeds, derive_seed, layers_seed


class MixupNet(L.LightningModule):
    """Mixup in the step (torch, NumPy and Python draws before the trunk), dropout between alike trunk layers."""

    def __init__(self, dropout: float = 0.3):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(8, 16)
        self.model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh(), nn.Dropout(dropout))])
        self.head = nn.Linear(16, 4)
        self.draws: dict[float, list[tuple]] = {}  # micro-batch (its first input) -> the draws of every run of its step
        self.masks: dict[float, list[torch.Tensor]] = {}  # micro-batch -> the dropout masks of its trunk, in layer order
        for layer in self.model:
            if isinstance(layer, nn.Dropout):
                layer.register_forward_hook(self._note_mask)
        self.key = 0.0

    def _note_mask(self, layer, inputs, output):
        self.masks.setdefault(self.key, []).append(output == 0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.key = float(x[0, 0])
        lam, order = float(numpy.random.beta(0.4, 0.4)), torch.randperm(len(x))
        self.draws.setdefault(self.key, []).append((lam, order.tolist(), random.random()))
        logits = self.head(self.model(torch.relu(self.pre(lam * x + (1 - lam) * x[order]))))
        return lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[order])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(schedule: str, stages: int = 2) -> MixupNet:
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    model = MixupNet()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=PipeStrategy(schedule=schedule, stages=stages, micro_batches=4))
    trainer.fit(model, data)
    return model


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_first_and_the_last_stage_draw_the_same_mixup_for_each_micro_batch(schedule):
    """Before, the last stage ran the step after the first stage's forward and dropout had drawn more numbers: it mixed
    the labels with another weight and permutation than the first stage mixed the inputs, and trained on that."""
    model = fit(schedule)
    assert len(model.draws) == 16  # 4 batches of 4 micro-batches
    for runs in model.draws.values():
        assert len(runs) == 2 and runs[0] == runs[1]  # the first stage's run of the step, then the last's
    assert len({runs[0][0] for runs in model.draws.values()}) == 16  # and each micro-batch its own


def test_alike_layers_of_two_stages_draw_their_own_dropout_masks():
    """The stages start each micro-batch's step from one seed; their own layers then draw from seeds of their own, so
    stage 1's first dropout does not repeat stage 0's first one."""
    model = fit("1f1b")
    for masks in model.masks.values():
        assert len(masks) == 4
        assert not torch.equal(masks[0], masks[2]) and not torch.equal(masks[1], masks[3])


def test_with_dropout_the_synchronous_schedules_train_the_same_weights():
    """A micro-batch's random numbers depend on its seed, not on when a schedule runs it (the weights differ by the order
    of the gradient sums only)."""
    one, other = fit("1f1b").state_dict(), fit("gpipe").state_dict()
    for key, value in one.items():
        torch.testing.assert_close(other[key], value, rtol=1e-5, atol=1e-6, msg=key)  # summation order only


def test_after_any_micro_batch_the_generators_start_from_the_steps_seed():
    """So what runs between steps draws alike on every stage, whichever micro-batch a stage ran last."""
    micro_batches = [object(), object()]
    seeds = StepSeeds(7, micro_batches)
    after = []
    for micro_batch in micro_batches:
        with seeds.running(seeds.of(micro_batch)):
            inside = torch.rand(2), numpy.random.rand(), random.random()
        after.append((torch.rand(2), numpy.random.rand(), random.random()))
    with seeds.running(seeds.of(micro_batches[1])):
        assert torch.equal(torch.rand(2), inside[0]) and numpy.random.rand() == inside[1] and random.random() == inside[2]
    assert torch.equal(after[0][0], after[1][0]) and after[0][1:] == after[1][1:]
    state = torch.get_rng_state()
    with seeds.running(seeds.of(object())):  # not this step's: left alone
        pass
    assert torch.equal(torch.get_rng_state(), state)


def test_a_step_seeds_each_of_its_micro_batches_by_position_and_nothing_else():
    micro_batches = [torch.zeros(2), torch.zeros(2)]
    seeds = StepSeeds(7, micro_batches)
    assert seeds.of(micro_batches[0]) != seeds.of(micro_batches[1])
    assert seeds.of(micro_batches[1]) == derive_seed(7, 1)
    assert seeds.of(torch.zeros(2)) is None  # an equal tensor of another step is not this step's micro-batch
    first = seeds.of(micro_batches[0])
    assert layers_seed(first, 0) != layers_seed(first, 1) != first and layers_seed(None, 0) is None
