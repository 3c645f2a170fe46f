"""A batch split into micro-batches (lightning_pipe.engine.split_micro_batches) and what the step returned per
micro-batch merged back into what it returns for the whole batch on one device
(lightning_pipe.lightning.module_glue.merge_outputs): per-sample texts and ids travel with their samples, and
predictions with their sample ids come back as one device's."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.engine import split_micro_batches
from lightning_pipe.lightning.module_glue import merge_outputs


def test_lists_of_one_entry_per_sample_are_joined_and_fixed_structures_merged_by_position():
    sizes = [2, 3]
    ids = merge_outputs([["a", "b"], ["c", "d", "e"]], sizes)
    assert ids == ["a", "b", "c", "d", "e"]
    scores = merge_outputs([[torch.tensor(1.0), torch.tensor(2.0)], [torch.tensor(3.0)] * 3], sizes)
    assert len(scores) == 5  # one 0-d tensor per sample
    pair = merge_outputs([[torch.zeros(2, 4), torch.ones(2)], [torch.zeros(3, 4), torch.ones(3)]], sizes)
    assert [tuple(t.shape) for t in pair] == [(5, 4), (5,)]  # [logits, hidden]: by position, concatenated
    loss = merge_outputs([torch.tensor(1.0), torch.tensor(2.0)], sizes)
    assert float(loss) == pytest.approx(1.0 * 2 / 5 + 2.0 * 3 / 5)  # a scalar: the size-weighted mean
    assert merge_outputs([2, 3], sizes) == [2, 3]  # a number of unknown meaning: per micro-batch


class Predicting(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.trunk(batch[0]), batch[0])

    def predict_step(self, batch, batch_idx):
        x, ids = batch
        return {"ids": [f"sample{int(i)}" for i in ids], "out": self.trunk(x)}


def test_predict_returns_one_devices_ids_and_outputs():
    data = DataLoader(TensorDataset(torch.randn(8, 6), torch.arange(8)), batch_size=4)

    def predict(strategy: PipeStrategy | None) -> list[dict]:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, **({"strategy": strategy} if strategy else {}))
        return trainer.predict(Predicting(), data)

    want, got = predict(None), predict(PipeStrategy(schedule="1f1b", stages=2, micro_batches=2))
    assert [o["ids"] for o in got] == [o["ids"] for o in want] == [[f"sample{i}" for i in range(4)],
                                                                    [f"sample{i}" for i in range(4, 8)]]
    for g, w in zip(got, want):
        torch.testing.assert_close(g["out"], w["out"])


def test_a_list_of_one_plain_value_per_sample_is_split_with_its_samples():
    batch = {"x": torch.arange(7)[:, None], "text": [f"t{i}" for i in range(7)], "split": "train", "pair": [torch.zeros(7)] * 2}
    parts = split_micro_batches(batch, 3)
    assert [p["x"].flatten().tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [p["text"] for p in parts] == [["t0", "t1", "t2"], ["t3", "t4"], ["t5", "t6"]]
    assert all(p["split"] == "train" and [t.shape[0] for t in p["pair"]] == [len(p["x"])] * 2 for p in parts)
    assert split_micro_batches({"x": torch.zeros(2, 1), "labels": ["a", "b", "c"]}, 2)[0]["labels"] == ["a", "b", "c"]  # not per sample


class Named(Dataset):
    """Samples with a name: the default collate gives the batch ``{"x": tensor, "name": [str, ...]}``."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((6,), float(i)), "name": f"sample{i}"}


class PredictingNames(Predicting):
    def predict_step(self, batch, batch_idx):
        assert len(batch["name"]) == len(batch["x"])  # each micro-batch carries its own samples' names
        return {"ids": batch["name"], "out": self.trunk(batch["x"])}


def test_predict_returns_the_names_the_batch_carried():
    def predict(strategy: PipeStrategy | None) -> list[dict]:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, **({"strategy": strategy} if strategy else {}))
        return trainer.predict(PredictingNames(), DataLoader(Named(), batch_size=4))

    want, got = predict(None), predict(PipeStrategy(schedule="1f1b", stages=2, micro_batches=2))
    assert [o["ids"] for o in got] == [o["ids"] for o in want] == [[f"sample{i}" for i in range(4)],
                                                                    [f"sample{i}" for i in range(4, 8)]]
