"""Lightning's private names this package relies on, in one place.

Each function says what it needs from Lightning 2.6 and why no public API serves; when Lightning
changes one of these, only this module changes. ``tests/unit/test_compat.py`` checks every one of
them against the installed Lightning (and names what changed), and ``tests/unit/test_private_names.py``
checks that no other module imports or reads a private Lightning name.

torchmetrics' private bookkeeping (a Lightning-AI package with the same risk) lives here too.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

#: Lightning's launcher that re-runs the script once per local rank (``Trainer(devices=N)`` from a plain
#: ``python train.py``). :class:`~.launcher.PipeLauncher` subclasses it to run the model checks before the
#: other ranks start and to watch them; Lightning exports no public launcher class to build on.
ScriptLauncher = _SubprocessScriptLauncher


# ------------------------------------------------------------------------------- launching
def is_script_launcher(launcher: Any) -> bool:
    """Whether ``launcher`` is exactly Lightning's script launcher (not a subclass, not another launcher):
    only that one is replaced by :class:`~.launcher.PipeLauncher`."""
    return type(launcher) is _SubprocessScriptLauncher


def start_children(launcher: Any) -> None:
    """Start the other local ranks as Lightning's script launcher does (``_call_children_scripts``: the
    command line, environment and ``procs`` bookkeeping); :class:`~.launcher.PipeLauncher.launch` replaces
    ``launch`` to check first and observe after, and no public method starts the children alone."""
    launcher._call_children_scripts()


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's default of ``torch.set_num_threads`` per process (``_set_num_threads_if_needed``), which its
    own ``launch`` calls and :class:`~.launcher.PipeLauncher.launch`, replacing ``launch``, must call too."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    _set_num_threads_if_needed(num_processes=num_processes)


def set_launcher(strategy: Any, launcher: Any) -> None:
    """Make ``launcher`` the strategy's launcher (``Strategy._launcher``: ``launcher`` is a read-only property, and
    ``_configure_launcher``, the hook that sets it, is itself Lightning's private name)."""
    strategy._launcher = launcher


# ------------------------------------------------------------------------------- the strategy's own state
def process_group_backend(strategy: Any) -> str:
    """The backend the strategy will create its process group with (``DDPStrategy._get_process_group_backend``:
    the user's choice, else Lightning's default for the device). The public ``process_group_backend`` is ``None``
    until ``setup_distributed``, which itself needs the answer first."""
    return strategy._get_process_group_backend()


@contextmanager
def module_hidden(strategy: Any) -> Generator[None, None, None]:
    """Within: the strategy holds no LightningModule (``Strategy._lightning_module``; ``lightning_module`` has no
    setter), so that Lightning's ``teardown`` does not move a module that still has meta tensors to the CPU."""
    module = strategy._lightning_module
    strategy._lightning_module = None
    try:
        yield
    finally:
        strategy._lightning_module = module


# ------------------------------------------------------------------------------- trainer state
def set_received_sigterm(trainer: Any) -> None:
    """Mark the run as preempted, as Lightning's own SIGTERM handler does (``_SignalConnector.received_sigterm``):
    the loops then stop at their next batch boundary with ``SIGTERMException``, which runs the callbacks'
    ``on_exception`` (``OnExceptionCheckpoint``, ``ModelCheckpoint(save_on_exception=True)``).

    Lightning's handler sets it from inside the signal handler and then calls ``dist.broadcast`` there,
    which deadlocks a distributed job (the ranks are not at the same collective); this package sets it
    on every rank at once, after the ranks agreed at a step boundary (:mod:`.preemption`)."""
    trainer._signal_connector.received_sigterm = True


def loaded_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint ``fit(ckpt_path=...)`` is restoring, already read, or ``{}``
    (``trainer._checkpoint_connector._loaded_checkpoint``). The strategy's setup needs its split and avgpipe's
    tuned values before the model is cut; Lightning hands the checkpoint to the public hooks
    (``on_load_checkpoint``) only after setup."""
    return trainer._checkpoint_connector._loaded_checkpoint or {}


def batch_is_last(trainer: Any) -> bool:
    """Whether the batch now running ends its loop's epoch: the ``batch_progress.is_last_batch`` of the loop that runs
    (training, validation during fit or the sanity check, ``validate``, ``test``, ``predict``). Lightning sets it when it
    fetches the batch (its fetcher reads one batch ahead); no public property says which loop runs."""
    stage = trainer.state.stage
    if stage == RunningStage.TRAINING:
        loop = trainer.fit_loop.epoch_loop
    elif stage in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING):
        loop = trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == TrainerFn.FITTING else trainer.validate_loop
    elif stage == RunningStage.TESTING:
        loop = trainer.test_loop
    else:
        loop = trainer.predict_loop
    return bool(loop.batch_progress.is_last_batch)


def should_accumulate(trainer: Any) -> bool:
    """Whether this training batch only accumulates gradients (no optimizer step after it:
    ``fit_loop._should_accumulate``). Lightning decides it from ``accumulate_grad_batches``, the batch index and
    the end of the epoch; the flushing runtime must know it inside the step (to overlap the gradient all-reduce
    or not) and no public property says it."""
    return bool(trainer.fit_loop._should_accumulate())


def logs_this_step(trainer: Any) -> bool:
    """Whether Lightning logs the current training step (``_logger_connector.should_update_logs``:
    ``log_every_n_steps``, the last batch, ``fast_dev_run``); per-stage metrics are only measured then, and the
    rule has no public name."""
    return bool(trainer._logger_connector.should_update_logs)


def loop_data_source(trainer: Any, loop_name: str) -> Any:
    """The data source of the loop ``loop_name`` (``fit_loop._data_source``: a ``DataLoader`` given to ``fit``, or the
    module's / datamodule's ``*_dataloader()``). ``balance="auto"`` profiles the loop's first batch at setup, before
    the loop itself has loaded its dataloaders, and Lightning offers no public way to ask a loop for its source."""
    return getattr(trainer, loop_name)._data_source


def transfer_batch(module: Any, batch: Any) -> Any:
    """``batch`` on the module's device after its transfer hooks (``LightningModule._apply_batch_transfer_handler``:
    ``transfer_batch_to_device``, then ``on_after_batch_transfer``, through the Trainer when attached), as the training
    step receives it; Lightning runs that pair only inside its loops."""
    return module._apply_batch_transfer_handler(batch)


# ------------------------------------------------------------------------------- optimizers
def module_optimizers(module: Any) -> list[Any]:
    """The optimizers ``module.configure_optimizers()`` returns, in any of its return forms (``_configure_optimizers``:
    Lightning's own reading of them, which it offers no public name for). Raises what the hook raises, e.g. outside
    a Trainer."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    return optimizers


def init_optimizers(module: Any) -> list[Any]:
    """The optimizers as the Trainer sets them up (``_init_optimizers_and_lr_schedulers``: the hook called through
    the Trainer, its return forms read and checked), without installing them; avgpipe's tuner learns the user's
    optimizer class and defaults from the first."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    return _init_optimizers_and_lr_schedulers(module)[0]


def optimizers_to_device(optimizers: list[Any], device: torch.device) -> None:
    """Move the optimizers' state to ``device`` (``_optimizers_to_device``), as Lightning's strategies do after
    restoring it; the strategy restores each stage's share itself, so it must move it too."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


# ------------------------------------------------------------------------------- collectives
def sync_ddp_if_available(tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
    """Lightning's reduction of a tensor over ``group`` (``_sync_ddp_if_available``: ``"mean"``/``"sum"``/a
    ``ReduceOp``, float promotion and the mean's division as ``self.log(sync_dist=True)`` expects them);
    reimplementing it would risk a different mean than Lightning's other strategies."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


# ------------------------------------------------------------------------------- precision
def route_gradient_clipping(precision: Any, clip_by_norm: Callable[[Any, float], None]) -> None:
    """Make ``precision`` clip by norm with ``clip_by_norm(optimizer, clip_val)`` (an instance attribute shadowing
    ``Precision.clip_grad_by_norm``). Lightning clips with this rank's parameters only, and a pipeline needs the norm
    over every stage; neither the strategy nor the precision plugin has a hook for how norms are computed."""
    precision.clip_grad_by_norm = clip_by_norm


# ------------------------------------------------------------------------------- model summary
def summary_depth(callback: Any) -> int:
    """The ``max_depth`` a ``ModelSummary`` callback was made with (``_max_depth``; no public reader)."""
    return int(callback._max_depth)


def summary_data(summary: Any) -> list[tuple[str, list[str]]]:
    """The table of a ``lightning.pytorch.utilities.model_summary.ModelSummary`` (``_get_summary_data``, which the
    callback itself reads; a frozen summary must give the callback the same columns)."""
    return summary._get_summary_data()


def replace_summary(callback: Any, make: Callable[[Any, Any], Any]) -> None:
    """Make a ``ModelSummary`` callback summarise with ``make(trainer, pl_module)`` (an instance attribute shadowing
    ``ModelSummary._summary``): at fit start each rank holds only its stage, and the callback has no hook to be given
    the whole model's summary."""
    callback._summary = make


# ------------------------------------------------------------------------------- pruning
def prunes_globally(callback: Any) -> bool:
    """Whether a ``ModelPruning`` callback ranks every pruned tensor together (``use_global_unstructured``, its
    default; kept as ``_use_global_unstructured``, no public reader)."""
    return bool(callback._use_global_unstructured)


# ------------------------------------------------------------------------------- torchmetrics
#: A metric's bookkeeping besides its ``metric_state`` (which is public): how often it was updated, its cached
#: ``compute()`` and ``forward``'s last batch value. Saving and restoring a metric around a replayed step must keep
#: them too; torchmetrics has no public accessor.
METRIC_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")


def metric_bookkeeping(metric: Any) -> dict[str, Any]:
    """``metric``'s private bookkeeping (:data:`METRIC_BOOKKEEPING`) by name; ``setattr`` puts it back."""
    return {name: getattr(metric, name) for name in METRIC_BOOKKEEPING}


def forget_computed(metric: Any) -> None:
    """Drop ``metric``'s cached ``compute()`` result (``_computed``), as torchmetrics does after each update."""
    metric._computed = None
