"""Per-stage metrics of every schedule, logged on the training steps Lightning logs anyway.

On a step that Lightning will log (every ``Trainer(log_every_n_steps=...)`` steps), each rank times
the actions its executor runs (:class:`~lightning_pipe.engine.recorder.StepTimer`: the host clock on
CPU, CUDA events on CUDA, read once after the step) and reads its peak memory; the values of every
stage, and the diagnostics of an asynchronous schedule's weight policies, are gathered in the
pipeline once and every rank logs them, so ``callback_metrics`` and the loggers hold, per stage ``s``:

* ``pipe/stage{s}/compute_ms``: forwards, backwards and optimizer steps of the step;
* ``pipe/stage{s}/wait_ms``: time waiting for a neighbour's activation or gradient;
* ``pipe/stage{s}/bubble``: the share of the step's span this stage did not compute (idle);
* ``pipe/stage{s}/peak_memory_mib``: peak memory allocated on the device during the step (CUDA), or
  the process's peak resident memory so far (CPU);
* asynchronous schedules also: ``staleness``, ``weight_copies``, ``weight_lag`` (the stale schedules:
  ``||W_applied - W_used|| / ||W_applied||``, measured only on these steps), ``grad_cosine`` (with
  ``grad_cosine_every``: the latest cosine between a stale gradient and the gradient at the applied
  weights), and ``correction_norm`` (pipemare) or ``prediction_norm`` (xpipe) (docs/async-semantics.md, docs/metrics.md).

Steps Lightning does not log cost nothing: no timing, no synchronisation, no collective. An emulated
pipeline runs its stages one after another in one process, so it logs only the policies' diagnostics.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_pipe.engine.recorder import Fanout, StepTimer
from lightning_pipe.lightning import _compat

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from lightning_pipe.lightning.context import PipeContext


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this step on a CUDA device, or the process's peak resident size so far on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


class StageMetrics:
    """Measures and logs the per-stage metrics of the module docstring for one Trainer call.

    Args:
        context: the call's fixed facts (device, topology, watchdog, whether emulating).
        module: the LightningModule that logs the values (its trainer says which steps Lightning logs).
        enabled: ``PipeStrategy(stage_metrics=...)``; ``False`` logs nothing.
    """

    def __init__(self, context: PipeContext, module: LightningModule, enabled: bool = True) -> None:
        self.context = context
        self.module = module
        self.enabled = enabled
        self.timer = StepTimer(context.root_device)
        self.measuring = False

    def recorder(self, trace: Any | None) -> Any:
        """What the executor records into: this timer, and a trace's recorder when ``trace_dir`` is set."""
        return self.timer if trace is None else Fanout(trace, self.timer)

    def begin(self) -> None:
        """Before a training step: measure it if Lightning will log it."""
        trainer = self.module.trainer
        self.measuring = self.enabled and _compat.logs_this_step(trainer)
        if not self.measuring:
            return
        self.timer.reset()
        self.timer.enabled = not self.context.emulating
        if self.context.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.context.root_device)

    def end(self, diagnostics: Callable[[], list[dict[str, float]]], batch_size: int) -> None:
        """After the step: gather every stage's values in the pipeline and log them on every rank.

        Args:
            diagnostics: returns the weight policies' values of every stage this process runs (one
                dict per stage; empty dicts for schedules without a policy); called only on logged
                steps, since some values cost a pass over the weights.
            batch_size: the batch's size, for ``self.log``.
        """
        self.timer.enabled = False
        if not self.measuring:
            return
        context = self.context
        stages = [dict(values) for values in diagnostics()] or [{}]
        if not context.emulating:
            times = self.timer.totals()
            stages[0].update(
                compute_ms=times.compute * 1e3, wait_ms=times.wait * 1e3,
                bubble=1.0 - times.compute / times.span if times.span > 0 else 0.0,
                peak_memory_mib=peak_memory_mib(context.root_device),
            )
        topology = context.topology
        if topology.stages > 1:
            gathered: list[Any] = [None] * topology.stages
            with context.watchdog.guard("every stage's metrics"):
                dist.all_gather_object(gathered, stages[0], group=topology.pipeline_group)
            stages = gathered
        module = self.module
        for stage, values in enumerate(stages):
            for key, value in values.items():
                module.log(f"pipe/stage{stage}/{key}", float(value), on_step=True, on_epoch=False, batch_size=batch_size)
