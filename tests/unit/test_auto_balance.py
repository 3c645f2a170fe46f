"""balance="auto" through Lightning on 2 processes: both ranks cut identically, training equals one device."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DropoutNet(L.LightningModule):
    """Randomness (dropout) and running statistics (BatchNorm) inside and before the trunk."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.BatchNorm1d(8)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(self.pre(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ShuffledData(L.LightningDataModule):
    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16, shuffle=True)


def _fit(strategy, cache=None):
    L.seed_everything(0, verbose=False)
    model = DropoutNet()
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Losses()])
    trainer.fit(model, datamodule=ShuffledData())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_profiling_at_setup_changes_nothing_about_the_run(tmp_path):
    """The sample batch comes from the datamodule (shuffled); random states and BatchNorm statistics
    are restored, so the run equals the same run with the chosen split given as a list (one process
    emulating 2 stages)."""
    from lightning_pipe import PipeStrategy

    strategy = PipeStrategy(schedule="1f1b", micro_batches=2, stages=2, balance="auto",
                            auto_balance={"profile_cache": str(tmp_path / "p.json")})
    losses, state = _fit(strategy)
    assert len(strategy.layer_counts) == 2 and sum(strategy.layer_counts) == 5 and strategy.plan is not None
    want_losses, want_state = _fit(PipeStrategy(schedule="1f1b", micro_batches=2, stages=2, balance=strategy.layer_counts))
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, msg=key)


def test_nothing_fits_the_memory_limit_fails_at_setup_with_the_smallest_need():
    from lightning_pipe import PipeConfigError, PipeStrategy

    strategy = PipeStrategy(schedule="1f1b", micro_batches=2, stages=2, balance="auto",
                            auto_balance={"memory_gib": 2.0**-20})
    with pytest.raises(PipeConfigError, match=r"no split of 5 layers over 2 stages fits 1\.0 KiB per device; the smallest "
                                              r"needs [\d.]+ KiB: balance=\[\d, \d\] with schedule='1f1b', micro_batches=2"):
        _fit(strategy)


def test_a_resumed_run_keeps_the_checkpoints_split(tmp_path, monkeypatch):
    """A checkpoint records the split; resuming with balance="auto" adopts it instead of profiling
    again (a new profile or refinement could choose another split than the stages' saved state)."""
    from lightning_pipe import PipeStrategy
    from lightning_pipe.planning import auto_balance

    strategy = PipeStrategy(schedule="1f1b", micro_batches=2, stages=2, balance="auto")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(DropoutNet(), datamodule=ShuffledData())
    path = str(tmp_path / "auto.ckpt")
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["pipe_balance"] == strategy.layer_counts
    monkeypatch.setattr(auto_balance, "split_by_profile", lambda *a, **k: pytest.fail("planned again"))
    resumed = PipeStrategy(schedule="1f1b", micro_batches=2, stages=2, balance="auto")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=resumed, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(DropoutNet(), datamodule=ShuffledData(), ckpt_path=path)
    assert resumed.layer_counts == strategy.layer_counts and trainer.global_step == 4


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b"])
def test_a_checkpoint_read_after_setup_stops_an_asynchronous_run_whose_auto_split_differs(tmp_path, monkeypatch, schedule):
    """save_distributed_checkpoint=True reads a checkpoint after setup, too late for balance="auto" to adopt its
    split. If setup chose another one, an asynchronous schedule (whose staleness per layer follows the split)
    stops with the split to give; a synchronous one equals one device under any split and goes on."""
    import dataclasses

    from lightning_pipe import CheckpointMismatchError, PipeStrategy
    from lightning_pipe.planning import auto_balance

    def trainer_for(strategy, steps):
        return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    options = {"schedule": schedule, "micro_batches": 2, "stages": 2, "balance": "auto", "save_distributed_checkpoint": True,
               "auto_balance": {"refine": 0}}
    strategy = PipeStrategy(**options)
    trainer = trainer_for(strategy, 2)
    trainer.fit(DropoutNet(), datamodule=ShuffledData())
    path = str(tmp_path / "auto.ckpt")
    trainer.save_checkpoint(path)
    stored = strategy.layer_counts
    other = [stored[0] + 1, stored[1] - 1] if stored[1] > 1 else [stored[0] - 1, stored[1] + 1]
    planned = auto_balance.split_by_profile

    def another_split(*args, **kwargs):
        chosen = planned(*args, **kwargs)
        return dataclasses.replace(chosen, plan=dataclasses.replace(chosen.plan, balance=other))

    monkeypatch.setattr(auto_balance, "split_by_profile", another_split)
    resumed = PipeStrategy(**options)
    trainer = trainer_for(resumed, 4)
    if schedule == "1f1b":
        trainer.fit(DropoutNet(), datamodule=ShuffledData(), ckpt_path=path)
        assert resumed.layer_counts == other and trainer.global_step == 4
        return
    with pytest.raises(CheckpointMismatchError, match=rf"auto\.ckpt: the checkpoint was trained with the split \{stored}, but "
                                                       rf"balance='auto' chose \{other} at setup.*resume with balance=\{stored}\."):
        trainer.fit(DropoutNet(), datamodule=ShuffledData(), ckpt_path=path)


def test_avgpipes_auto_values_that_differ_from_a_checkpoint_read_after_setup_stop_the_load():
    """avgpipe's "auto" values are chosen at setup too: a checkpoint read after it with other values stops
    with the values to give; values given by hand, or equal to the checkpoint's, go on."""
    from lightning_pipe import CheckpointMismatchError, PipeStrategy
    from lightning_pipe.lightning.auto import check_resumed_choices
    from lightning_pipe.planning.avgpipe_autotune import CHECKPOINT_KEY

    chosen = PipeStrategy(schedule="avgpipe", micro_batches=4, avgpipe={"parallel_pipelines": 2, "advance_forward": 1}).options
    saved = {CHECKPOINT_KEY: {"parallel_pipelines": 2, "micro_batches": 2, "advance_forward": 0}}
    with pytest.raises(CheckpointMismatchError, match=r"^ck: the checkpoint was trained with avgpipe's .*resume with "
                                                      r"micro_batches=2, avgpipe=\{'parallel_pipelines': 2, 'advance_forward': 0\}\.$"):
        check_resumed_choices(chosen, [3, 2], True, saved, "ck")
    check_resumed_choices(chosen, [3, 2], False, saved, "ck")  # given by hand: the user's values
    same = {CHECKPOINT_KEY: {"parallel_pipelines": 2, "micro_batches": 4, "advance_forward": 1}}
    check_resumed_choices(chosen, [3, 2], True, same, "ck")
