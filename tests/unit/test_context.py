"""The strategy's fixed facts reach its helpers as one frozen :class:`PipeContext` (lightning/context.py): made
once per Trainer call at ``setup_environment``, replaced at most once (avgpipe's tuner), never after the pipeline
and its runtime were built with it."""

from __future__ import annotations

import copy
import dataclasses

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_pipe import PipeStrategy
from lightning_pipe.lightning import strategy as strategy_module
from lightning_pipe.lightning.context import PipeContext
from tests.harness.lightning_run import TrunkModel, make_data


def _context(**changes) -> PipeContext:
    facts = dict(options=PipeStrategy().options, topology=None, watchdog=None, transport=None, root_device=torch.device("cpu"),
                 precision_plugin=None, num_stages=1, num_pipelines=1, emulating=False, global_rank=0, world_size=1,
                 tagged=True)
    return PipeContext(**{**facts, **changes})  # type: ignore[arg-type]


def test_the_context_is_frozen_and_adopts_options_once_before_the_pipeline_exists():
    context = _context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.options = PipeStrategy(micro_batches=2).options  # type: ignore[misc]
    tuned = PipeStrategy(micro_batches=2).options
    adopted = context.adopt(tuned, built=False)
    assert adopted.options is tuned and adopted.adopted and not context.adopted and context.options.micro_batches == 4
    assert adopted.topology is context.topology and adopted.root_device == context.root_device
    with pytest.raises(RuntimeError, match="replaced twice"):
        adopted.adopt(tuned, built=False)
    with pytest.raises(RuntimeError, match="after the pipeline"):
        context.adopt(tuned, built=True)


class _Spy:
    """Counts the contexts ``PipeStrategy`` makes and the replacements it asks for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list[PipeContext] = []
        self.adopted: list[PipeContext] = []
        made, adopt = self.made, self.adopted
        original = PipeContext.adopt

        def counted(**facts) -> PipeContext:
            context = PipeContext(**facts)
            made.append(context)
            return context

        def counted_adopt(context: PipeContext, options, *, built: bool) -> PipeContext:
            result = original(context, options, built=built)
            adopt.append(result)
            return result

        monkeypatch.setattr(strategy_module, "PipeContext", counted)
        monkeypatch.setattr(PipeContext, "adopt", counted_adopt)


def _trainer(strategy: PipeStrategy, steps: int = 2) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=1)


def test_one_context_per_trainer_call_shared_by_the_pipeline_runtime_and_metrics(monkeypatch):
    spy = _Spy(monkeypatch)
    strategy = PipeStrategy(schedule="1f1b", stages=2, micro_batches=2)
    trainer = _trainer(strategy)
    model = TrunkModel()
    trainer.fit(model, DataLoader(make_data(32), batch_size=8))
    assert len(spy.made) == 1 and not spy.adopted
    context = strategy.context
    assert context is spy.made[0] and context.emulating and context.num_stages == 2 and context.options is strategy.options
    assert strategy._pipeline.context is context and strategy._runtime.context is context
    assert strategy._metrics.context is context and strategy._pipeline.module is model
    with pytest.raises(RuntimeError, match="after the pipeline"):  # the pipeline and the runtime were built with it
        strategy._adopt_options(strategy.options)

    trainer.validate(model, DataLoader(make_data(16), batch_size=8), verbose=False)
    assert len(spy.made) == 2 and not spy.adopted  # a new call, new watchdog and groups: a new context
    assert strategy.context is spy.made[1] and strategy._pipeline.context is strategy.context


def test_avgpipes_tuner_replaces_the_context_once_before_the_cut(monkeypatch):
    spy = _Spy(monkeypatch)
    strategy = PipeStrategy(schedule="avgpipe", micro_batches="auto", avgpipe={"parallel_pipelines": "auto", "advance_forward": "auto"})
    trainer = _trainer(strategy)
    trainer.fit(TrunkModel(), DataLoader(make_data(32), batch_size=16))
    assert len(spy.made) == 1 and len(spy.adopted) == 1
    context = strategy.context
    assert context is spy.adopted[0] and context.adopted and context.options is strategy.options
    assert spy.made[0].options.micro_batches == "auto" and context.options.micro_batches == strategy.micro_batches != "auto"
    assert strategy._pipeline.context is context and strategy._runtime.context is context
    with pytest.raises(RuntimeError):  # after the pipeline exists (and a second time)
        strategy._adopt_options(strategy.options)


def test_a_later_call_with_another_module_cuts_and_runs_that_module():
    """``trainer.validate(Model.load_from_checkpoint(...))`` after a fit: the strategy's pipeline was cut from the fitted
    module, so the new instance is cut anew and its own weights are evaluated (one device's value), then trained."""
    strategy = PipeStrategy(schedule="1f1b", stages=2, micro_batches=2)
    trainer = _trainer(strategy)
    trainer.fit(TrunkModel(), DataLoader(make_data(32), batch_size=8))
    other = TrunkModel()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    loader = DataLoader(make_data(16, seed=1), batch_size=8)
    one_device = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                           limit_val_batches=1)  # as _trainer
    expected = one_device.validate(copy.deepcopy(other), loader, verbose=False)[0]["val_loss"]
    assert trainer.validate(other, loader, verbose=False)[0]["val_loss"] == pytest.approx(expected, abs=1e-6)
    before = [p.detach().clone() for p in other.parameters()]
    trainer.fit_loop.epoch_loop.max_steps = 4  # two more steps, on the other module
    trainer.fit(other, DataLoader(make_data(32), batch_size=8))
    assert all(not torch.equal(a, p) for a, p in zip(before, other.parameters()))
