"""Each private Lightning name ``lightning/_compat.py`` relies on is still there and still behaves as used.

A failure here means Lightning changed one of its internals: the message names which, and the fix goes in
``_compat.py`` alone (tests/unit/test_private_names.py keeps every other module off them).
"""

from __future__ import annotations

import inspect
import operator
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from lightning.pytorch.utilities.model_summary import summarize
from torchmetrics import MeanMetric

from lightning_pipe.lightning import _compat

CPU = torch.device("cpu")


def _changed(what: str) -> str:
    return f"Lightning changed {what}; adapt lightning_pipe/lightning/_compat.py"


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def configure_optimizers(self):
        return {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)}

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch.to(device) + 1

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch * 10


@pytest.fixture
def trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)


def _ddp(devices: int = 2) -> DDPStrategy:
    strategy = DDPStrategy(parallel_devices=[CPU] * devices)
    strategy.cluster_environment = LightningEnvironment()
    return strategy


# ------------------------------------------------------------------------------- launching
def test_script_launcher_is_what_ddp_starts_scripts_with():
    strategy = _ddp()
    strategy._configure_launcher()  # the hook PipeStrategy overrides
    assert _compat.is_script_launcher(strategy.launcher), _changed(
        f"DDPStrategy's launcher for start_method='popen' (now {type(strategy.launcher).__name__}, was _SubprocessScriptLauncher)")
    parameters = list(inspect.signature(_compat.ScriptLauncher.__init__).parameters)
    assert parameters[1:4] == ["cluster_environment", "num_processes", "num_nodes"], _changed(
        f"_SubprocessScriptLauncher.__init__'s arguments ({parameters[1:]}); PipeLauncher passes them")
    assert hasattr(strategy.launcher, "procs") and callable(getattr(strategy.launcher, "kill", None)), _changed(
        "_SubprocessScriptLauncher's procs / kill, which the strategy forwards SIGTERM through")


def test_start_children_calls_the_launchers_own_starter(monkeypatch: pytest.MonkeyPatch):
    starter = getattr(_compat.ScriptLauncher, "_call_children_scripts", None)
    assert callable(starter), _changed("_SubprocessScriptLauncher._call_children_scripts (starting the other local ranks)")
    assert list(inspect.signature(starter).parameters) == ["self"], _changed("_call_children_scripts' arguments")
    started = []
    monkeypatch.setattr(_compat.ScriptLauncher, "_call_children_scripts", lambda launcher: started.append(launcher))
    launcher = _compat.ScriptLauncher(LightningEnvironment(), 2, 1)
    _compat.start_children(launcher)  # no process is started: the starter is replaced above
    assert started == [launcher]


def test_set_num_threads_if_needed(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        _compat.set_num_threads_if_needed(1)
        assert os.environ.get("OMP_NUM_THREADS"), _changed("_set_num_threads_if_needed (it no longer sets OMP_NUM_THREADS)")
    finally:
        torch.set_num_threads(threads)


def test_set_launcher_is_what_the_launcher_property_reads():
    strategy, launcher = _ddp(), object()
    _compat.set_launcher(strategy, launcher)
    assert strategy.launcher is launcher, _changed("Strategy._launcher (the attribute behind Strategy.launcher)")


# ------------------------------------------------------------------------------- the strategy's own state
def test_process_group_backend_defaults_by_device():
    strategy = _ddp(1)
    assert _compat.process_group_backend(strategy) == "gloo", _changed("DDPStrategy._get_process_group_backend")
    strategy = DDPStrategy(parallel_devices=[CPU], process_group_backend="nccl")
    assert _compat.process_group_backend(strategy) == "nccl", _changed("DDPStrategy._get_process_group_backend")


def test_module_hidden_hides_the_module_from_the_strategy():
    strategy, module = _ddp(1), Tiny()
    strategy.connect(module)
    with _compat.module_hidden(strategy):
        assert strategy.lightning_module is None, _changed("Strategy._lightning_module (behind Strategy.lightning_module)")
    assert strategy.lightning_module is module


# ------------------------------------------------------------------------------- trainer state
def test_set_received_sigterm(trainer: L.Trainer):
    assert not trainer.received_sigterm
    _compat.set_received_sigterm(trainer)
    assert trainer.received_sigterm, _changed("trainer._signal_connector.received_sigterm (behind Trainer.received_sigterm)")


def test_loaded_checkpoint_is_empty_before_a_restore(trainer: L.Trainer):
    assert hasattr(trainer._checkpoint_connector, "_loaded_checkpoint"), _changed("trainer._checkpoint_connector._loaded_checkpoint")
    assert _compat.loaded_checkpoint(trainer) == {}
    trainer._checkpoint_connector._loaded_checkpoint = {"key": 1}
    assert _compat.loaded_checkpoint(trainer) == {"key": 1}


def test_should_accumulate_follows_accumulate_grad_batches():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, accumulate_grad_batches=2, enable_progress_bar=False)
    trainer.fit_loop.epoch_loop.batch_progress.increment_ready()  # the first batch of a window of two
    assert _compat.should_accumulate(trainer) is True, _changed("fit_loop._should_accumulate")
    trainer.fit_loop.epoch_loop.batch_progress.increment_ready()
    assert _compat.should_accumulate(trainer) is False, _changed("fit_loop._should_accumulate")


@pytest.mark.parametrize("fn, stage, loop", [
    (TrainerFn.FITTING, RunningStage.TRAINING, "fit_loop.epoch_loop"),
    (TrainerFn.FITTING, RunningStage.SANITY_CHECKING, "fit_loop.epoch_loop.val_loop"),
    (TrainerFn.FITTING, RunningStage.VALIDATING, "fit_loop.epoch_loop.val_loop"),
    (TrainerFn.VALIDATING, RunningStage.VALIDATING, "validate_loop"),
    (TrainerFn.TESTING, RunningStage.TESTING, "test_loop"),
    (TrainerFn.PREDICTING, RunningStage.PREDICTING, "predict_loop"),
])
def test_batch_is_last_reads_the_running_loops_progress(trainer: L.Trainer, fn, stage, loop: str):
    trainer.state.fn, trainer.state.stage = fn, stage
    progress = operator.attrgetter(loop)(trainer).batch_progress
    for last in (True, False):
        progress.is_last_batch = last
        assert _compat.batch_is_last(trainer) is last, _changed(f"{loop}.batch_progress.is_last_batch")


def test_logs_this_step_follows_log_every_n_steps():
    trainer = L.Trainer(accelerator="cpu", devices=1, log_every_n_steps=3, enable_progress_bar=False)
    trainer.state.fn, trainer.training = TrainerFn.FITTING, True  # inside fit's training loop
    loop = trainer.fit_loop.epoch_loop
    answers = []
    for step in range(4):
        loop._batches_that_stepped = step
        answers.append(_compat.logs_this_step(trainer))
    assert answers == [False, False, True, False], _changed(f"_logger_connector.should_update_logs ({answers})")


@pytest.mark.parametrize("loop_name, name", [("fit_loop", "train_dataloader"), ("validate_loop", "val_dataloader"),
                                             ("test_loop", "test_dataloader"), ("predict_loop", "predict_dataloader")])
def test_loop_data_source(trainer: L.Trainer, loop_name: str, name: str):
    source = _compat.loop_data_source(trainer, loop_name)
    assert source.name == name and callable(source.is_defined) and callable(source.dataloader), _changed(
        f"{loop_name}._data_source (its name, is_defined() or dataloader())")


def test_transfer_batch_runs_the_transfer_hooks():
    module = Tiny()  # outside a Trainer, the hooks are called directly
    assert torch.equal(_compat.transfer_batch(module, torch.zeros(2)), torch.full((2,), 10.0)), _changed(
        "LightningModule._apply_batch_transfer_handler (transfer_batch_to_device, then on_after_batch_transfer)")


# ------------------------------------------------------------------------------- optimizers
def test_module_optimizers_reads_every_return_form():
    optimizers = _compat.module_optimizers(Tiny())
    assert len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.SGD), _changed("_configure_optimizers")


def test_init_optimizers(trainer: L.Trainer):
    module = Tiny()
    trainer.strategy.connect(module)
    module.trainer = trainer
    optimizers = _compat.init_optimizers(module)
    assert len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.SGD), _changed("_init_optimizers_and_lr_schedulers")


def test_optimizers_to_device_moves_the_state():
    module = Tiny()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module.layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    buffer = optimizer.state[module.layer.weight]["momentum_buffer"]
    _compat.optimizers_to_device([optimizer], torch.device("meta"))
    assert optimizer.state[module.layer.weight]["momentum_buffer"].device.type == "meta", _changed("_optimizers_to_device")
    assert buffer.device == CPU


# ------------------------------------------------------------------------------- collectives
def test_sync_ddp_if_available_without_a_process_group():
    tensor = torch.tensor([3.0])
    assert _compat.sync_ddp_if_available(tensor, None, "mean") is tensor, _changed("_sync_ddp_if_available")
    parameters = inspect.signature(_compat.sync_ddp_if_available).parameters
    assert "reduce_op" in parameters


# ------------------------------------------------------------------------------- precision
def test_route_gradient_clipping_is_what_clip_gradients_calls():
    precision, calls = Precision(), []
    _compat.route_gradient_clipping(precision, lambda optimizer, clip_val: calls.append((optimizer, clip_val)))
    optimizer = torch.optim.SGD(Tiny().parameters(), lr=0.1)
    precision.clip_gradients(optimizer, 1.5, GradClipAlgorithmType.NORM)
    assert calls == [(optimizer, 1.5)], _changed("Precision.clip_gradients (it no longer clips through clip_grad_by_norm)")


# ------------------------------------------------------------------------------- model summary
def test_model_pruning_internals():
    from lightning.pytorch.callbacks import ModelPruning

    assert _compat.prunes_globally(ModelPruning("l1_unstructured", amount=0.3)), _changed("ModelPruning._use_global_unstructured")
    assert not _compat.prunes_globally(ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=False))


def test_model_summary_internals():
    callback = ModelSummary(max_depth=3)
    assert _compat.summary_depth(callback) == 3, _changed("ModelSummary._max_depth")
    data = _compat.summary_data(summarize(Tiny(), max_depth=1))
    assert "layer" in dict(data).get("Name", []), _changed("ModelSummary._get_summary_data")
    assert list(inspect.signature(ModelSummary._summary).parameters) == ["self", "trainer", "pl_module"], _changed(
        "ModelSummary._summary(trainer, pl_module), which on_fit_start calls")
    marker = object()
    _compat.replace_summary(callback, lambda trainer, pl_module: marker)
    assert callback._summary(None, None) is marker


# ------------------------------------------------------------------------------- torchmetrics
def test_metric_bookkeeping():
    metric = MeanMetric()
    before = _compat.metric_bookkeeping(metric)
    assert set(before) == set(_compat.METRIC_BOOKKEEPING) and before["_update_count"] == 0, "torchmetrics changed Metric's bookkeeping"
    metric(torch.tensor(2.0))
    metric.compute()
    after = _compat.metric_bookkeeping(metric)
    assert after["_update_count"] == 1 and after["_computed"] is not None and after["_forward_cache"] is not None, (
        "torchmetrics changed Metric's bookkeeping (_update_count, _computed, _forward_cache)")
    _compat.forget_computed(metric)
    assert _compat.metric_bookkeeping(metric)["_computed"] is None


def test_every_compat_function_has_a_test_here():
    import ast
    from pathlib import Path

    names = [n.name for n in ast.parse(Path(_compat.__file__).read_text()).body
             if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    source = Path(__file__).read_text()
    untested = [name for name in names if f"_compat.{name}(" not in source]
    assert not untested, f"lightning/_compat.py functions without a test in {Path(__file__).name}: {untested}"
