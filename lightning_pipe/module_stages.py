"""Chunk callables that run an ordinary LightningModule's step as pipeline stages.

The first virtual stage runs the user's step until the trunk call (code before the trunk, e.g. an
embedding, runs there) and ships the trunk output of its layers; middle stages only run their
layers; the last virtual stage runs the user's step again with the trunk call answered by its
layers applied to the received activation, so the code after the trunk and the loss run there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_pipe.engine.stage import batch_size
from lightning_pipe.log_replay import LogCapture
from lightning_pipe.partition.split import PartitionedTrunk, StageStop


def step_loss(output: Any, hook: str) -> Tensor:
    """The loss tensor of a training-step output (a tensor or a dict with ``"loss"``)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    raise TypeError(
        f"{hook} returned {type(output).__name__}; under a pipeline strategy it must return the loss tensor "
        "(or a dict with a 'loss' tensor) for every batch."
    )


class ModuleStages:
    """Builds the executor's chunk callables for one rank.

    Args:
        step: the user's step bound to its extra arguments, ``step(micro_batch) -> output``.
        partition: this rank's trunk share.
        virtual_stages: total virtual stages of the pipeline.
        capture: records ``self.log`` calls of the step.
        output_to_loss: extracts the loss from the step's output (``None`` for forward-only use).
    """

    def __init__(
        self,
        step: Callable[[Any], Any],
        partition: PartitionedTrunk,
        virtual_stages: int,
        capture: LogCapture,
        output_to_loss: Callable[[Any], Any],
    ) -> None:
        self.step = step
        self.partition = partition
        self.virtual_stages = virtual_stages
        self.capture = capture
        self.output_to_loss = output_to_loss

    def chunk_callables(self) -> list[Callable[[Any, Any], Any]]:
        return [self._callable(chunk, vs) for chunk, vs in enumerate(self.partition.local)]

    def _callable(self, chunk: int, vs: int) -> Callable[[Any, Any], Any]:
        first, last = vs == 0, vs == self.virtual_stages - 1
        partition = self.partition

        def whole(_: Any, micro_batch: Any) -> Any:
            return self._run_step(micro_batch, lambda x: partition.run_chunk(chunk, x))

        def head(_: Any, micro_batch: Any) -> Any:
            def stop(x: Any) -> Any:
                raise StageStop(partition.run_chunk(chunk, x))

            try:
                self._run_step(micro_batch, stop)
            except StageStop as done:
                return done.output
            raise RuntimeError(
                f"the step finished without calling {partition.name}; the first pipeline stage needs the step to "
                f"call self.{partition.name}(...) exactly once."
            )

        def middle(inputs: Any, _: Any) -> Any:
            return partition.run_chunk(chunk, inputs)

        def tail(inputs: Any, micro_batch: Any) -> Any:
            return self._run_step(micro_batch, lambda _ignored: partition.run_chunk(chunk, inputs))

        if first and last:
            return whole
        return head if first else tail if last else middle

    def _run_step(self, micro_batch: Any, behaviour: Callable[[Any], Any]) -> Any:
        self.capture.batch_size = batch_size(micro_batch)
        with self.partition.acting(behaviour):
            return self.output_to_loss(self.step(micro_batch))
