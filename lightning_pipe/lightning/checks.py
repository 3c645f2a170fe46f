"""Checks of a ``PipeStrategy`` against the Trainer, the module and its data, before any process starts.

Lightning's launcher starts the other ranks before it calls the strategy's ``connect``, so a bad
configuration found there fails on every rank, after seconds of start-up, with a traceback each.
:class:`~lightning_pipe.lightning.launcher.PipeLauncher` runs :func:`check_model` and
:func:`check_loader` in the launching process first; ``connect`` runs :func:`check_model` again on
every rank (the model may come from elsewhere, e.g. torchrun). Each failure is one
:class:`~lightning_pipe.errors.PipeConfigError` sentence that says what to change.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import (
    GradientAccumulationScheduler,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipe.errors import AsyncQualityWarning, MicroBatchNormWarning, PipeConfigError
from lightning_pipe.lightning import _compat
from lightning_pipe.optim import CombinedOptimizer
from lightning_pipe.partition import find_trunk, resolve_balance, stage_bounds
from lightning_pipe.partition.split import check_shared_layers, check_tied_outside
from lightning_pipe.partition.trunk import candidates_of
from lightning_pipe.quality import quality_warning
from lightning_pipe.registry import ScheduleSpec

if TYPE_CHECKING:
    from lightning_pipe.lightning.options import PipeOptions


def resolve_stages(world_size: int, stages: int | None, pipelines: int) -> int:
    """The number of stages per pipeline, checked against the number of processes.

    One process with ``stages > 1`` (and one pipeline) emulates the pipeline in that process.
    """
    if world_size == 1 and pipelines == 1 and stages is not None:
        return stages
    if stages is None:
        if world_size % pipelines:
            raise PipeConfigError(
                f"{world_size} processes (devices × num_nodes) cannot form {pipelines} pipelines; "
                f"use a multiple of {pipelines} devices or change pipelines."
            )
        return world_size // pipelines
    if stages * pipelines != world_size:
        raise PipeConfigError(
            f"stages={stages} × pipelines={pipelines} needs {stages * pipelines} processes but the Trainer has "
            f"{world_size} (devices × num_nodes); set devices={stages * pipelines} or change stages/pipelines."
        )
    return stages


def check_data_parallel(options: PipeOptions, world_size: int) -> None:
    """``data_parallel="fsdp"`` shards a stage across the processes holding it: one process has no other."""
    if options.data_parallel == "fsdp" and world_size == 1:
        raise PipeConfigError(
            "data_parallel='fsdp' shards each stage across the processes of the pipelines, and this Trainer runs one "
            "process; set devices to stages × pipelines, or use data_parallel='ddp'."
        )


def check_sharded_checkpoints(options: PipeOptions, saves: bool) -> None:
    """With ``data_parallel="fsdp"`` a checkpoint is written only as a sharded directory (each rank its shards)."""
    if saves and options.data_parallel == "fsdp" and not options.save_distributed_checkpoint:
        raise PipeConfigError(
            "data_parallel='fsdp' writes checkpoints only as sharded directories; set save_distributed_checkpoint=True "
            "(lightning_pipe.consolidate_checkpoint makes one file of one), or Trainer(enable_checkpointing=False)."
        )


def builds_in_configure_model(module: LightningModule) -> bool:
    """Whether the module builds (some of) its layers in ``configure_model``, which Lightning calls
    after ``connect``: its trunk is looked for at setup, once the hook ran (docs/large-models.md)."""
    return is_overridden("configure_model", module, LightningModule)


def check_module(
    module: LightningModule, trunk_name: str | None, balance: str | Sequence[int], virtual_stages: int, schedule: ScheduleSpec,
    stages: int, micro_batches: int, built: bool = True,
) -> list[int] | None:
    """Checks that need the module; returns the layer count of every virtual stage (``None`` when not
    ``built`` yet: its trunk comes from ``configure_model``)."""
    if not module.automatic_optimization:
        raise PipeConfigError(
            f"{type(module).__name__} uses manual optimization, which pipeline schedules cannot drive; "
            "set self.automatic_optimization = True or train it with strategy='ddp'."
        )
    schedule.check(stages, micro_batches)
    if not built:
        return None
    name, trunk = find_trunk(module, trunk_name)
    counts = resolve_balance(balance, trunk, virtual_stages)
    if virtual_stages > 1:  # before any process starts (setup checks the final split again)
        check_tied_outside(module, name)
        check_shared_layers(trunk, name, stage_bounds(counts))
    return counts


def check_meta_build(options: PipeOptions) -> None:
    """What cannot work with a model built on the meta device: the choices that time its layers."""
    if options.balance == "auto" or options.tuned:
        what = "balance='auto'" if options.balance == "auto" else "avgpipe's 'auto' values"
        raise PipeConfigError(
            f"{what} times the layers with real weights, but configure_model built them on the meta device (each rank "
            "creates only its own stage); give balance as a list of counts, 'uniform' or 'parameters', and numbers "
            "for avgpipe's options."
        )


def _has_trunk(module: LightningModule, trunk_name: str | None) -> bool:
    """Whether a trunk is there to check (an ambiguous one is: its error is worth raising now)."""
    if trunk_name is None:
        return bool(candidates_of(module))
    target: object = module
    for part in trunk_name.split("."):
        target = getattr(target, part, None)
    return target is not None


def check_trainer(schedule: ScheduleSpec, accumulate_grad_batches: int, optimizers: int, callbacks: Sequence[Any] = ()) -> None:
    """Schedules that step inside the pipeline do so once per mini-batch, with one optimizer; a
    ``GradientAccumulationScheduler`` among ``callbacks`` would set ``accumulate_grad_batches`` later."""
    if not schedule.steps_inside:
        return
    if accumulate_grad_batches > 1:
        raise PipeConfigError(
            f"schedule={schedule.name!r} steps every mini-batch, so accumulate_grad_batches={accumulate_grad_batches} has no "
            "meaning; use more micro_batches or a larger batch instead."
        )
    for callback in callbacks:
        if isinstance(callback, GradientAccumulationScheduler) and max(callback.scheduling.values()) > 1:
            raise PipeConfigError(
                f"schedule={schedule.name!r} steps every mini-batch, so GradientAccumulationScheduler"
                f"({callback.scheduling}) would accumulate batches it has already stepped on; drop the callback, or "
                "use a synchronous schedule such as '1f1b'."
            )
    if optimizers != 1:
        raise PipeConfigError(f"schedule={schedule.name!r} supports exactly one optimizer; configure_optimizers returned {optimizers}.")


def check_callbacks(callbacks: Sequence[Any], stages: int) -> None:
    """Callbacks that need the whole model on every rank cannot run beside a pipeline of several stages (emulated
    too, so that the emulation refuses what the processes would)."""
    if stages == 1:
        return
    for callback in callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            raise PipeConfigError(
                "StochasticWeightAveraging keeps a copy of the whole model on every rank and averages it against the "
                "rank's own parameters, which under a pipeline are one stage's (on several processes it fails on "
                "mismatched shapes); drop the callback, or average the weights of saved checkpoints after training "
                "(torch.optim.swa_utils.AveragedModel over lightning_pipe.consolidate_checkpoint's files)."
            )
        if isinstance(callback, WeightAveraging):
            raise PipeConfigError(
                f"{type(callback).__name__} keeps an averaged copy of the whole module on every rank (made before the "
                "pipeline is cut) and swaps it with the rank's own parameters, which under a pipeline are one stage's "
                "(on several processes it fails on mismatched shapes at the first validation), and its checkpoints "
                "would hold one rank's average; drop the callback (averaging per stage is not supported yet), or "
                "average the weights of saved checkpoints after training."
            )
        if isinstance(callback, ModelPruning) and _compat.prunes_globally(callback):
            raise PipeConfigError(
                "ModelPruning(use_global_unstructured=True), its default, ranks the weights of every pruned layer "
                "together, but each rank holds one stage's layers, so every stage would prune by its own threshold "
                "(on 2 processes the pruned weights differed from one device's); use "
                "ModelPruning(..., use_global_unstructured=False), which prunes each layer on its own, exactly."
            )


def check_optimizers(optimizers: Sequence[Any], stages: int) -> None:
    """Optimizers that compute over all of the model's parameters at once cannot step one stage's share of them
    (emulated too, so that the emulation refuses what the processes would)."""
    if stages == 1:
        return
    for optimizer in optimizers:
        for member in optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else [optimizer]:
            if isinstance(member, torch.optim.LBFGS):
                raise PipeConfigError(
                    f"{type(member).__name__} takes its search direction and line search from dot products over all of "
                    "the model's parameters and evaluates the closure until they converge, but each stage's process "
                    "holds only its own parameters: every stage would search on its own (on 2 processes it wrote into "
                    "another stage's stand-in parameters), and the stages could run the pipeline a different number of "
                    "times and hang. Use a first-order optimizer (SGD, Adam, AdamW), or train with strategy='ddp' or on "
                    "one device."
                )


def warn_quality(schedule: str, stages: int, optimizer: Any) -> None:
    """Warn (:class:`AsyncQualityWarning`) when ``schedule`` with stale gradients runs with an optimizer the
    language-model benchmark shows losing quality under them (:func:`lightning_pipe.quality.quality_warning`).
    Called on rank 0 only; ``warnings.warn`` so that the standard filters silence it."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps the user's
    message = quality_warning(schedule, stages, optimizer)
    if message is not None:
        warnings.warn(message, AsyncQualityWarning, stacklevel=2)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)


def warn_batch_norm(module: nn.Module, micro_batches: int | str) -> None:
    """Warn (:class:`MicroBatchNormWarning`) when ``module`` normalises over the batch (BatchNorm) and a batch is cut
    into several micro-batches: each is normalised on its own, as one device would with that many accumulated smaller
    batches, not as it would the whole batch. Said by rank 0 only, once (the launcher and ``connect`` both check)."""
    if micro_batches == 1:
        return
    names = [name for name, m in module.named_modules() if isinstance(m, _BATCH_NORMS) and m.training]
    if not names:
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    rank_zero_warn(
        f"lightning_pipe: {shown} ({type(module.get_submodule(names[0])).__name__}) normalise each micro-batch on its "
        f"own (micro_batches={micro_batches}), so the pipeline trains like one device with accumulate_grad_batches="
        f"{micro_batches} on batches that small, not like one device on the whole batch (its statistics and running "
        "averages differ). LayerNorm or GroupNorm normalise each sample and pipeline exactly; micro_batches=1 keeps "
        "the batch whole (and the pipeline idle).", category=MicroBatchNormWarning,
    )


def check_model(options: PipeOptions, stages: int, pipelines: int, model: LightningModule, built: bool | None = None) -> list[int] | None:
    """Every check of the options against the module and the process count; returns the layer
    count of every virtual stage (``balance="auto"`` is checked as ``"uniform"``, then chosen at setup).

    ``built``: whether the module is complete; by default, unless its ``configure_model`` has yet to
    build the trunk (then the trunk checks wait for setup and ``None`` is returned)."""
    if built is None:
        built = not builds_in_configure_model(model) or _has_trunk(model, options.module)
    if options.spec.family == "asynchronous" and pipelines > 1:
        raise PipeConfigError(
            f"schedule={options.schedule!r} steps each stage inside the pipeline, so data-parallel pipelines would "
            "diverge; use pipelines=1 (avgpipe's parallel pipelines share the devices instead) or a synchronous schedule."
        )
    if stages == 1 and pipelines == 1:
        rank_zero_warn(
            f"lightning_pipe: schedule={options.schedule!r} runs as a one-stage pipeline in one process, so nothing is "
            "pipelined; set Trainer(devices=N) to run N stages, or PipeStrategy(stages=N) to emulate N stages in this "
            "process (under torchrun, pass devices=<processes per node>).", category=UserWarning,
        )
    if built:
        warn_batch_norm(model, options.micro_batches)
    return check_module(
        model, options.module, "uniform" if options.balance == "auto" else options.balance,
        stages * options.chunks_per_stage, options.spec, stages,
        options.micro_batches if options.micro_batches != "auto" else 1, built,
    )


def check_loader(options: PipeOptions, pipelines: int, loader: Any) -> None:
    """A training DataLoader whose first batch is smaller than one step's micro-batches (every
    replica's, for avgpipe) cannot start; other loaders (iterables, datamodules) are checked on
    their first batch instead."""
    batch_size = getattr(loader, "batch_size", None)
    if not isinstance(loader, DataLoader) or batch_size is None or options.micro_batches == "auto":
        return
    try:
        first = min(batch_size, math.ceil(len(loader.dataset) / pipelines))  # type: ignore[arg-type]
    except TypeError:  # a dataset without a length
        first = batch_size
    needed = int(options.micro_batches)
    if options.spec.family == "averaging" and options.avgpipe.parallel_pipelines != "auto":
        needed *= int(options.avgpipe.parallel_pipelines)
    if first < needed:
        raise PipeConfigError(
            f"micro_batches={options.micro_batches} is larger than the batch size {first}; use micro_batches <= {first} "
            "or a larger batch size." if needed == int(options.micro_batches) else
            f"a batch of {first} samples cannot feed parallel_pipelines={options.avgpipe.parallel_pipelines} × "
            f"micro_batches={options.micro_batches}; use a batch size of at least {needed} (the batch holds every "
            "replica's mini-batch)."
        )


def uneven_batches_message(last: Sequence[int], others: Sequence[int], loop: str) -> str:
    """Why the ranks cannot go on when the ranks ``last`` are at their ``loop``'s last batch of the epoch and the
    ranks ``others`` are not."""
    return (
        f"the {loop} DataLoader of rank(s) {', '.join(map(str, last))} ends its epoch with this batch, that of rank(s) "
        f"{', '.join(map(str, others))} does not. Every rank must load as many batches per epoch (the stages of a "
        "pipeline the same batches, every pipeline as many), or the ranks that go on wait for the others. A dataset "
        "that shards itself must shard by pipeline, into parts of one length: rank=trainer.global_rank // "
        "trainer.strategy.num_stages, world_size=trainer.strategy.num_pipelines, and drop the remainder (docs/faq.md)."
    )
