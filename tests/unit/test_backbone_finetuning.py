"""Lightning's BackboneFinetuning: the trunk is frozen when the strategy looks for it, unfrozen at a later epoch
and added to the optimizer as a new param group. A synchronous schedule trains as one device does; an
asynchronous one, whose weight policy is made for the parameters that train at its first step, refuses the
change unless it happens during the synchronous warm-up."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeConfigError, PipeStrategy


class Finetuned(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.backbone = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(torch.relu(self.pre(x)))), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def fit(strategy: PipeStrategy | None) -> Finetuned:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 4, (48,), generator=g))
    module = Finetuned()
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[finetuning], **({"strategy": strategy} if strategy else {}))
    trainer.fit(module, DataLoader(data, batch_size=16))
    return module


def test_a_synchronous_schedule_finetunes_as_one_device_does():
    """The frozen backbone used to be no trunk at all ('no nn.Sequential or nn.ModuleList with parameters')."""
    want, got = fit(None), fit(PipeStrategy(schedule="1f1b", stages=2, micro_batches=2))
    assert got.losses == pytest.approx(want.losses, rel=1e-5)
    for (name, value), expected in zip(got.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_an_asynchronous_schedule_refuses_the_unfreezing_after_it_started():
    """It crashed with an IndexError (emulated) or stepped the new group outside the schedule's rule."""
    with pytest.raises(PipeConfigError, match=r"parameters being trained changed after schedule='pipemare' started.*"
                                              r"sync_warmup_epochs"):
        fit(PipeStrategy(schedule="pipemare", stages=2, micro_batches=2))
    unfrozen_in_warmup = fit(PipeStrategy(schedule="pipemare", stages=2, micro_batches=2, sync_warmup_epochs=2))
    assert len(unfrozen_in_warmup.losses) == 9
