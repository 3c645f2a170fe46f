"""What every runtime shares: the protocol's defaults and keeping gradients out of Lightning's reach."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_pipe.engine.stand_ins import is_absent
from lightning_pipe.errors import SharedParameterError
from lightning_pipe.lightning.log_replay import LogCapture
from lightning_pipe.lightning.module_glue import ModuleStages, stage_parameter_names

if TYPE_CHECKING:
    from lightning_pipe.lightning.context import PipeContext
    from lightning_pipe.lightning.pipeline import StagePipeline


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ``module`` this rank trains (not the stand-ins of :mod:`lightning_pipe.engine.stand_ins`)."""
    return [p for p in module.parameters() if p.requires_grad and not is_absent(p)]


def unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (or ``optimizer`` itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def emulated_stage_names(pipeline: StagePipeline, stages: ModuleStages, micro_batch: Any) -> list[set[str]]:
    """The parameter names each emulated stage owns: its trunk layers and the parameters outside the trunk its
    part of the step trains, found by running every stage once on ``micro_batch`` (logs not recorded); the
    pipeline's map of those outside parameters learns them, as the distributed run's first step teaches it.

    Raises:
        SharedParameterError: a parameter outside the trunk is used on several stages, which step on their own.
    """
    module, partition, outside = pipeline.module, pipeline.partition, pipeline.outside
    probe = ModuleStages(stages.step, stages.partition, stages.virtual_stages, LogCapture(module), stages.output_to_loss)
    try:
        with probe.capture:
            names = stage_parameter_names(module, partition.bounds, partition.trunk, probe.chunk_callables(), micro_batch)
    except SharedParameterError as error:
        schedule = pipeline.context.options.schedule
        raise SharedParameterError(str(error).replace("an asynchronous schedule", f"schedule={schedule!r}")) from None
    outside.users = {n: [s] for s, owned in enumerate(names) for n in owned if not outside.in_trunk(n)}
    return names


class BaseRuntime:
    """Defaults of the protocol: nothing in flight, nothing extra to save.

    A runtime reads the fixed facts from its pipeline's :class:`~lightning_pipe.lightning.context.PipeContext`
    (the current Trainer call's), and Lightning's changing state (the trainer, its optimizers) from the module
    the pipeline cut."""

    def __init__(self, pipeline: StagePipeline) -> None:
        self.pipeline = pipeline
        self._kept: list[Tensor | None] = []

    @property
    def context(self) -> PipeContext:
        return self.pipeline.context

    def attach(self, pipeline: StagePipeline) -> None:
        self.pipeline = pipeline

    def drain(self) -> None: ...

    def checkpoint_state(self, policy: bool = True) -> dict[str, Any]:
        return {}

    def policy_state(self) -> tuple[str, Any] | None:
        return None

    def restore(self, checkpoint: dict[str, Any]) -> None: ...

    def optimizer_parts(self) -> list[tuple[dict[str, Any], list[list[str]]]] | None:
        return None

    def parameter_names(self) -> dict[int, str]:
        return {}

    def stage_diagnostics(self) -> list[dict[str, float]]:
        # synchronous training: every backward sees the weights its forward saw, no extra copies
        stages = self.context.num_stages if self.context.emulating else 1
        return [{"staleness": 0.0, "weight_copies": 0.0} for _ in range(stages)]

    def _keep_aside(self) -> None:
        """Take the gradients the step produced out of Lightning's reach (its ``zero_grad`` comes next)."""
        params = trainable(self.pipeline.module)
        self._kept = [p.grad for p in params]
        for p in params:
            p.grad = None

    def _put_back(self) -> None:
        for p, grad in zip(trainable(self.pipeline.module), self._kept):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad
        self._kept = []
