"""Lightning's ModelSummary reports the whole module although each process keeps only its stage."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelSummary

from lightning_pipe.lightning.model_summary import freeze_model_summaries
from lightning_pipe.partition.split import PartitionedTrunk
from tests.harness.lightning_run import TrunkModel


def printed(trainer: L.Trainer, module: L.LightningModule, monkeypatch) -> list[tuple[dict, int, int]]:
    """What each ModelSummary callback prints when fitting starts (its public ``on_fit_start``; what it hands
    to ``summarize``, the table's columns and the total and trainable parameters, recorded instead of printed)."""
    seen: list[tuple[dict, int, int]] = []

    def summarize(summary_data, total_parameters, trainable_parameters, *args, **kwargs):
        seen.append((dict(summary_data), total_parameters, trainable_parameters))

    monkeypatch.setattr(ModelSummary, "summarize", staticmethod(summarize))
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary):
            callback.on_fit_start(trainer, module)
    return seen


def test_summaries_taken_before_the_cut_count_every_stage(monkeypatch):
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[ModelSummary(max_depth=2)])
    module = TrunkModel()
    module.example_input_array = torch.zeros(2, 8)  # the summary runs it through the whole module, before the cut
    whole = sum(p.numel() for p in module.parameters())
    freeze_model_summaries(trainer, module, is_global_zero=True)
    PartitionedTrunk(module.model, "model", [(0, 6), (6, 12)], [1])  # this process keeps stage 1 only
    assert sum(p.numel() for p in module.parameters()) < whole
    summaries = printed(trainer, module, monkeypatch)
    assert summaries and all(total == trainable == whole for _, total, trainable in summaries)
    columns = summaries[0][0]
    assert "model.0" in columns["Name"] and "model.11" in columns["Name"]  # depth 2: other processes' layers listed
    assert columns["Out sizes"][columns["Name"].index("model.11")] == "[2, 16]"
    # other ranks do not print; they summarise nothing
    other = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[ModelSummary()])
    freeze_model_summaries(other, TrunkModel(), is_global_zero=False)
    assert [(total, trainable) for _, total, trainable in printed(other, module, monkeypatch)] == [(0, 0)]
