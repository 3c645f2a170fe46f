"""Synchronous schedules: every batch is one flushed step that equals one-device training."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from lightning_pipe.engine.collectives import all_reduce_flat
from lightning_pipe.lightning.runtimes.common import BaseRuntime, trainable

if TYPE_CHECKING:
    from lightning_pipe.lightning.pipeline import StagePipeline
    from lightning_pipe.lightning.strategy import PipeStrategy


class FlushRuntime(BaseRuntime):
    """A synchronous schedule: every batch is one flushed step that equals one-device training.

    Args:
        strategy: the strategy.
        pipeline: this rank's stages.
        schedule: the synchronous schedule to run (the registry's ``flushed`` one for an asynchronous schedule's warm-up).
    """

    steps_inside = False

    def __init__(self, strategy: PipeStrategy, pipeline: StagePipeline, schedule: str) -> None:
        super().__init__(strategy, pipeline)
        self.schedule = schedule

    def training_step(self, args: tuple, kwargs: dict) -> Tensor:
        params = trainable(self.strategy)
        earlier = [p.grad for p in params]  # gradients of earlier batches of an accumulation window
        for p in params:
            p.grad = None  # the step starts from empty gradients
        with self.strategy.precision_plugin.train_step_context():
            ran = self.pipeline.flush("training_step", args, kwargs, True, self.schedule)
        self.pipeline.seen_batch = True
        if not self.pipeline.outside.known:
            with self.pipeline.watchdog.guard("which stages use the parameters outside the trunk"):
                self.pipeline.outside.learn()
        self._keep_aside()
        for p, grad in zip(params, earlier):
            p.grad = grad
        return self.pipeline.replayed_loss(ran)

    def backward(self) -> None:
        self._put_back()
        if self.strategy.lightning_module.trainer.fit_loop._should_accumulate():
            return
        self.pipeline.outside.sum_shared_gradients()
        pipelines = self.strategy.num_pipelines
        if pipelines > 1:
            grads = [p.grad for p in trainable(self.strategy) if p.grad is not None]
            all_reduce_flat(grads, self.strategy.topology.stage_group, scale=1.0 / pipelines)
