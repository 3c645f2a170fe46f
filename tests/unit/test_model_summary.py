"""Lightning's ModelSummary reports the whole module although each process keeps only its stage."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelSummary

from lightning_pipe.lightning.model_summary import freeze_model_summaries
from lightning_pipe.partition.split import PartitionedTrunk
from tests.harness.lightning_run import TrunkModel


def test_summaries_taken_before_the_cut_count_every_stage():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[ModelSummary(max_depth=2)])
    module = TrunkModel()
    module.example_input_array = torch.zeros(2, 8)  # the summary runs it through the whole module, before the cut
    whole = sum(p.numel() for p in module.parameters())
    freeze_model_summaries(trainer, module, is_global_zero=True)
    PartitionedTrunk(module.model, "model", [(0, 6), (6, 12)], [1])  # this process keeps stage 1 only
    assert sum(p.numel() for p in module.parameters()) < whole
    summaries = [c._summary(trainer, module) for c in trainer.callbacks if isinstance(c, ModelSummary)]
    assert summaries and all(s.total_parameters == s.trainable_parameters == whole for s in summaries)
    columns = dict(summaries[0]._get_summary_data())
    assert "model.0" in columns["Name"] and "model.11" in columns["Name"]  # depth 2: other processes' layers listed
    assert columns["Out sizes"][columns["Name"].index("model.11")] == "[2, 16]"
    # other ranks do not print; they summarise nothing
    other = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[ModelSummary()])
    freeze_model_summaries(other, TrunkModel(), is_global_zero=False)
    assert next(c for c in other.callbacks if isinstance(c, ModelSummary))._summary(other, module).total_parameters == 0
