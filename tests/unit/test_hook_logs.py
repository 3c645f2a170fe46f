"""How the values each stage logs around the optimizer step are merged (lightning_pipe/lightning/hook_logs.py):
one record per name, Lightning's grad_norm total as the whole model's norm, and a warning where stages disagree."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule

from lightning_pipe.lightning.hook_logs import BEFORE_OPTIMIZER_STEP, StageHookLogs, overrides
from lightning_pipe.lightning.log_replay import LoggedValue


def merger(last_device: int = 1) -> StageHookLogs:
    return StageHookLogs(LightningModule(), lambda records: [records], device=0, last_device=last_device,
                             one_pipeline=True)


def merged_values(stages: list[dict[str, float]], last_device: int = 1) -> dict[str, tuple[int, float]]:
    records = [[LoggedValue(name, value, 8) for name, value in stage.items()] for stage in stages]
    return {record.name: (device, record.value) for device, record in merger(last_device).merge(records)}


def test_each_stage_s_own_names_are_kept_with_the_stage_that_logged_them():
    got = merged_values([{"grad_2.0_norm/pre.weight": 3.0}, {"grad_2.0_norm/head.weight": 4.0}])
    assert got == {"grad_2.0_norm/pre.weight": (0, 3.0), "grad_2.0_norm/head.weight": (1, 4.0)}


@pytest.mark.parametrize("order,want", [("2.0", 5.0), ("1.0", 7.0), ("inf", 4.0)])
def test_lightning_s_grad_norm_total_is_the_norm_of_the_stages_totals(order, want):
    name = f"grad_{order}_norm_total"
    got = merged_values([{name: 3.0}, {name: 4.0}])
    assert got[name][1] == pytest.approx(want)
    whole = torch.tensor([3.0, 4.0])  # two stages of one parameter each: the model's norm is that of the two
    assert torch.linalg.vector_norm(whole, float(order)).item() == pytest.approx(want)


def test_a_value_every_stage_logs_alike_is_logged_once_without_a_warning(recwarn):
    assert merged_values([{"lr": 0.1}, {"lr": 0.1}, {"lr": 0.1}], last_device=2) == {"lr": (2, 0.1)}
    assert not recwarn.list


def test_values_that_differ_keep_the_last_stage_s_and_say_how_to_log_them_apart():
    with pytest.warns(UserWarning, match=r"self.log\('weight_norm'\) in on_before_optimizer_step got a different value.*"
                                         r"weight_norm/stage\{self.trainer.strategy.topology.stage\}"):
        got = merged_values([{"weight_norm": 1.0}, {"weight_norm": 2.0}], last_device=0)  # zbv: device 0 is last
    assert got == {"weight_norm": (0, 1.0)}


def test_the_gather_runs_only_where_a_hook_that_could_log_is_overridden():
    class Tracks(LightningModule):
        def on_before_optimizer_step(self, optimizer):
            pass

    class Watches(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass

    assert not overrides(BEFORE_OPTIMIZER_STEP, LightningModule(), [])
    assert overrides(BEFORE_OPTIMIZER_STEP, Tracks(), [])
    assert overrides(BEFORE_OPTIMIZER_STEP, LightningModule(), [Watches()])


def test_epoch_end_hooks_are_wrapped_once_and_given_back_as_they_were():
    """A wrapped hook runs the user's own (decorators included), logs through the merge, and a second wrapping (a later
    Trainer call) wraps the user's hook again, not the first wrapper; unwrapping leaves the class's method."""
    import types

    class Collects(LightningModule):
        @torch.no_grad()
        def on_validation_epoch_end(self):
            self.seen = torch.is_grad_enabled()
            self.log("val_max", 3.0)

    module = Collects()
    module._trainer = types.SimpleNamespace(is_global_zero=True, loggers=[])  # what the hook and the merge read
    gathered = []
    first = StageHookLogs(module, lambda logs: gathered.append(logs) or [logs], device=0, last_device=0, one_pipeline=True)
    assert first.wrap_epoch_ends() == ["on_validation_epoch_end"]
    replayed = []
    module.log = lambda name, value, **kwargs: replayed.append((name, float(value)))  # the real log, as replay calls it
    second = StageHookLogs(module, lambda logs: [logs], device=0, last_device=0, one_pipeline=True)
    second.wrap_epoch_ends()
    module.on_validation_epoch_end()
    assert module.seen is False and replayed == [("val_max", 3.0)] and gathered == []  # the second wrapper alone ran
    second.unwrap()
    assert "on_validation_epoch_end" not in vars(module)
