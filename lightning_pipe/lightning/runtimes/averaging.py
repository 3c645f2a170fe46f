"""avgpipe (docs/avgpipe.md): every batch is one round of every parallel pipeline on these devices,
with the replicas' steps and their elastic averaging inside the pipeline; one process may emulate
every stage of them (docs/emulation.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_pipe.engine import AvgPipeRounds, batch_size
from lightning_pipe.engine.emulated_avgpipe import EmulatedAvgPipeRounds
from lightning_pipe.engine.outside import reject_shared
from lightning_pipe.engine.policies import make_clip, merge_states
from lightning_pipe.errors import CheckpointMismatchError, PipeConfigError, SharedParameterError
from lightning_pipe.lightning.module_glue import ModuleStages
from lightning_pipe.lightning.runtimes.common import BaseRuntime, emulated_stage_names, unwrapped
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
        if context.emulating:  # every stage's replicas in this process (docs/emulation.md)
            self.rounds: AvgPipeRounds = EmulatedAvgPipeRounds(pipeline.executor, context.num_stages,  # type: ignore[arg-type]
                                                               context.options.avgpipe)
        else:
            topology = context.topology
            self.rounds = AvgPipeRounds(pipeline.executor, topology.stage, topology.stages, context.options.avgpipe,  # type: ignore[arg-type]
                                        context.tagged)

    def attach(self, pipeline: StagePipeline) -> None:
        super().attach(pipeline)
        self.rounds.executor = pipeline.executor  # type: ignore[assignment]

    def training_step(self, args: tuple, kwargs: dict, measuring: bool) -> Tensor:
        """One round: every replica's forwards, backwards, STEP and AVG; returns the mean loss."""

        def split(batch: Any) -> list[Any]:
            return self.rounds.split(batch, int(self.context.options.micro_batches), first=not self.pipeline.seen_batch)[0]

        def launch(micro_batches: list[Any], stages: ModuleStages) -> list[Any]:
            if not self.rounds.policies:
                self._start(stages, micro_batches[0])
            count = len(micro_batches) // self.rounds.options.parallel_pipelines  # per replica
            weights = self.rounds.loss_weights([batch_size(mb) for mb in micro_batches], count)
            return self.rounds.run_round(micro_batches, weights, count)

        with self.context.precision_plugin.train_step_context():
            ran = self.pipeline.run("training_step", args, kwargs, True, split, launch)
        self.pipeline.seen_batch = True
        outside = self.pipeline.outside
        if not outside.known:  # an emulated pipeline learned it at the start
            with self.pipeline.watchdog.guard("which stages use the parameters outside the trunk"):
                outside.learn(self.rounds.used_names)
            # every rank learned the same map, so every rank raises
            reject_shared(outside.users, "which avgpipe replicas step independently", SharedParameterError)
        return self.pipeline.replayed_loss(ran)

    def backward(self) -> None:
        """Nothing to put back: every replica stepped inside the round."""

    def stage_diagnostics(self) -> list[dict[str, float]]:
        """How far the replicas drifted from the center (root mean square over replicas of ``||W^(n) - C||``),
        on every stage this process runs."""
        policies = self.rounds.policies
        return [{"replica_distance": policy.distance()} for policy in policies] if policies else [{}]

    def _start(self, stages: ModuleStages, micro_batch: Any) -> None:
        """Create the replicas and the center at the first round (after any checkpoint was restored); an
        emulated pipeline first finds each stage's parameters on ``micro_batch`` and splits the optimizer by stage."""
        context, module = self.context, self.pipeline.module
        trainer = module.trainer
        if getattr(context.precision_plugin, "scaler", None) is not None:
            raise PipeConfigError("schedule='avgpipe' steps inside the pipeline without fp16 loss scaling; "
                                  "use precision='bf16-mixed' or 32.")
        optimizer, micro_batches = unwrapped(trainer.optimizers[0]), int(context.options.micro_batches)
        clip = make_clip(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        if isinstance(self.rounds, EmulatedAvgPipeRounds):
            names = emulated_stage_names(self.pipeline, stages, micro_batch)
            self.rounds.start_stages(module, optimizer, micro_batches, clip, names)
            return
        data_parallel = context.num_pipelines > 1
        self.rounds.start(module, optimizer, micro_batches, clip, context.topology.stage_group if data_parallel else None,
                          context.num_pipelines)

    def checkpoint_state(self, policy: bool = True) -> dict[str, Any]:
        o = self.context.options
        state: dict[str, Any] = {  # what a resumed run with "auto" options adopts instead of tuning again
            AVGPIPE_CONFIG_KEY: options_record(int(o.avgpipe.parallel_pipelines), int(o.micro_batches), int(o.avgpipe.advance_forward)),
        }
        if self.rounds.policies and policy:
            parts = self.pipeline.gather_in_first_pipeline(self.rounds.state_dict())
            if parts:
                state[AVGPIPE_STATE_KEY] = merge_states(parts, self.pipeline.outside.owner())
        return state

    def policy_state(self) -> tuple[str, Any] | None:
        return (AVGPIPE_STATE_KEY, self.rounds.state_dict()) if self.rounds.policies else None

    def optimizer_parts(self) -> list[tuple[dict[str, Any], list[list[str]]]] | None:
        """Every emulated stage's optimizer share (holding replica 0's state, as each process's optimizer does)."""
        rounds = self.rounds
        if not isinstance(rounds, EmulatedAvgPipeRounds) or not rounds.policies:
            return None
        return rounds.optimizer_parts()

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
