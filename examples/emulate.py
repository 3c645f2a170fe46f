"""Study an asynchronous pipeline schedule on one device: a 4-stage PipeMare pipeline, emulated.

    python examples/emulate.py                                   # pipemare, 4 stages, 2 epochs
    python examples/emulate.py --schedule xpipe --stages 4 --micro-batches 2 --epochs 5 --limit-train 0

``Trainer(devices=1, strategy=PipeStrategy(schedule="pipemare", stages=4))`` runs all four stages in
this one process with the asynchronous semantics of a real 4-stage pipeline (stale weights, stashing,
prediction, each stage stepping on its own), so the accuracy it reaches is the accuracy the schedule
reaches on four devices; only the speed is one device's (docs/emulation.md). The model and data are
those of examples/demo.py: the demo MLP on Fashion-MNIST (scikit-learn's digits if the Debian package
``dataset-fashion-mnist`` is missing).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import lightning as L

try:
    import lightning_pipe
except ModuleNotFoundError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_pipe

from datasets import DATASET_CHOICES, ClassificationDataModule
from demo import MLPClassifier, PipelineReport


class StageReport(L.Callback):
    """After every epoch, print each stage's mean staleness and the weight copies it held."""

    def __init__(self, stages: int) -> None:
        self.stages = stages

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        cells = []
        for s in range(self.stages):
            staleness = metrics.get(f"pipe/stage{s}/staleness")
            copies = metrics.get(f"pipe/stage{s}/weight_copies")
            if staleness is not None and copies is not None:
                cells.append(f"stage {s}: staleness {float(staleness):.2f}, {int(copies)} weight copies")
        if cells:
            print("  " + "; ".join(cells))
        else:  # the strategy logs its stage metrics on the steps Lightning logs
            print(f"  stage metrics: none logged yet (every {trainer.log_every_n_steps} steps; this epoch had fewer)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags.

    Args:
        argv: arguments to parse; ``None`` reads ``sys.argv``.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="pipemare", help="pipeline schedule to emulate (default: pipemare)")
    p.add_argument("--stages", type=int, default=4, help="stages of the emulated pipeline (default: 4)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per batch (default: 4)")
    p.add_argument("--epochs", type=int, default=2, help="training epochs (default: 2)")
    p.add_argument("--batch-size", type=int, default=128, help="samples per batch (default: 128)")
    p.add_argument("--limit-train", type=int, default=20000, help="first N training samples; 0: all (default: 20000)")
    p.add_argument("--dataset", default="auto", choices=DATASET_CHOICES, help="data source (default: auto)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data order (default: 0)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Fit the demo MLP with an emulated ``--stages``-stage pipeline on one CPU device."""
    args = parse_args(argv)
    L.seed_everything(args.seed)
    datamodule = ClassificationDataModule(
        dataset=args.dataset, batch_size=args.batch_size, limit_train=args.limit_train or None, seed=args.seed,
    )
    model = MLPClassifier(datamodule.num_features, datamodule.num_classes, hidden=(512, 256, 128), lr=args.lr)
    trainer = L.Trainer(
        strategy=lightning_pipe.PipeStrategy(schedule=args.schedule, stages=args.stages, micro_batches=args.micro_batches),
        accelerator="cpu",
        devices=1,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=10,
        callbacks=[PipelineReport(), StageReport(args.stages)],
    )
    trainer.fit(model, datamodule=datamodule)


if __name__ == "__main__":
    main()
