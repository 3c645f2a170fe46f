"""Choices made at setup from the user's own model and data: ``balance="auto"`` and avgpipe's ``"auto"`` options.

The planning itself imports no Lightning (:mod:`lightning_pipe.planning`); this module gives it what
only Lightning knows: the first batch of the loop that is starting, the trunk input the user's own
step produces from it, and the user's optimizer. Random states and the module's buffers (e.g.
BatchNorm running statistics) are restored afterwards, so the run trains exactly as it would have
with the chosen values given by hand. Rank 0 decides; every rank adopts the same choice.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

from lightning_pipe.engine import batch_size, keeps_one_fifo_order, split_micro_batches
from lightning_pipe.errors import CheckpointMismatchError, PipeConfigError
from lightning_pipe.lightning import _compat
from lightning_pipe.lightning.checkpointing import BALANCE_KEY
from lightning_pipe.lightning.log_replay import LogCapture
from lightning_pipe.partition import find_trunk, stage_bounds
from lightning_pipe.partition.trunk import container_name
from lightning_pipe.planning import auto_balance, avgpipe_autotune
from lightning_pipe.planning.auto_balance import AutoBalance, memory_limit, preserved_buffers, preserved_random_state
from lightning_pipe.planning.avgpipe_autotune import AutoValues, Prediction, optimizer_factory, optimizer_spec
from lightning_pipe.planning.avgpipe_trials import TrialStage
from lightning_pipe.planning.avgpipe_tuner import profile_step
from lightning_pipe.planning.planner import Plan
from lightning_pipe.planning.profile import capture_trunk_input, profile_trunk
from lightning_pipe.planning.trials import on_device

if TYPE_CHECKING:
    from lightning_pipe.lightning.context import PipeContext
    from lightning_pipe.lightning.options import PipeOptions

log = logging.getLogger(__name__)
rank_zero_info = rank_zero_only(log.info)  # rank 0 decides and says so; every rank adopts the choice

_STEPS = {
    TrainerFn.FITTING: ("fit_loop", "training_step"),
    TrainerFn.VALIDATING: ("validate_loop", "validation_step"),
    TrainerFn.TESTING: ("test_loop", "test_step"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_step"),
}


def first_batch(trainer: Trainer, module: LightningModule) -> tuple[Any, str]:
    """The first batch of the loop that is starting (after the batch-transfer hooks) and the step
    hook that consumes it.

    It comes from the same source Lightning's own loop reads (a DataLoader passed to ``fit``, or the
    LightningModule's / datamodule's ``*_dataloader()``, called once more), with the random states
    restored afterwards, so the data order of the run is unchanged.
    """
    loop_name, hook = _STEPS.get(trainer.state.fn, _STEPS[TrainerFn.FITTING])
    source = _compat.loop_data_source(trainer, loop_name)
    if not source.is_defined():
        raise PipeConfigError(f"balance='auto' profiles one batch but no {source.name} is defined; pass a dataloader or "
                              "give a list of layer counts.")
    with preserved_random_state():
        loaders = source.dataloader()
        if isinstance(loaders, dict):
            loaders = next(iter(loaders.values()))
        elif isinstance(loaders, (list, tuple)):
            loaders = loaders[0]
        iterator = iter(loaders)
        try:
            batch = next(iterator)
        except StopIteration:
            raise PipeConfigError(f"balance='auto' profiles one batch but {source.name} is empty.") from None
        finally:
            del iterator  # shuts down worker processes
    return _compat.transfer_batch(module, batch), hook


# ------------------------------------------------------------------------------- balance="auto"
def balance(context: PipeContext, trainer: Trainer, module: LightningModule) -> tuple[Plan, list[float] | None]:
    """Rank 0 profiles and splits, every rank receives the same plan, then all refine it on the
    devices; returns the plan and, when refined, each stage's measured time."""
    options = context.options
    averaging = options.spec.family == "averaging"
    # avgpipe's pipelines are each a 1F1B on one replica's mini-batch: plan the split 1F1B would use on it,
    # as `lightning-pipe plan` does (the planner's cost model has no merged rounds)
    schedule = options.spec.flushed if averaging else options.schedule

    def work() -> AutoBalance:
        _, trunk = find_trunk(module, options.module)
        with context.precision_plugin.train_step_context(), preserved_random_state(), preserved_buffers(module):
            batch, hook = first_batch(trainer, module)
            if averaging:
                batch = split_micro_batches(batch, int(options.avgpipe.parallel_pipelines))[0]
            micro_batch = split_micro_batches(batch, int(options.micro_batches))[0]
            step = getattr(module, hook)
            with LogCapture(module):
                sample = capture_trunk_input(module, trunk, lambda: step(micro_batch, 0), hook)
                inputs = capture_trunk_input(module, trunk, lambda: step(batch, 0), hook) if options.auto_balance.refine else None
            return auto_balance.split_by_profile(
                trunk, sample, inputs, schedule, context.num_stages, int(options.micro_batches),
                options.chunks_per_stage, options.auto_balance, context.root_device, options.checkpoint_activations, module)

    with context.watchdog.guard("rank 0's balance='auto' plan"):
        auto = auto_balance.agreed(context.is_global_zero, context.world_size, work)
    warning = auto_balance.noise_warning(auto.profile, options.auto_balance, auto.plan.balance)
    if warning is not None:
        rank_zero_warn(warning)
    _, trunk = find_trunk(module, options.module)
    if isinstance(trunk, torch.nn.ModuleList) and options.auto_balance.refine and context.topology.stages > 1:
        rank_zero_info(f"balance='auto' keeps the profiled split of the {container_name(trunk)} trunk: "
                       "the refinement runs stage copies as nn.Sequential, which a looped trunk's blocks are not.")
        return auto.plan, None
    if not options.auto_balance.refine or context.topology.stages == 1 or options.chunks_per_stage > 1:
        return auto.plan, None  # nothing to measure in one process; interleaved splits are searched locally already
    with context.precision_plugin.train_step_context():
        return auto_balance.refine(auto, options.auto_balance, trunk, context.topology, context.transport, context.watchdog,
                                   context.root_device, options.checkpoint_activations, rank_zero_info)


# ------------------------------------------------------------------------------- avgpipe's tuner
def user_optimizer(module: LightningModule) -> tuple[type, dict[str, Any]]:
    """The class and defaults of the module's (first) optimizer; ``configure_optimizers`` is called
    once to learn them and its objects are discarded."""
    optimizer = _compat.init_optimizers(module)[0]
    return optimizer_spec(optimizer)


def predict_candidates(
    trainer: Trainer, module: LightningModule, trunk_name: str | None, counts: list[int], values: AutoValues,
    device: torch.device, memory: list[float] | None = None,
) -> Prediction:
    """Rank 0's work: profile the first batch at three micro-batch sizes and rank the candidates."""
    _, trunk = find_trunk(module, trunk_name)
    with preserved_random_state(), preserved_buffers(module):
        batch, hook = first_batch(trainer, module)
        size = batch_size(batch)
        step = getattr(module, hook)
        profiles = []
        for b in avgpipe_autotune.profile_sizes(size):
            micro_batch = split_micro_batches(batch, math.ceil(size / b))[0]
            with LogCapture(module):
                sample = capture_trunk_input(module, trunk, lambda: step(micro_batch, 0), hook)
            profiles.append(profile_trunk(trunk, sample, device, repeats=3, warmup=1, module=module))
        with LogCapture(module):
            inputs = capture_trunk_input(module, trunk, lambda: step(batch, 0), hook)
        spec = user_optimizer(module)
        steps = [profile_step(copy.deepcopy(trunk[start:end]).to(device), optimizer_factory(spec))
                 for start, end in stage_bounds(counts)]
    ranked = avgpipe_autotune.rank_candidates(profiles, steps, counts, values, size, memory)
    inputs = on_device(inputs, torch.device("cpu"))  # broadcast to every rank (captured inputs are detached)
    return Prediction(ranked, size, inputs, spec)


def tune_avgpipe(context: PipeContext, trainer: Trainer, module: LightningModule, counts: list[int]) -> dict[str, int]:
    """avgpipe's ``"auto"`` options: a checkpoint's values, or profile, predict and try the best
    candidates on the devices; every rank returns the same values."""
    stored = _compat.loaded_checkpoint(trainer).get(avgpipe_autotune.CHECKPOINT_KEY)
    if stored is not None:
        rank_zero_info(f"avgpipe adopts the tuned values of the checkpoint: {stored}")
        return stored
    options, stages = context.options, context.num_stages
    if context.emulating:
        raise PipeConfigError(emulated_tuner_message(options))
    trunk = find_trunk(module, options.module)[1]
    if isinstance(trunk, torch.nn.ModuleList):
        raise PipeConfigError(
            "avgpipe's tuner measures its candidates on copies of each stage run as an nn.Sequential, which the blocks "
            f"of the {container_name(trunk)} trunk are not; set avgpipe's parallel_pipelines, micro_batches and advance_forward "
            "to numbers (e.g. avgpipe={'parallel_pipelines': 2, 'advance_forward': 1}, micro_batches=4).")
    memory = memory_limit(options.auto_balance, context.root_device)
    memory = [memory] * stages if isinstance(memory, float) else memory
    values = AutoValues(options.avgpipe.parallel_pipelines, options.micro_batches, options.avgpipe.advance_forward)

    def work() -> Prediction:
        with context.precision_plugin.train_step_context():
            prediction = predict_candidates(trainer, module, options.module, counts, values, context.root_device, memory)
        if context.tagged:
            return prediction
        fifo = [c for c in prediction.ranked if keeps_one_fifo_order(stages, c.micro_batches, c.replicas, c.advance)]
        if not fifo:
            raise PipeConfigError("no avgpipe candidate keeps one message order across replicas, as NCCL needs; "
                                  "use gloo or parallel_pipelines=1.")
        return replace(prediction, ranked=fifo)

    with context.watchdog.guard("rank 0's avgpipe tuner prediction"):
        prediction = avgpipe_autotune.agreed(context.is_global_zero, context.world_size, work)
    with context.precision_plugin.train_step_context():
        choice = avgpipe_autotune.decide(
            prediction, options.avgpipe.trials, lambda p: trial_stage(context, module, counts, p), context.is_global_zero,
            context.world_size, progress=rank_zero_info,
        )
    rank_zero_info(avgpipe_autotune.describe(choice))
    return choice.as_options()


def emulated_tuner_message(options: PipeOptions) -> str:
    """Why avgpipe's tuner cannot run in an emulated pipeline, and the numbers to give instead."""
    auto = [name for name, value in (("micro_batches", options.micro_batches),
                                     ("parallel_pipelines", options.avgpipe.parallel_pipelines),
                                     ("advance_forward", options.avgpipe.advance_forward)) if value == "auto"]
    return (
        f"avgpipe's 'auto' values ({', '.join(auto)}) are chosen by timing rounds on one process per stage, and an "
        "emulated pipeline runs every stage in this one process, one after another, so no timing here says how fast a "
        "pipeline would be; give numbers, e.g. micro_batches=4, avgpipe={'parallel_pipelines': 2, 'advance_forward': 1} "
        "(`lightning-pipe plan --schedules '[avgpipe]'` predicts them for a real pipeline), or set devices to the number "
        "of stages to tune on them. A checkpoint of a tuned run resumes here with its values."
    )


def trial_stage(context: PipeContext, module: LightningModule, counts: list[int], prediction: Prediction) -> TrialStage:
    """This rank's stage, as avgpipe's trials run it (copies of its layers, the real transport)."""
    topology, options = context.topology, context.options
    _, trunk = find_trunk(module, options.module)
    start, end = stage_bounds(counts)[topology.stage]
    return TrialStage(
        trunk[start:end], topology.stage, topology.stages, topology.pipeline_ranks, context.transport, context.watchdog,
        optimizer_factory(prediction.optimizer), prediction.inputs if topology.stage == 0 else None,
        context.root_device, options.avgpipe.alpha, topology.stage_group if context.num_pipelines > 1 else None,
        context.num_pipelines,
    )


def check_resumed_choices(options: PipeOptions, counts: list[int], avgpipe_tuned: bool, checkpoint: dict[str, Any],
                          path: Any) -> None:
    """A checkpoint read after setup (sharded, or any under ``save_distributed_checkpoint=True`` or
    ``configure_model``) comes too late for ``balance="auto"`` and avgpipe's ``"auto"`` options to adopt its
    values, which are chosen at setup. Where the values chosen now differ from the checkpoint's and change
    what training computes (an asynchronous schedule's staleness per layer, avgpipe's rounds), stop with
    the values to give instead; a synchronous schedule equals one device under any split, so it goes on.
    ``avgpipe_tuned``: whether avgpipe's values were ``"auto"`` (``options`` holds the values chosen)."""
    stored = checkpoint.get(BALANCE_KEY)
    if options.balance == "auto" and stored is not None and list(stored) != list(counts) and not options.spec.synchronous:
        raise CheckpointMismatchError(
            f"{path}: the checkpoint was trained with the split {list(stored)}, but balance='auto' chose {list(counts)} "
            f"at setup, before the checkpoint is read, and schedule={options.schedule!r} trains differently under another "
            f"split; resume with balance={list(stored)}."
        )
    tuned = checkpoint.get(avgpipe_autotune.CHECKPOINT_KEY)
    if avgpipe_tuned and tuned is not None:
        now = avgpipe_autotune.options_record(int(options.avgpipe.parallel_pipelines), int(options.micro_batches),
                                              int(options.avgpipe.advance_forward))
        if now != tuned:
            raise CheckpointMismatchError(
                f"{path}: the checkpoint was trained with avgpipe's {tuned}, but the 'auto' options chose {now} at setup, "
                f"before the checkpoint is read; resume with micro_batches={tuned['micro_batches']}, "
                f"avgpipe={{'parallel_pipelines': {tuned['parallel_pipelines']}, 'advance_forward': {tuned['advance_forward']}}}."
            )
