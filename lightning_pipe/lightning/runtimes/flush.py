"""Synchronous schedules: every batch is one flushed step that equals one-device training."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_pipe.engine.collectives import GradientReducer
from lightning_pipe.engine.sharding import ShardedLayers, calls_recorded, replicated
from lightning_pipe.lightning import _compat
from lightning_pipe.lightning.runtimes.common import BaseRuntime, trainable, unwrapped

if TYPE_CHECKING:
    from lightning_pipe.lightning.pipeline import StagePipeline


class FlushRuntime(BaseRuntime):
    """A synchronous schedule: every batch is one flushed step that equals one-device training.

    Args:
        pipeline: this rank's stages.
        schedule: the synchronous schedule to run (the registry's ``flushed`` one for an asynchronous schedule's warm-up).
        sharding: with ``data_parallel="fsdp"``, this rank's trunk layers as FSDP2 units (``None`` with ``"ddp"``).
    """

    steps_inside = False

    def __init__(self, pipeline: StagePipeline, schedule: str, sharding: ShardedLayers | None = None) -> None:
        super().__init__(pipeline)
        self.schedule = schedule
        self.sharding = sharding
        self._reducer: GradientReducer | None = None
        self._reducing = False  # this step's gradients are being averaged across pipelines
        self._called: set[str] | None = None  # data_parallel="fsdp": the modules outside the trunk the first step called

    def training_step(self, args: tuple, kwargs: dict, measuring: bool) -> Tensor:
        context, module = self.context, self.pipeline.module
        trainer = module.trainer
        # gradients of earlier batches of an accumulation window; at a window's first batch they are the
        # last step's, which Lightning's zero_grad drops before backward: drop them now, so that they do
        # not stay alive beside this step's (one gradient-sized buffer less at the peak)
        first_of_window = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        if self._called is not None and first_of_window:  # data_parallel="fsdp": the step after the first
            self._shard_outside(trainer)
        params = trainable(module)
        earlier = [None if first_of_window else p.grad for p in params]
        for p in params:
            p.grad = None  # the step starts from empty gradients
        # across pipelines, average while the last backward runs (DDP's overlap); not when the step adds
        # to earlier batches' gradients, which only the sum at backward() completes
        last_backward = None
        whole = replicated(params)  # data_parallel="fsdp": the sharded trunk reduce-scatters in its chunks' last backward
        if context.num_pipelines > 1 and all(g is None for g in earlier) and not _compat.should_accumulate(trainer):
            if self._reducer is None or [id(p) for p in self._reducer.params] != [id(p) for p in whole]:
                self._reducer = GradientReducer(whole, context.topology.stage_group, context.num_pipelines)
            last_backward, self._reducing = self._reducer.armed, True
        sharding = self.sharding
        if sharding is not None:
            sharding.prefetch()
        recording = sharding is not None and not self.pipeline.outside.known
        with (calls_recorded(self.pipeline.outside.modules()) if recording else nullcontext(None)) as called:
            with context.precision_plugin.train_step_context():
                ran = self.pipeline.flush("training_step", args, kwargs, True, self.schedule, last_backward,
                                          sharding.reducing if sharding is not None else None,
                                          sharding.early_forward if sharding is not None else None)
        if called is not None:
            self._called = called
        self.pipeline.seen_batch = True
        self.pipeline.check_released()
        if not self.pipeline.outside.known:
            with self.pipeline.watchdog.guard("which stages use the parameters outside the trunk"):
                self.pipeline.outside.learn()
            if context.options.release_unused_outside:
                self.pipeline.release_unused_outside([unwrapped(o) for o in trainer.optimizers])
        self._keep_aside()
        for p, grad in zip(params, earlier):
            p.grad = grad
        return self.pipeline.replayed_loss(ran)

    def _shard_outside(self, trainer: Any) -> None:
        """Shard the modules outside the trunk that only this stage trains (:meth:`StagePipeline.shard_outside`),
        between two optimizer steps: the first step called them with their parameters whole."""
        assert self.sharding is not None and self._called is not None
        self.pipeline.shard_outside(self.sharding, self._called, [unwrapped(o) for o in trainer.optimizers])
        self._called = None

    def backward(self) -> None:
        self._put_back()
        if _compat.should_accumulate(self.pipeline.module.trainer):
            return
        reduced, self._reducing = self._reducing, False
        if reduced:  # each stage's share first; the sum over stages below commutes with the mean
            assert self._reducer is not None
            self._reducer.finish()
        self.pipeline.outside.sum_shared_gradients()
        pipelines = self.context.num_pipelines
        if pipelines > 1 and not reduced:  # the same buckets on every replica, used or not (GradientReducer)
            GradientReducer(replicated(trainable(self.pipeline.module)), self.context.topology.stage_group, pipelines).finish()
