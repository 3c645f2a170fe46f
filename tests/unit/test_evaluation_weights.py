"""Validation, test and predict use exactly the weights a checkpoint saved at that moment holds,
under every schedule (so ModelCheckpoint and EarlyStopping decide on scores of the model they keep).

One-device emulation (two stages in this process) runs the same engine and weight policies as a
distributed run (avgpipe's center included; tests/distributed/test_avgpipe_lightning.py checks it on two
processes too).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipe import PipeStrategy
from lightning_pipe.registry import SCHEDULES
from tests.harness.lightning_run import make_data


class Probe(nn.Linear):
    """A linear layer that records the weight each evaluation forward uses."""

    def __init__(self, *args, log: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def forward(self, x):
        if not self.training:
            self.log[-1].append((id(self), self.weight.detach().clone()))
        return super().forward(x)


class ProbedNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.seen: list[list] = []
        self.model = nn.Sequential(Probe(8, 16, log=self.seen), nn.Tanh(), Probe(16, 16, log=self.seen), nn.Tanh(),
                                   Probe(16, 4, log=self.seen))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))

    def on_validation_start(self):
        self.seen.append([])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


EMULATED = list(SCHEDULES)


@pytest.mark.parametrize("schedule", EMULATED)
def test_in_fit_validation_sees_the_checkpoint_it_scores(schedule, tmp_path):
    model = ProbedNet()
    every = ModelCheckpoint(tmp_path, monitor="val_loss", save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PipeStrategy(schedule=schedule, stages=2, micro_batches=4),
        max_epochs=1, val_check_interval=0.5, num_sanity_val_steps=0, logger=False, callbacks=[every],
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    train, val = DataLoader(make_data(96), batch_size=8), DataLoader(make_data(24, seed=1), batch_size=8)
    trainer.fit(model, train, val)
    in_fit = float(trainer.callback_metrics["val_loss"])
    probes = [m for m in model.model if isinstance(m, Probe)]
    names = {id(p): f"model.{i}.weight" for i, p in zip(range(0, 5, 2), probes)}
    assert len(model.seen) == 2 and len(every.best_k_models) == 2
    paths = sorted(every.best_k_models, key=lambda p: int(p.split("step=")[1][:-len(".ckpt")]))  # in saving order
    for seen, path in zip(model.seen, paths):
        saved = torch.load(path, weights_only=False)["state_dict"]
        assert seen, "no evaluation forward recorded"
        for layer, weight in seen:  # every evaluation forward used the weights the checkpoint holds
            assert torch.equal(weight, saved[names[layer]]), (path, names[layer])
    # the score ModelCheckpoint kept is the score of the file it kept: validating it again gives the same
    model.seen.clear()
    again = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    assert again == in_fit
    plain = ProbedNet()
    plain.load_state_dict(torch.load(paths[-1], weights_only=False)["state_dict"])
    plain.eval()
    plain.seen.append([])
    with torch.no_grad():
        losses = [F.cross_entropy(plain.model(x), y) * len(y) for x, y in val]
    assert sum(losses).item() / 24 == pytest.approx(in_fit, rel=1e-6)
