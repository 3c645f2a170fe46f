"""A batch split into micro-batches (lightning_pipe.engine.split_micro_batches) and what the step returned per
micro-batch merged back into what it returns for the whole batch on one device
(lightning_pipe.lightning.module_glue.merge_outputs): per-sample texts and ids travel with their samples, and
predictions with their sample ids come back as one device's."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.engine import split_micro_batches
from lightning_pipe.engine.stage import batch_size as samples_in
from lightning_pipe.lightning.module_glue import merge_outputs, step_loss


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


def test_a_tensor_of_the_batch_is_combined_as_one_device_computes_it():
    """Only rows per sample are concatenated; a count, a flag and a per-batch vector are the batch's (before, a
    count was averaged and truncated to 0, and a class-mean vector came back once per micro-batch)."""
    sizes = [4, 4, 2]
    counts = [torch.tensor(3), torch.tensor(1), torch.tensor(2)]
    assert merge_outputs(counts, sizes).item() == 6 and merge_outputs(counts, sizes).dtype == torch.int64
    assert merge_outputs([torch.tensor(False), torch.tensor(True), torch.tensor(False)], sizes).item() is True
    means = [torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5]), torch.tensor([1.0, 0.0, 0.0])]
    torch.testing.assert_close(merge_outputs(means, sizes), torch.tensor([0.4, 0.4, 0.2]))
    exact = merge_outputs([torch.tensor(1 / 3, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64),
                           torch.tensor(0.7, dtype=torch.float64)], sizes)
    assert exact.dtype == torch.float64 and exact.item() == (1 / 3 * 4 + 0.1 * 4 + 0.7 * 2) / 10  # not rounded to float32
    tokens = [torch.zeros(4 * 5), torch.zeros(4 * 5), torch.zeros(2 * 5)]  # 5 tokens per sample, flattened
    assert merge_outputs(tokens, sizes).shape == (50,)
    ragged = [torch.zeros(7), torch.zeros(9), torch.zeros(3)]  # tokens of unpadded sequences
    assert merge_outputs(ragged, sizes).shape == (19,)


class Predicting(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.trunk(batch[0]), batch[0])

    def predict_step(self, batch, batch_idx):
        x, ids = batch
        out = self.trunk(x)
        return {"ids": [f"sample{int(i)}" for i in ids], "out": out, "positive": (out > 0).sum(), "mean": out[:, :3].mean(0)}


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
        for key in ("out", "positive", "mean"):
            torch.testing.assert_close(g[key], w[key])


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


def test_tensors_that_are_not_one_row_per_sample_are_shared_by_every_micro_batch():
    batch = (torch.arange(7)[:, None], torch.tensor([1.0, 2.0, 0.5]), torch.tensor(0.5))
    parts = split_micro_batches(batch, 3)
    assert [p[0].flatten().tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert all(p[1] is batch[1] and p[2] is batch[2] for p in parts)


@dataclasses.dataclass
class LabelledBatch:
    """A batch as a dataclass, which Lightning moves to the device field by field."""

    x: torch.Tensor
    y: torch.Tensor
    source: str = "train"


def test_a_dataclass_batch_is_split_field_by_field():
    """It counted as a batch without tensors ('cannot be split into micro-batches')."""
    batch = LabelledBatch(torch.arange(6)[:, None].float(), torch.arange(6))
    parts = split_micro_batches(batch, 2)
    assert [type(p) for p in parts] == [LabelledBatch] * 2 and samples_in(batch) == 6
    assert [p.y.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5]] and parts[1].source == "train"


def test_a_dataclass_batch_trains_as_on_one_device():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 4, (32,), generator=g))

    class FromDataclass(BiasedByTheCollate):
        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.trunk(batch.x), batch.y)

    def fit(strategy: PipeStrategy | None) -> list[float]:
        module = FromDataclass()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            **({"strategy": strategy} if strategy else {}))
        collate = lambda samples: LabelledBatch(*torch.utils.data.default_collate(samples))  # noqa: E731
        trainer.fit(module, DataLoader(data, batch_size=8, collate_fn=collate))
        return module.losses

    assert fit(PipeStrategy(schedule="1f1b", stages=2, micro_batches=2)) == pytest.approx(fit(None), rel=1e-5)


class BiasedByTheCollate(L.LightningModule):
    """A collate adds a class-prior vector (4 entries, not one per sample) and a 0-d temperature to each batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(*[nn.Linear(6, 6) for _ in range(3)], nn.Linear(6, 4))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y, prior, temperature = batch
        return F.cross_entropy(self.trunk(x) / temperature + prior.log(), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def with_prior(samples: list) -> tuple:
    x, y = torch.utils.data.default_collate(samples)
    return x, y, torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor(2.0)


def test_a_collate_s_class_prior_and_temperature_reach_every_micro_batch_whole():
    """Split along with the samples, the prior's 4 entries crashed the loss; a 0-d tensor could not be split at all.
    (A batch of 4 samples would split the prior too: a tensor as long as the batch counts as one row per sample.)"""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 4, (32,), generator=g))

    def fit(strategy: PipeStrategy | None, batch_size: int) -> list[float]:
        module = BiasedByTheCollate()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            **({"strategy": strategy} if strategy else {}))
        trainer.fit(module, DataLoader(data, batch_size=batch_size, collate_fn=with_prior))
        return module.losses

    for batch_size in (16, 8):
        want = fit(None, batch_size)
        assert fit(PipeStrategy(schedule="1f1b", stages=2, micro_batches=2), batch_size) == pytest.approx(want, rel=1e-5)


def test_a_step_that_returns_none_to_skip_a_batch_is_told_why_it_cannot():
    """Lightning skips a batch whose training_step returns None on one device; across devices it cannot (DDP neither),
    and here the other stages have run the forward already."""

    loss = torch.ones(())
    assert step_loss(loss, "training_step") is loss and step_loss({"loss": loss, "n": 3}, "training_step") is loss
    with pytest.raises(TypeError, match="training_step returned NoneType; .* Skipping a batch by returning None is not "
                                        "supported across devices"):
        step_loss(None, "training_step")
    with pytest.raises(TypeError, match=r"returned dict; .* for every batch\.$"):
        step_loss({"logits": loss}, "training_step")


def test_a_tensor_longer_than_the_first_is_named_in_a_warning(recwarn):
    """The first tensor sets the batch size; a collate that puts a class prior before the inputs had the inputs shared
    whole by every micro-batch and the step fail on shapes, with nothing said about why."""
    with pytest.warns(UserWarning, match=r"first tensor has 3 row\(s\).*tensors of 16 rows.*put it first in the batch"):
        split_micro_batches((torch.ones(3), torch.zeros(16, 2), torch.zeros(16)), 2)
    recwarn.clear()
    split_micro_batches((torch.zeros(16, 2), torch.ones(3), torch.zeros(16)), 2)  # the documented place of a prior
    assert not [w for w in recwarn if "first tensor" in str(w.message)]
