"""Bad configurations fail early with one sentence that says what to change."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipe
from lightning_pipe import PipeConfigError, PipeStrategy
from tests.harness.lightning_run import TrunkModel


def connect(model: L.LightningModule, devices: int = 2, **options) -> list[int]:
    """Run the strategy's pre-launch checks without launching processes; return the trunk layers per stage."""
    trainer = L.Trainer(strategy=PipeStrategy(**options), accelerator="cpu", devices=devices, logger=False)
    trainer.strategy.connect(model)
    return trainer.strategy.layer_counts


class TwoTrunks(TrunkModel):
    """An encoder next to a decoder of the same size: which one to split is the user's call."""

    def __init__(self):
        super().__init__()
        self.other = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())])


class NoTrunk(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)


class Manual(TrunkModel):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


def test_strategy_names_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"):
        assert name in StrategyRegistry
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, PipeStrategy) and trainer.strategy.schedule == name
    import importlib

    importlib.reload(lightning_pipe)  # a second import must not raise "already registered"


@pytest.mark.parametrize(
    "make,kwargs,match",
    [
        (TrunkModel, {"devices": 3, "stages": 2}, r"stages=2 × pipelines=1 needs 2 processes .* set devices=2"),
        (TrunkModel, {"devices": 3, "pipelines": 2}, r"3 processes .* cannot form 2 pipelines"),
        (lambda: TrunkModel(depth=1), {"devices": 2, "schedule": "interleaved_1f1b", "chunks_per_stage": 2},
         r"trunk has 2 layers but the pipeline needs 4 stages"),
        (TrunkModel, {"balance": [5, 5]}, r"sums to 10 but the trunk has 12 layers"),
        (TrunkModel, {"balance": [12]}, r"balance has 1 entries but the pipeline has 2 stages"),
        (TrunkModel, {"schedule": "interleaved_1f1b", "micro_batches": 3}, r"multiple of stages; .* micro_batches=4"),
        (TrunkModel, {"schedule": "dualpipev", "micro_batches": 3}, r"dualpipev needs micro_batches >= 2 \* stages; .* "
                                                                     r"micro_batches=4 or more"),
        (Manual, {}, r"manual optimization"),
        (NoTrunk, {}, r"no nn.Sequential or nn.ModuleList with parameters"),
        (TwoTrunks, {}, r"several containers .*model \(Sequential of 12, 1,632 parameters\); other \(Sequential of 12, "
                        r"1,632 parameters\).*PipeStrategy\(module='model'\) or module='other'"),
        (TrunkModel, {"module": "head"}, r"head is a Linear, not an nn.Sequential"),
    ],
)
def test_bad_configuration(make, kwargs, match):
    devices = kwargs.pop("devices", 2)
    with pytest.raises(PipeConfigError, match=match):
        connect(make(), devices=devices, **kwargs)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"schedule": "pipemagic"}, "schedule='pipemagic' is not available"),
        ({"micro_batches": 0}, "micro_batches=0 must be at least 1"),
        ({"schedule": "1f1b", "chunks_per_stage": 2}, "only applies to schedule='interleaved_1f1b' or schedule='zbv' or "
                                                      "schedule='dualpipev'"),
        ({"schedule": "zbv", "chunks_per_stage": 3}, "zbv' places exactly 2 chunks per device; leave chunks_per_stage unset"),
        ({"schedule": "zb_h1", "checkpoint_activations": True}, "recompute the forward in every one of them; use "
                                                                 "checkpoint_activations=False, or schedule='1f1b'"),
        *[({"schedule": schedule, "checkpoint_activations": True}, f"schedule='{schedule}' keeps no copy of the weights a "
           "forward ran on, so checkpoint_activations=True would recompute each forward on its backward's weights")
          for schedule in ("pipemare", "xpipe")],
        ({"balance": "foo"}, "balance='foo' is not known; use 'uniform', 'parameters', 'auto'"),
        ({"micro_batch": 4}, r"PipeStrategy has no option 'micro_batch'; did you mean micro_batches=\?"),
        ({"timeout": 0}, "timeout=0.0 must be a positive number of seconds"),
        ({"checkpoint_timeout": -1}, "checkpoint_timeout=-1.0 must be a positive number of seconds"),
        ({"pipedream_2bw": {"lookahead": -1}}, "pipedream_2bw lookahead=-1 must be a number >= 0"),
        ({"pipedream_2bw": {"delay_compensation": -1}}, "pipedream_2bw delay_compensation=-1 must be a number >= 0"),
        ({"pipedream_2bw": {"delay_compensation_decay": 1.0}}, "delay_compensation_decay=1.0 must be in \\[0, 1\\)"),
        ({"pipedream_2bw": {"look_ahead": 1}}, "pipedream_2bw= has no option look_ahead; DoubleBufferOptions takes .*lookahead"),
        ({"xpipe": {"distances": "rounded"}}, "xpipe distances='rounded' is not known; use 'paper' .* or 'exact'"),
        ({"xpipe": {"momentum_direction": "nesterov"}}, "xpipe momentum_direction='nesterov' is not known; use 'buffer'"),
        ({"pipemare": {"correction_decay_rule": "adaptive"}}, "pipemare correction_decay_rule='adaptive' is not known; use 'fixed'"),
        ({"pipedream": {"vertical_sync": "yes"}}, "pipedream vertical_sync='yes' must be True or False"),
        ({"xpipe": {"prediction": "adamw"}}, "xpipe prediction='adamw' is not known; use one of 'auto', 'adam'"),
        ({"pipemare": {"correction": "no"}}, "pipemare correction='no' must be True or False"),  # a truthy string
        ({"pipemare": {"lr_reschedule": "off"}}, "pipemare lr_reschedule='off' must be True or False"),
        ({"pipemare": {"correction_decay": 1.5}}, r"pipemare correction_decay=1.5 must be in \[0, 1\).*correction=False"),
        ({"pipemare": {"lr_warmup_steps": 0}}, "pipemare lr_warmup_steps=0 must be .* at least 1; .* lr_reschedule=False"),
        ({"avgpipe": {"parallel_pipelines": "4"}}, "avgpipe parallel_pipelines='4' must be a whole number or 'auto'"),
        ({"avgpipe": {"period": 1.5}}, "avgpipe period=1.5 must be a whole number"),
        ({"schedule": "pipedream", "delay_warmup_steps": -5}, "delay_warmup_steps=-5 must be a whole number, at least 0"),
        ({"schedule": "gpipe", "delay_warmup_steps": 50}, "delay_warmup_steps=50 warms up stages whose gradients are stale, "
                                                          "which only the schedules 'pipedream', .* have; leave it at 0 for 'gpipe'"),
        ({"shape_headers": "never"}, "shape_headers='never' is not known; use 'on_change'"),
        ({"transport": "tcp"}, "transport='tcp' is not known; use 'auto' .* 'shared_memory' or 'process_group'"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(PipeConfigError, match=match):
        PipeStrategy(**options)


@pytest.mark.parametrize("schedule", ["pipemare", "1f1b"])
def test_a_one_stage_pipeline_is_not_silent(schedule):
    """Trainer(strategy=name) on CPU without devices runs one process: say so, and what to set."""
    import warnings

    with pytest.warns(UserWarning, match=r"one-stage pipeline .* Trainer\(devices=N\) .* PipeStrategy\(stages=N\)"):
        connect(TrunkModel(), devices=1, schedule=schedule)
    with warnings.catch_warnings():  # two processes, or an emulated pipeline: no warning
        warnings.filterwarnings("error", message=".*one-stage pipeline.*")
        connect(TrunkModel(), devices=2, schedule=schedule)
        connect(TrunkModel(), devices=1, schedule=schedule, stages=2)


@pytest.mark.parametrize("name,layers", [("model", 12), ("other", 14)])
def test_named_trunk_is_used(name, layers):
    """The name resolves the ambiguity, and the named container is the one split (14 layers in ``other``)."""
    model = TwoTrunks()
    model.other = nn.Sequential(*[m for _ in range(7) for m in (nn.Linear(16, 16), nn.Tanh())])
    assert sum(connect(model, module=name)) == layers












@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "pipemare", "xpipe"])
def test_asynchronous_schedules_refuse_data_parallel_pipelines(schedule):
    """Each pipeline's stages would step on their own gradients, so the replicas would diverge."""
    with pytest.raises(PipeConfigError, match=rf"schedule='{schedule}' steps each stage inside the pipeline"):
        connect(TrunkModel(), devices=4, schedule=schedule, stages=2, pipelines=2)
    connect(TrunkModel(), devices=4, schedule="avgpipe", stages=2, pipelines=2)  # its replicas average gradients


def test_stochastic_weight_averaging_is_refused_beside_several_stages():
    """SWA's copy of the whole model is averaged against a rank's own parameters, one stage's under a pipeline (on 2
    processes Lightning's callback failed on mismatched shapes); the emulation refuses it as the processes would."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lightning_pipe.lightning.checks import check_callbacks

    trainer = L.Trainer(strategy=PipeStrategy(schedule="1f1b", stages=2, micro_batches=2), accelerator="cpu", devices=1,
                        max_steps=1, callbacks=[StochasticWeightAveraging(swa_lrs=0.05)], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))
    with pytest.raises(PipeConfigError, match=r"StochasticWeightAveraging keeps a copy of the whole model.*AveragedModel"):
        trainer.fit(TrunkModel(), DataLoader(data, batch_size=8))
    check_callbacks([StochasticWeightAveraging(swa_lrs=0.05)], stages=1)  # whole model on every rank: fine


@pytest.mark.parametrize("schedule", ["pipemare", "pipedream_2bw", "avgpipe"])
def test_a_gradient_accumulation_scheduler_is_refused_where_accumulation_is(schedule):
    """The callback sets accumulate_grad_batches at an epoch's start, after the check of the Trainer's own value:
    pipemare then trained its second epoch with Lightning accumulating batches the pipeline had stepped on."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_pipe.lightning.checks import check_trainer
    from lightning_pipe.registry import spec

    trainer = L.Trainer(strategy=PipeStrategy(schedule=schedule, stages=2, micro_batches=2), accelerator="cpu",
                        devices=1, max_steps=1, callbacks=[GradientAccumulationScheduler({0: 1, 1: 3})], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(PipeConfigError, match=r"GradientAccumulationScheduler\(\{0: 1, 1: 3\}\) would accumulate"):
        trainer.fit(TrunkModel(), DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,))), batch_size=8))
    check_trainer(spec("1f1b"), 1, 1, [GradientAccumulationScheduler({0: 1, 1: 3})])  # a flushed step accumulates exactly


def test_global_model_pruning_is_refused_beside_several_stages():
    """Each stage ranked only its own weights: on 2 processes the pruned weights differed from one device's. Pruning
    each layer on its own is exact (checked by hand on 2 processes; the emulation equals one device either way)."""
    from lightning.pytorch.callbacks import ModelPruning

    from lightning_pipe.lightning.checks import check_callbacks

    trainer = L.Trainer(strategy=PipeStrategy(schedule="1f1b", stages=2, micro_batches=2), accelerator="cpu", devices=1,
                        max_steps=1, callbacks=[ModelPruning("l1_unstructured", amount=0.3)], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(PipeConfigError, match=r"use_global_unstructured=True.*use_global_unstructured=False"):
        trainer.fit(TrunkModel(), DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,))), batch_size=8))
    check_callbacks([ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=False)], stages=2)
    check_callbacks([ModelPruning("l1_unstructured", amount=0.3)], stages=1)


def test_weight_averaging_is_refused_beside_several_stages():
    """EMAWeightAveraging's copy of the whole module, made before the cut, failed on 2 processes at the first validation
    (mismatched shapes), as SWA's did; the emulation refuses it too."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lightning_pipe.lightning.checks import check_callbacks

    trainer = L.Trainer(strategy=PipeStrategy(schedule="1f1b", stages=2, micro_batches=2), accelerator="cpu", devices=1,
                        max_steps=1, callbacks=[EMAWeightAveraging(decay=0.9)], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(PipeConfigError, match=r"EMAWeightAveraging keeps an averaged copy of the whole module"):
        trainer.fit(TrunkModel(), DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,))), batch_size=8))
    check_callbacks([EMAWeightAveraging(decay=0.9)], stages=1)


class LBFGSModel(TrunkModel):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)


def test_lbfgs_is_refused_beside_several_stages():
    """LBFGS's direction and line search take dot products over every parameter: on 2 processes it wrote into another
    stage's stand-in parameters (``unsupported operation: more than one element of the written-to tensor``), and the
    stages' searches could run the closure a different number of times. The emulation refuses it as the processes
    would; one stage holds every parameter and steps as one device."""
    from lightning_pipe.lightning.checks import check_optimizers

    trainer = L.Trainer(strategy=PipeStrategy(schedule="1f1b", stages=2, micro_batches=2), accelerator="cpu", devices=1,
                        max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))
    with pytest.raises(PipeConfigError, match=r"LBFGS takes its search direction .* first-order optimizer"):
        trainer.fit(LBFGSModel(), DataLoader(data, batch_size=8))
    check_optimizers([torch.optim.LBFGS([nn.Parameter(torch.zeros(2))])], stages=1)
    combined = lightning_pipe.optim.CombinedOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1),
                                                      torch.optim.LBFGS([nn.Parameter(torch.zeros(2))]))
    with pytest.raises(PipeConfigError, match="LBFGS"):
        check_optimizers([combined], stages=2)
