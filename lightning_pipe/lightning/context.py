"""What the strategy's helpers need from it that is fixed once a Trainer call has set up its processes.

The strategy makes one :class:`PipeContext` at the end of ``setup_environment`` (the first point where
the watchdog, the process groups and the transport all exist) and hands it to the pipeline
(:class:`~.pipeline.StagePipeline`), the runtimes (:mod:`.runtimes`), :mod:`.auto` and
:class:`~.stage_metrics.StageMetrics`, instead of the strategy itself. Each Trainer call (``fit``,
``validate``, ...) sets its processes up again and makes a new context (a new watchdog and process groups);
the pipeline built at the first call is given the new one (:meth:`~.pipeline.StagePipeline.use`).

Within a call, the context is replaced at most once: avgpipe's tuner (``"auto"`` options) chooses its
values at setup, before the pipeline is cut and the runtime made (:meth:`PipeContext.adopt`); replacing
it once they exist would leave them holding the options they were built with, so that is an error.

What is Lightning's and changes during a fit (the trainer, the optimizers, the loop's state) is not in
the context: the pipeline holds the LightningModule it cut, and the trainer and its optimizers are read
from that module when a step needs them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_pipe.engine import Topology, Transport, Watchdog
from lightning_pipe.lightning.options import PipeOptions


@dataclass(frozen=True)
class PipeContext:
    """This process's fixed facts about the pipeline, from ``setup_environment`` to the end of the Trainer call."""

    #: the resolved options (:func:`~.options.resolve`); avgpipe's ``"auto"`` values once its tuner chose them
    options: PipeOptions
    #: this rank's place in the pipelines and its process groups (one stage when emulating)
    topology: Topology
    #: ends the other ranks when this one fails, and bounds every wait for a peer
    watchdog: Watchdog
    #: this rank's point-to-point layer (``None`` for a one-process pipeline); one per process, kept across calls
    transport: Transport | None
    #: the device this rank computes on
    root_device: torch.device
    #: Lightning's precision plugin (autocast contexts, fp16's loss scaler)
    precision_plugin: Precision
    #: processes per pipeline, or the emulated stage count in one process
    num_stages: int
    #: data-parallel pipeline replicas (1 when emulating)
    num_pipelines: int
    #: one process running every stage of a ``stages``-stage pipeline (docs/emulation.md)
    emulating: bool
    #: this process's global rank
    global_rank: int
    #: processes in the job
    world_size: int
    #: whether messages may carry tags (gloo, or one stage), so avgpipe's replicas need not share one FIFO order
    tagged: bool
    #: whether :meth:`adopt` replaced the options made at ``setup_environment`` (avgpipe's tuner)
    adopted: bool = False

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0."""
        return self.global_rank == 0

    @property
    def virtual_stages(self) -> int:
        """Virtual stages of the whole pipeline (stages × chunks per stage)."""
        return self.num_stages * self.options.chunks_per_stage

    def adopt(self, options: PipeOptions, *, built: bool) -> PipeContext:
        """This context with avgpipe's tuned ``options``: the one replacement of a Trainer call's context.

        ``built``: whether the pipeline or a runtime already exists; they were made with this context's
        options, so replacing them now raises, as does a second replacement."""
        if built:
            raise RuntimeError("the pipe context's options were replaced after the pipeline and its runtime were built "
                               "with them; avgpipe's tuner must choose its values before the cut.")
        if self.adopted:
            raise RuntimeError("the pipe context's options were replaced twice in one Trainer call; avgpipe's tuner "
                               "chooses its values once, at the first setup.")
        return dataclasses.replace(self, options=options, adopted=True)
