"""A step's own calls to the loggers (``self.logger.log_metrics``, ``self.logger.experiment.add_text``) are made where
the loggers write, once per batch as on one device (lightning_pipe/lightning/logger_calls.py); 2 processes, where rank
0 is not the last stage: tests/distributed/test_strategy.py::test_callbacks_and_loggers_behave_as_on_one_device."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.errors import PipeConfigError


class Writer:
    """A logger's experiment: records what it is asked to write."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, str, int]] = []

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.texts.append((tag, text, step))


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[dict, int]] = []
        self.writer = Writer()

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @property
    def experiment(self) -> Writer:
        return self.writer

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append((dict(metrics), step))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class Calls(L.LightningModule):
    def __init__(self, argument=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(6, 8)
        self.trunk = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.argument = argument

    def forward(self, x):
        return self.head(self.trunk(self.pre(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        if isinstance(self.logger, MemoryLogger):  # the stand-in passes for the real logger
            self.logger.log_metrics({"first_logit": round(float(logits[0, 0]), 5), "dir": self.logger.name}, step=batch_idx)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        prediction = self(x).argmax(1)
        if batch_idx == 0:
            self.logger.experiment.add_text("predictions", str(prediction[:2].tolist()), self.global_step)
        if self.argument is not None:
            self.logger.experiment.add_text("bad", self.argument, self.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(strategy: PipeStrategy | None, module: Calls | None = None) -> MemoryLogger:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    logger = MemoryLogger()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        use_distributed_sampler=False, **({"strategy": strategy} if strategy else {}))
    trainer.fit(module or Calls(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    return logger


def test_a_step_s_logger_calls_are_made_once_per_batch_as_on_one_device():
    want = run(None)
    with pytest.warns(UserWarning, match=r"self.loggers\[0\].log_metrics\(...\).*in several micro-batches of one batch"):
        got = run(PipeStrategy(schedule="1f1b", stages=2, micro_batches=4))
    step_metrics = [(m, s) for m, s in got.metrics if "first_logit" in m]
    assert step_metrics == [(m, s) for m, s in want.metrics if "first_logit" in m] and len(step_metrics) == 4
    assert got.writer.texts == want.writer.texts == [("predictions", str(want.writer.texts[0][1]), 4)]


def test_a_call_whose_arguments_cannot_reach_rank_0_names_itself():
    with pytest.raises(PipeConfigError, match=r"self.loggers\[0\].experiment.add_text\(...\) under a pipeline.*cannot be "
                                              r"pickled"):
        run(PipeStrategy(schedule="1f1b", stages=2, micro_batches=2), Calls(argument=lambda: "not picklable"))
