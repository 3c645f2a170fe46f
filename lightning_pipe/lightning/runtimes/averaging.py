"""avgpipe (docs/avgpipe.md): every batch is one round of every parallel pipeline on these devices,
with the replicas' steps and their elastic averaging inside the pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_pipe.engine import AvgPipeRounds, batch_size
from lightning_pipe.engine.outside import reject_shared
from lightning_pipe.engine.policies import make_clip, merge_states
from lightning_pipe.errors import CheckpointMismatchError, PipeConfigError, SharedParameterError
from lightning_pipe.lightning.module_glue import ModuleStages
from lightning_pipe.lightning.runtimes.common import BaseRuntime, unwrapped
from lightning_pipe.lightning.sharded import SHARDED_KEY
from lightning_pipe.planning.avgpipe_autotune import CHECKPOINT_KEY as AVGPIPE_CONFIG_KEY
from lightning_pipe.planning.avgpipe_autotune import options_record

if TYPE_CHECKING:
    from lightning_pipe.lightning.pipeline import StagePipeline

AVGPIPE_STATE_KEY = "pipe_avgpipe_state"  #: per stage: replicas, their optimizer states, round count


class AvgPipeRuntime(BaseRuntime):
    """avgpipe (docs/avgpipe.md): every batch is one round of every parallel pipeline on these devices."""

    steps_inside = True

    def __init__(self, pipeline: StagePipeline) -> None:
        super().__init__(pipeline)
        context = pipeline.context
        if context.emulating:
            raise PipeConfigError(
                "schedule='avgpipe' runs one process per stage and cannot be emulated in one process; "
                "set devices to the number of stages (or stages=None)."
            )
        topology = context.topology
        self.rounds = AvgPipeRounds(pipeline.executor, topology.stage, topology.stages, context.options.avgpipe,  # type: ignore[arg-type]
                                    context.tagged)

    def attach(self, pipeline: StagePipeline) -> None:
        super().attach(pipeline)
        self.rounds.executor = pipeline.executor  # type: ignore[assignment]

    def training_step(self, args: tuple, kwargs: dict, measuring: bool) -> Tensor:
        """One round: every replica's forwards, backwards, STEP and AVG; returns the mean loss."""
        if self.rounds.policy is None:
            self._start()

        def split(batch: Any) -> list[Any]:
            return self.rounds.split(batch, int(self.context.options.micro_batches), first=not self.pipeline.seen_batch)[0]

        def launch(micro_batches: list[Any], _: ModuleStages) -> list[Any]:
            count = len(micro_batches) // self.rounds.options.parallel_pipelines  # per replica
            weights = self.rounds.loss_weights([batch_size(mb) for mb in micro_batches], count)
            return self.rounds.run_round(micro_batches, weights, count)

        with self.context.precision_plugin.train_step_context():
            ran = self.pipeline.run("training_step", args, kwargs, True, split, launch)
        self.pipeline.seen_batch = True
        outside = self.pipeline.outside
        if not outside.known:
            with self.pipeline.watchdog.guard("which stages use the parameters outside the trunk"):
                outside.learn(self.rounds.policy.used_names)
            # every rank learned the same map, so every rank raises
            reject_shared(outside.users, "which avgpipe replicas step independently", SharedParameterError)
        return self.pipeline.replayed_loss(ran)

    def backward(self) -> None:
        """Nothing to put back: every replica stepped inside the round."""

    def stage_diagnostics(self) -> list[dict[str, float]]:
        """How far the replicas drifted from the center (root mean square over replicas of ``||W^(n) - C||``)."""
        policy = self.rounds.policy
        return [{"replica_distance": policy.distance()}] if policy is not None else [{}]

    def _start(self) -> None:
        """Create the replicas and the center at the first round (after any checkpoint was restored)."""
        context, module = self.context, self.pipeline.module
        trainer = module.trainer
        if getattr(context.precision_plugin, "scaler", None) is not None:
            raise PipeConfigError("schedule='avgpipe' steps inside the pipeline without fp16 loss scaling; "
                                  "use precision='bf16-mixed' or 32.")
        data_parallel = context.num_pipelines > 1
        self.rounds.start(
            module, unwrapped(trainer.optimizers[0]), int(context.options.micro_batches),
            make_clip(trainer.gradient_clip_val, trainer.gradient_clip_algorithm),
            context.topology.stage_group if data_parallel else None, context.num_pipelines,
        )

    def checkpoint_state(self, policy: bool = True) -> dict[str, Any]:
        o = self.context.options
        state: dict[str, Any] = {  # what a resumed run with "auto" options adopts instead of tuning again
            AVGPIPE_CONFIG_KEY: options_record(int(o.avgpipe.parallel_pipelines), int(o.micro_batches), int(o.avgpipe.advance_forward)),
        }
        if self.rounds.policy is not None and policy:
            parts = self.pipeline.gather_in_first_pipeline(self.rounds.policy.state_dict())
            if parts:
                state[AVGPIPE_STATE_KEY] = merge_states(parts, self.pipeline.outside.owner())
        return state

    def policy_state(self) -> tuple[str, Any] | None:
        return None if self.rounds.policy is None else (AVGPIPE_STATE_KEY, self.rounds.policy.state_dict())

    def restore(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(AVGPIPE_STATE_KEY)
        if isinstance(state, list):  # lightning_pipe 0.1 saved one entry per stage, each keyed by name too
            state = merge_states(state, self.pipeline.outside.owner())
        if state is None:
            return
        saved, replicas = len(state["weights"]), self.rounds.options.parallel_pipelines
        if isinstance(replicas, int) and saved != replicas:  # each replica's weights and optimizer state belong to that replica: no mapping
            # "auto" adopts a single file's values before setup; a sharded checkpoint is read after it
            adopts = "" if SHARDED_KEY in checkpoint else " (or 'auto', which adopts the checkpoint's)"
            raise CheckpointMismatchError(
                f"the checkpoint holds {saved} avgpipe replicas but this run has parallel_pipelines={replicas}; resume "
                f"with avgpipe={{'parallel_pipelines': {saved}}}{adopts}."
            )
        self.rounds.restore(state)
