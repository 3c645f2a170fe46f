"""Pipeline-parallel training of an ordinary LightningModule on real data, on 2 CPU processes.

    python examples/demo.py                       # 1F1B, 4 micro-batches, 2 epochs
    python examples/demo.py --schedule gpipe --micro-batches 8 --epochs 5 --limit-train 0

The model is a plain MLP whose trunk is one ``nn.Sequential``; ``lightning_pipe.PipeStrategy`` splits
that trunk over the processes. The data is Fashion-MNIST when the Debian package
``dataset-fashion-mnist`` is installed, else scikit-learn's digits; nothing is downloaded.

Lightning's launcher re-runs this script (with the same ``sys.argv``) in every worker process, so
everything happens under ``if __name__ == "__main__"`` and the seed is fixed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

try:
    import lightning_pipe
except ModuleNotFoundError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_pipe

from datasets import DATASET_CHOICES, ClassificationDataModule


def mlp_trunk(num_features: int, num_classes: int, hidden: Sequence[int]) -> nn.Sequential:
    """Flatten, then Linear/ReLU pairs for each hidden width, then the output Linear.

    Args:
        num_features: input features per sample.
        num_classes: output logits per sample.
        hidden: widths of the hidden layers, e.g. ``(512, 256)`` gives 6 layers in total.
    """
    layers: list[nn.Module] = [nn.Flatten()]
    width = num_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class MLPClassifier(L.LightningModule):
    """An ordinary classifier: nothing in it knows about pipelines.

    Args:
        num_features: input features per sample (784 for Fashion-MNIST, 64 for digits).
        num_classes: number of classes.
        hidden: hidden layer widths of the MLP trunk.
        lr: AdamW learning rate.
    """

    def __init__(
        self, num_features: int, num_classes: int, hidden: Sequence[int] = (512, 256), lr: float = 1e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.model = mlp_trunk(num_features, num_classes, tuple(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, num_classes]`` for features ``[N, num_features]``."""
        return self.model(x)

    def _loss_acc(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(dim=1) == y).float().mean()
        return loss, acc

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy on one batch; logs the step value and the epoch mean of the loss."""
        loss, acc = self._loss_acc(batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("train_acc", acc)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Loss and accuracy on the held-out split (epoch means)."""
        loss, acc = self._loss_acc(batch)
        self.log("val_loss", loss)
        self.log("val_acc", acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Same as validation, under test names."""
        loss, acc = self._loss_acc(batch)
        self.log("test_loss", loss)
        self.log("test_acc", acc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over every parameter."""
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _metric(trainer: L.Trainer, *names: str) -> float | None:
    """The first of ``names`` found in ``trainer.callback_metrics``, as a float."""
    for name in names:
        value = trainer.callback_metrics.get(name)
        if value is not None:
            return float(value)
    return None


class PipelineReport(L.Callback):
    """Print, on global rank 0 only, the data, per-epoch loss, accuracy and throughput, total time.

    Throughput counts the samples of every training batch between the start of the epoch and the
    end of its last training batch, so the validation run at the end of the epoch is not included.
    Every rank of one pipeline sees the same batches, so rank 0's count is the pipeline's count.
    """

    def __init__(self) -> None:
        self._fit_start = 0.0
        self._epoch_start = 0.0
        self._last_batch_end = 0.0
        self._samples = 0

    @staticmethod
    def _print(trainer: L.Trainer, message: str) -> None:
        if trainer.is_global_zero:
            tqdm.write(message, file=sys.stdout)  # clears and redraws any active progress bar

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit_start = time.perf_counter()  # the strategy itself prints its stage table at setup
        dm = trainer.datamodule
        if isinstance(dm, ClassificationDataModule):
            self._print(
                trainer,
                f"dataset: {dm.name}, {dm.num_train} train / {dm.num_test} test samples, "
                f"{dm.num_features} features, {dm.num_classes} classes, batch size {dm.batch_size}",
            )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._samples = 0
        self._epoch_start = self._last_batch_end = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
            self._samples += batch[0].shape[0]
        self._last_batch_end = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seconds = self._last_batch_end - self._epoch_start
        rate = self._samples / seconds if seconds > 0 else float("nan")
        loss = _metric(trainer, "train_loss_epoch", "train_loss")
        val_acc = _metric(trainer, "val_acc")
        parts = [
            f"epoch {trainer.current_epoch}",
            f"train_loss {loss:.4f}" if loss is not None else "train_loss n/a",
            f"val_acc {val_acc:.4f}" if val_acc is not None else None,
            f"{self._samples} samples in {seconds:.2f} s = {rate:,.0f} samples/s",
        ]
        self._print(trainer, " | ".join(p for p in parts if p))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._print(trainer, f"fit finished in {time.perf_counter() - self._fit_start:.1f} s")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags of the demo.

    Args:
        argv: arguments to parse; ``None`` reads ``sys.argv``.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule name (default: 1f1b)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per batch (default: 4)")
    p.add_argument("--epochs", type=int, default=2, help="training epochs (default: 2)")
    p.add_argument("--batch-size", type=int, default=128, help="samples per batch (default: 128)")
    p.add_argument(
        "--limit-train", type=int, default=20000,
        help="use only the first N training samples; 0 means all (default: 20000)",
    )
    p.add_argument("--dataset", default="auto", choices=DATASET_CHOICES, help="data source (default: auto)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data order (default: 0)")
    p.add_argument(
        "--validate", action=argparse.BooleanOptionalAction, default=True,
        help="measure val_acc on the test split after every epoch, through the pipeline (default: on)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Build data, model and a 2-process pipeline Trainer, then fit."""
    args = parse_args(argv)
    L.seed_everything(args.seed)
    datamodule = ClassificationDataModule(
        dataset=args.dataset,
        batch_size=args.batch_size,
        limit_train=args.limit_train or None,
        seed=args.seed,
    )
    model = MLPClassifier(datamodule.num_features, datamodule.num_classes, lr=args.lr)
    trainer = L.Trainer(
        strategy=lightning_pipe.PipeStrategy(schedule=args.schedule, micro_batches=args.micro_batches),
        accelerator="cpu",
        devices=2,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=True,
        limit_val_batches=None if args.validate else 0,
        num_sanity_val_steps=None if args.validate else 0,
        callbacks=[PipelineReport()],
    )
    trainer.fit(model, datamodule=datamodule)


if __name__ == "__main__":
    main()
