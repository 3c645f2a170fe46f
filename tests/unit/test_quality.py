"""The setup warning of the stale schedules (lightning_pipe.quality, docs/async-semantics.md): it fires for
Adam-like optimizers with the measured cost and a recipe, and stays silent for Muon, SGD, BasisRotationAdam,
avgpipe and the synchronous schedules."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_pipe import AsyncQualityWarning, PipeStrategy, registry
from lightning_pipe.optim import BasisRotationAdam, CombinedOptimizer
from lightning_pipe.quality import COST, STALE, measured_cost, nearest_stages, optimizer_family, plan_notes, quality_warning
from tests.harness.lightning_run import train

MODEL = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
MATRICES = [MODEL[0].weight]
OTHERS = [MODEL[0].bias, *MODEL[1].parameters()]


def optimizers() -> dict[str, torch.optim.Optimizer]:
    return {
        "adamw": torch.optim.AdamW(MODEL.parameters()),
        "adam": torch.optim.Adam(MODEL.parameters()),
        "muon": CombinedOptimizer(torch.optim.Muon(MATRICES), torch.optim.AdamW(OTHERS)),
        "sgd": torch.optim.SGD(MODEL.parameters(), lr=0.1, momentum=0.9),
        "basis_rotation": CombinedOptimizer(BasisRotationAdam(MATRICES), torch.optim.AdamW(OTHERS)),
        "combined_adam": CombinedOptimizer(torch.optim.AdamW(MATRICES), torch.optim.AdamW(OTHERS)),
    }


def test_the_stale_schedules_are_the_registrys_asynchronous_family():
    assert set(STALE) == set(registry.names("asynchronous"))
    assert "avgpipe" not in STALE


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("schedule", STALE)
def test_every_stale_schedule_warns_for_adamw_and_not_for_muon_or_sgd(schedule, stages):
    built = optimizers()
    message = quality_warning(schedule, stages, built["adamw"])
    assert message is not None and f"schedule={schedule!r}" in message and f"at {stages} stages" in message
    assert f"{COST[(schedule, stages, 'adamw')]:+.1f} %" in message
    assert "docs/async-semantics.md#choosing-an-asynchronous-configuration" in message
    assert "quality_warning=False" in message
    assert quality_warning(schedule, stages, built["combined_adam"]) is not None  # AdamW on the matrices too
    for silent in ("muon", "sgd", "basis_rotation"):
        assert quality_warning(schedule, stages, built[silent]) is None, silent


@pytest.mark.parametrize("schedule", ["avgpipe", *registry.names("synchronous")])
def test_avgpipe_and_the_synchronous_schedules_never_warn(schedule):
    assert quality_warning(schedule, 4, optimizers()["adamw"]) is None


def test_nadam_warns_except_in_the_recipe_that_keeps_quality():
    nadam = torch.optim.NAdam(MODEL.parameters(), betas=(0.99, 0.999), decoupled_weight_decay=True)
    assert quality_warning("pipedream", 2, nadam) is None and quality_warning("pipedream", 4, nadam) is None
    assert quality_warning("pipedream", 8, nadam) is not None
    assert quality_warning("pipedream_2bw", 4, nadam) is not None


def test_families_by_class():
    built = optimizers()
    assert {name: optimizer_family(o) for name, o in built.items()} == {
        "adamw": "adamw", "adam": "adamw", "muon": "muon", "sgd": "sgd", "basis_rotation": "basis_rotation",
        "combined_adam": "adamw"}

    class MyAdam(torch.optim.AdamW):
        pass

    assert optimizer_family(MyAdam(MODEL.parameters())) == "adamw"
    assert optimizer_family(torch.optim.Adagrad(MODEL.parameters())) is None


def test_unmeasured_stage_counts_quote_the_nearest_measured_one():
    assert [nearest_stages(p) for p in (2, 3, 5, 6, 7, 16)] == [2, 4, 4, 8, 8, 8]
    message = quality_warning("pipemare", 3, optimizers()["adamw"])
    assert "at 4 stages (the nearest measured to 3)" in message
    assert measured_cost("avgpipe", 8, "sgd") == (4, 0.4)  # not run at 8: the nearest that was


def test_plan_notes_list_the_asynchronous_schedules_only():
    lines = plan_notes(["1f1b", "pipedream", "avgpipe"], 4, "adamw")
    assert any("pipedream: Adam/AdamW +7.3 %" in line for line in lines)
    assert any("avgpipe: Adam/AdamW -5.8 %" in line for line in lines)
    assert not any("1f1b:" in line for line in lines)
    assert plan_notes(["1f1b", "gpipe"], 4, "adamw") == []
    assert "Muon +2.5 %" in "".join(plan_notes(["pipedream"], 4, None))


def test_the_option_is_checked_and_documented():
    assert PipeStrategy(schedule="pipedream", quality_warning=False).options.quality_warning is False
    with pytest.raises(ValueError, match="quality_warning"):
        PipeStrategy(schedule="pipedream", quality_warning="no")
    with open("docs/options.md") as f:
        assert "`quality_warning`" in f.read()


def _fit_warnings(optimizer: str, **strategy) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train({"devices": 1, "max_steps": 1, "batch_size": 16, "model": {"optimizer": optimizer},
               "strategy": {"schedule": "pipedream_2bw", "stages": 2, "micro_batches": 4, **strategy}})
    return [w for w in caught if issubclass(w.category, AsyncQualityWarning)]


def test_an_emulated_fit_warns_once_and_the_option_or_a_filter_silences_it():
    caught = _fit_warnings("adam")
    assert len(caught) == 1 and "pipedream_2bw" in str(caught[0].message) and "at 2 stages" in str(caught[0].message)
    assert _fit_warnings("adam", quality_warning=False) == []
    assert _fit_warnings("muon") == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=AsyncQualityWarning)
        train({"devices": 1, "max_steps": 1, "batch_size": 16, "model": {"optimizer": "adam"},
               "strategy": {"schedule": "pipedream", "stages": 2, "micro_batches": 4}})
    assert not [w for w in caught if issubclass(w.category, AsyncQualityWarning)]


def test_plan_prints_the_measured_quality_next_to_speed():
    from lightning_pipe.cli.plan import plan
    from tests.harness.lightning_run import TrunkModel

    report = plan(TrunkModel(depth=2, optimizer="adam"), stages=2, batch_shape=[8, 8], schedules=["1f1b", "pipedream"],
                  micro_batches=[4], timeline=None, repeats=1)
    assert "pipedream: Adam/AdamW +10.3 %" in report.text and "1f1b:" not in report.text
    synchronous = plan(TrunkModel(depth=2), stages=2, batch_shape=[8, 8], schedules=["1f1b"], micro_batches=[4],
                       timeline=None, repeats=1)
    assert "quality:" not in synchronous.text
