"""Fast, single-process tests of the examples' real-data loaders, datamodule and demo model."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))

import datasets as ex_datasets  # noqa: E402  (examples/datasets.py)
from datasets import (  # noqa: E402
    ClassificationDataModule,
    fashion_mnist_available,
    load_digits_split,
    load_fashion_mnist,
)

assert Path(ex_datasets.__file__).parent == EXAMPLES_DIR, "a different `datasets` module shadows examples/"

HAS_FASHION = fashion_mnist_available()


def _check_standardised(x: np.ndarray) -> None:
    """Non-constant training features have mean 0 and std 1."""
    std = x.std(axis=0)
    varying = std > 1e-6
    np.testing.assert_allclose(x.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(std[varying], 1.0, atol=1e-3)


def test_digits_shapes_types_and_standardisation() -> None:
    x_tr, y_tr, x_te, y_te = load_digits_split(seed=0)
    assert x_tr.shape == (1437, 64) and x_te.shape == (360, 64)
    assert y_tr.shape == (1437,) and y_te.shape == (360,)
    assert x_tr.dtype == np.float32 and y_tr.dtype == np.int64
    assert set(np.unique(y_tr)) == set(range(10)) == set(np.unique(y_te))
    _check_standardised(x_tr)
    assert np.isfinite(x_te).all()


def test_digits_split_is_deterministic_per_seed() -> None:
    a, b, c = load_digits_split(seed=0), load_digits_split(seed=0), load_digits_split(seed=1)
    for left, right in zip(a, b):
        np.testing.assert_array_equal(left, right)
    assert not np.array_equal(a.y_train, c.y_train)


@pytest.mark.skipif(not HAS_FASHION, reason="needs `apt-get install dataset-fashion-mnist`")
def test_fashion_mnist_shapes_and_standardisation() -> None:
    x_tr, y_tr, x_te, y_te = load_fashion_mnist()
    assert x_tr.shape == (60000, 784) and x_te.shape == (10000, 784)
    assert x_tr.dtype == np.float32 and y_tr.dtype == np.int64
    assert np.bincount(y_tr).tolist() == [6000] * 10
    assert np.bincount(y_te).tolist() == [1000] * 10
    _check_standardised(x_tr)


def test_fashion_mnist_missing_files_say_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path)


def test_datamodule_auto_choice_and_lazy_sizes(tmp_path: Path) -> None:
    auto = ClassificationDataModule("auto", limit_train=100)
    assert auto.name == ("fashion_mnist" if HAS_FASHION else "digits")
    assert auto.num_features == (784 if HAS_FASHION else 64)  # before setup()
    assert auto.num_classes == 10 and auto.num_train == 100
    assert ClassificationDataModule("auto", root=str(tmp_path)).name == "digits"
    with pytest.raises(ValueError, match="unknown"):
        ClassificationDataModule("cifar")


def test_datamodule_loaders() -> None:
    dm = ClassificationDataModule("digits", batch_size=100, limit_train=250)
    dm.setup("fit")
    train_sizes = [len(y) for _, y in dm.train_dataloader()]
    assert train_sizes == [100, 100, 50]  # drop_last=False
    x, y = next(iter(dm.val_dataloader()))
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (100, 64)
    assert sum(len(y) for _, y in dm.test_dataloader()) == dm.num_test == 360


class _LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))


def test_mlp_classifier_trains_on_one_device() -> None:
    from demo import MLPClassifier

    L.seed_everything(0)
    dm = ClassificationDataModule("digits", batch_size=128)
    model = MLPClassifier(dm.num_features, dm.num_classes)
    assert len(model.model) >= 6  # enough layers to split over 2 stages
    recorder = _LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    trainer.fit(model, datamodule=dm)
    assert len(recorder.losses) == 5
    assert recorder.losses[-1] < recorder.losses[0]
    assert "train_loss" in trainer.callback_metrics


def test_pipeline_report_prints_epoch_summary(capsys: pytest.CaptureFixture[str]) -> None:
    from demo import MLPClassifier, PipelineReport

    L.seed_everything(0)
    dm = ClassificationDataModule("digits", batch_size=128, limit_train=512)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[PipelineReport()],
    )
    trainer.fit(MLPClassifier(dm.num_features, dm.num_classes, hidden=(32, 32)), datamodule=dm)
    out = capsys.readouterr().out
    assert "dataset: digits, 512 train / 360 test samples" in out
    assert "epoch 0 | train_loss " in out and "512 samples in" in out
    assert "fit finished in" in out


def test_emulate_example_runs_a_four_stage_pipemare_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    from emulate import main

    main(["--dataset", "digits", "--epochs", "1", "--limit-train", "768", "--batch-size", "64"])
    out = capsys.readouterr().out
    assert "epoch 0 | train_loss" in out and "stage 0: staleness 0." in out and "stage 3: staleness 0.00" in out
