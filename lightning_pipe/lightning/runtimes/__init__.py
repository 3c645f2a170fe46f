"""How each family of schedules trains across Lightning steps, behind one small protocol.

The strategy holds one :class:`Runtime` while fitting and forwards Lightning's hooks to it:

* :class:`FlushRuntime` (synchronous schedules): one flushed step per batch; Lightning's own
  optimizer step and gradient clipping run as on one device.
* :class:`AsyncRuntime` (pipedream, pipedream_2bw, pipemare, xpipe): one window of the asynchronous
  stream per batch, optimizer steps inside the pipeline, a drain before evaluation, checkpoints and
  the end of an epoch; the first ``sync_warmup_epochs`` epochs run a :class:`FlushRuntime`.
* :class:`AvgPipeRuntime`: one round of every parallel pipeline per batch, steps and elastic
  averaging inside the pipeline.

Lightning zeroes gradients between ``training_step`` and ``backward``, so a runtime that leaves
gradients for Lightning's step keeps them aside in ``training_step`` and puts them back in ``backward``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from lightning_pipe.lightning.runtimes.asynchronous import ASYNC_STATE_KEY, AsyncRuntime
from lightning_pipe.lightning.runtimes.averaging import AVGPIPE_STATE_KEY, AvgPipeRuntime
from lightning_pipe.lightning.runtimes.common import trainable, unwrapped
from lightning_pipe.lightning.runtimes.flush import FlushRuntime

if TYPE_CHECKING:
    from lightning_pipe.engine.sharding import ShardedLayers
    from lightning_pipe.lightning.pipeline import StagePipeline


class Runtime(Protocol):
    """What the strategy asks of a family of schedules while fitting."""

    @property
    def steps_inside(self) -> bool:
        """Whether this step's optimizer steps happen inside the pipeline (Lightning only runs the closure)."""

    def attach(self, pipeline: StagePipeline) -> None:
        """Use the pipeline's current executor (a new one is built at every setup)."""

    def training_step(self, args: tuple, kwargs: dict, measuring: bool) -> Tensor:
        """Run one batch; return its loss on every rank, after replaying the last stage's logs. ``measuring``:
        whether the per-stage metrics measure this step (one Lightning logs), where costly diagnostics are taken."""

    def backward(self) -> None:
        """Put back what ``training_step`` kept aside from Lightning's ``zero_grad``."""

    def drain(self) -> None:
        """Finish every micro-batch in flight (before evaluation, checkpoints, the end of training)."""

    def checkpoint_state(self, policy: bool = True) -> dict[str, Any]:
        """Extra checkpoint entries (collective: every rank calls it). ``policy=False``: without the weight
        policy's state, which a sharded checkpoint stores per rank (:meth:`policy_state`)."""

    def policy_state(self) -> tuple[str, Any] | None:
        """The checkpoint key and the weight-policy state of the stages this process runs, after a drain,
        not gathered (``None``: no policy, or not started yet)."""

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Resume from a checkpoint's extra entries; a policy state this run cannot map onto its own
        raises :class:`~lightning_pipe.CheckpointMismatchError` here, before training."""

    def optimizer_parts(self) -> list[tuple[dict[str, Any], list[list[str]]]] | None:
        """Every stage's optimizer state and parameter names when this process holds them all (emulation)."""

    def parameter_names(self) -> dict[int, str]:
        """Names of tensors the optimizer steps that are not the module's own parameters (master copies)."""

    def stage_diagnostics(self) -> list[dict[str, float]]:
        """The weight policies' values (staleness, ...) of every stage this process runs, for the per-stage metrics."""


def make_runtime(pipeline: StagePipeline, sharding: ShardedLayers | None = None) -> Runtime:
    """The runtime of the schedule family of the pipeline's options (``sharding``: ``data_parallel="fsdp"``'s
    trunk layers, which only the synchronous schedules take)."""
    options = pipeline.context.options
    family = options.spec.family
    if family == "synchronous":
        return FlushRuntime(pipeline, options.schedule, sharding)
    if family == "asynchronous":
        return AsyncRuntime(pipeline)
    return AvgPipeRuntime(pipeline)


__all__ = [
    "ASYNC_STATE_KEY", "AVGPIPE_STATE_KEY", "AsyncRuntime", "AvgPipeRuntime", "FlushRuntime", "Runtime", "make_runtime",
    "trainable", "unwrapped",
]
