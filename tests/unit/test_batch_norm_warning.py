"""BatchNorm normalises each micro-batch on its own, so a pipeline with several micro-batches trains like one device
with accumulated smaller batches, not like one device on the whole batch: fit says so once (MicroBatchNormWarning)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import MicroBatchNormWarning, PipeStrategy
from lightning_pipe.lightning.checks import warn_batch_norm


class Normed(L.LightningModule):
    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), norm(8), nn.ReLU(), nn.Linear(8, 8), norm(8), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.trunk(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model: L.LightningModule, micro_batches: int) -> list[warnings.WarningMessage]:
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = L.Trainer(strategy=PipeStrategy(schedule="1f1b", stages=2, micro_batches=micro_batches), accelerator="cpu",
                        devices=1, max_steps=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(data, batch_size=8))
    return [w for w in caught if issubclass(w.category, MicroBatchNormWarning)]


def test_fit_with_batch_norm_and_micro_batches_says_what_the_pipeline_trains():
    said = fit(Normed(nn.BatchNorm1d), 4)
    assert len(said) == 1
    assert "trunk.1, trunk.4 (BatchNorm1d) normalise each micro-batch on its own (micro_batches=4)" in str(said[0].message)
    assert "LayerNorm or GroupNorm" in str(said[0].message)


@pytest.mark.parametrize("norm,micro_batches", [(nn.LayerNorm, 4), (nn.BatchNorm1d, 1)])
def test_no_warning_where_the_pipeline_normalises_as_one_device(norm, micro_batches):
    assert fit(Normed(norm), micro_batches) == []


def test_layers_in_eval_mode_are_not_named():
    """A frozen BatchNorm (eval mode: its running statistics) normalises every micro-batch as the whole batch."""
    model = Normed(nn.BatchNorm1d)
    model.trunk[1].eval()
    with pytest.warns(MicroBatchNormWarning, match=r"trunk\.4 \(BatchNorm1d\)") as said:
        warn_batch_norm(model, 2)
    assert "trunk.1" not in str(said[0].message)


class NormedOutside(L.LightningModule):
    """BatchNorm before the trunk (the first stage's), in it, and after it (the last stage's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.trunk = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Sequential(nn.BatchNorm1d(8, affine=False), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.head(self.trunk(self.pre(batch[0]))), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_pipeline_trains_batch_norm_as_one_device_accumulating_micro_batches(schedule):
    """Every later virtual stage runs the step's code before the trunk again on the same micro-batch; the statistics of
    the BatchNorm there were updated by each of those passes too (twice per micro-batch, emulated). They are now put back
    when the trunk is reached, and the pipeline equals one device accumulating micro-batch-sized batches."""
    data = TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)), torch.randint(0, 2, (32,)))

    def trained(batch_size: int, **options) -> dict[str, torch.Tensor]:
        model = NormedOutside()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False, use_distributed_sampler=False, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MicroBatchNormWarning)
            trainer.fit(model, DataLoader(data, batch_size=batch_size))
        return model.state_dict()

    want = trained(2, accumulate_grad_batches=4)
    got = trained(8, strategy=PipeStrategy(schedule=schedule, stages=2, micro_batches=4))
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert int(got["pre.1.num_batches_tracked"]) == 32
