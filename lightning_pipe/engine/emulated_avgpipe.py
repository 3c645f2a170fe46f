"""avgpipe's parallel pipelines, every stage of them, in one process (docs/emulation.md).

:class:`EmulatedAvgPipeRounds` runs the rounds of :class:`~.avgpipe_rounds.AvgPipeRounds` through a
:class:`~.local.LocalPipeline`: the same merged schedule (:func:`~lightning_pipe.schedules.build_avgpipe`),
the same executors and one :class:`~.policies.ElasticAveraging` per stage, as ``P`` processes run them.
Each stage holds what its own process would:

* its share of the parameters (its trunk layers and the parameters outside the trunk its part of the
  step trains; the caller finds them);
* its own optimizer over that share (:func:`~.stage_optimizers.stage_optimizer`), so its policy keeps
  each replica's optimizer state of that share, its replicas' weights and its part of the center.

The in-process queues are untagged, like NCCL: every replica's messages on a link share one queue, so
the merged order must keep one FIFO order across replicas, which :meth:`AvgPipeRounds.schedule` checks
(the validator's dry run with ``replica_channels=False``) before the first round of each shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.engine.avgpipe_rounds import AvgPipeRounds
from lightning_pipe.engine.executor import RunOptions
from lightning_pipe.engine.local import LocalPipeline, LocalTransport
from lightning_pipe.engine.policies import AvgPipeOptions, Clip, ElasticAveraging
from lightning_pipe.engine.stage_optimizers import HyperparameterMirror, group_names, stage_optimizer


class EmulatedAvgPipeRounds(AvgPipeRounds):
    """:class:`~.avgpipe_rounds.AvgPipeRounds` for every stage of the pipelines, in this process.

    Args:
        pipeline: the in-process pipeline; each of its executors runs its stage's policy during a round
            (and none in between, so evaluation runs on the center the module's parameters point at).
        stages: stages emulated.
        options: avgpipe's options (numbers: the tuner's ``"auto"`` needs one process per stage).
    """

    def __init__(self, pipeline: LocalPipeline, stages: int, options: AvgPipeOptions) -> None:
        super().__init__(pipeline, 0, stages, options, tagged=LocalTransport.tagged)  # type: ignore[arg-type]
        self.optimizers: list[torch.optim.Optimizer] = []
        self._mirror: HyperparameterMirror | None = None

    @property
    def pipeline(self) -> LocalPipeline:
        """The in-process pipeline (``executor``, which a new setup replaces)."""
        return self.executor  # type: ignore[return-value]

    def start(
        self, root: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int,
        clip: Clip | None, gradient_group: Any = None, gradient_world: int = 1,
    ) -> ElasticAveraging:
        raise TypeError("an emulated avgpipe starts every stage at once: call start_stages with each stage's parameter names.")

    def start_stages(
        self, root: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int, clip: Clip | None,
        stage_names: Sequence[set[str]],
    ) -> list[ElasticAveraging]:
        """Split ``optimizer`` by stage and create every stage's replicas and center from the module's
        current weights (at the first round), then load a checkpoint's replicas if :meth:`restore` was
        given some. ``stage_names[s]``: the parameter names stage ``s`` owns."""
        if len(stage_names) != self.stages:
            raise ValueError(f"expected the parameter names of {self.stages} stages, got {len(stage_names)}.")
        name_of = {id(p): n for n, p in root.named_parameters()}
        self.optimizers = [stage_optimizer(optimizer, set(names), name_of) for names in stage_names]
        o = self.options
        self.policies = [
            ElasticAveraging(root, stage_opt, s, self.stages, micro_batches, o.parallel_pipelines, o.resolved_alpha,
                             o.period, o.averaging, clip, names=names)
            for s, (names, stage_opt) in enumerate(zip(stage_names, self.optimizers))
        ]
        self.policy = self.policies[0]
        self.load_restored()
        # Lightning steps its lr schedulers on the optimizer it was given; each process's would step its own
        self._mirror = HyperparameterMirror(optimizer, self.optimizers)
        return self.policies

    def _follow_original(self) -> None:
        """Hyperparameters Lightning changed in its optimizer since the last look go to every stage's optimizer,
        as each process's scheduler would change its own."""
        if self._mirror is not None:
            self._mirror.follow()

    def run_round(self, micro_batches: Sequence[Any], weights: Sequence[float], count: int) -> list[Any]:
        """One round of every replica on every stage (arguments as :meth:`AvgPipeRounds.run_round`)."""
        self._follow_original()
        executors = self.pipeline.executors
        for executor, policy in zip(executors, self.policies):
            executor.policy = policy
        try:
            return self.pipeline.run(self.schedule(count), micro_batches, RunOptions(loss_weights=weights))
        finally:
            for executor in executors:
                executor.policy = None

    def param_names(self, stage: int) -> list[list[str]]:
        """Parameter names of every param group of ``stage``'s optimizer (frozen parameters, which the policy leaves
        alone, too)."""
        return group_names(self.optimizers[stage], self.policies[stage].root)

    def optimizer_parts(self) -> list[tuple[dict[str, Any], list[list[str]]]]:
        """Every stage's optimizer state (holding replica 0's, as each process's optimizer does) and
        :meth:`param_names`, with what Lightning changed in its optimizer since the last round handed over first
        (an lr scheduler stepped after it), as each process's own scheduler has already applied it."""
        self._follow_original()
        return [(optimizer.state_dict(), self.param_names(s)) for s, optimizer in enumerate(self.optimizers)]
