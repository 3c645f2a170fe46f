"""Asynchronous schedules (pipedream, pipedream_2bw, pipemare, xpipe; docs/async-semantics.md).

Within an epoch the micro-batches form one stream: every batch runs one window of it, the weight
policy steps the optimizer per mini-batch inside the pipeline, and a drain finishes what is in
flight before evaluation, checkpoints and the epoch's end. The synchronous warm-up (the first
``sync_warmup_epochs`` epochs and ``sync_warmup_steps`` steps) runs the schedule's flushed
counterpart instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_pipe import registry
from lightning_pipe.engine import AsyncSegments, batch_size, split_micro_batches
from lightning_pipe.engine.emulated import EmulatedAsyncSegments
from lightning_pipe.engine.outside import reject_shared
from lightning_pipe.engine.policies import make_clip, merge_states
from lightning_pipe.errors import CheckpointMismatchError, PipeConfigError, SharedParameterError
from lightning_pipe.lightning.log_replay import silenced
from lightning_pipe.lightning.module_glue import ModuleStages
from lightning_pipe.lightning.runtimes.common import BaseRuntime, emulated_stage_names, unwrapped
from lightning_pipe.lightning.runtimes.flush import FlushRuntime

if TYPE_CHECKING:
    from lightning_pipe.lightning.pipeline import StagePipeline

ASYNC_STATE_KEY = "pipe_async_state"  #: per stage: what resuming an asynchronous schedule exactly needs


def check_policy_kind(state: dict[str, Any], schedule: str) -> None:
    """Raise :class:`CheckpointMismatchError` when ``state`` is another schedule's weight-policy state: its
    stashed versions, velocity or last gradient mean nothing to this schedule's policy, so the run could
    not continue as the checkpoint's would (a synchronous checkpoint has no policy state: any resumes it)."""
    saved, wanted = state.get("policy"), registry.spec(schedule).policy
    if saved is None or wanted is None or saved == wanted.__name__:
        return
    writers = [n for n, row in registry.SCHEDULES.items() if row.policy is not None and row.policy.__name__ == saved]
    writer = f"schedule={writers[0]!r}" if writers else f"a {saved}"
    raise CheckpointMismatchError(
        f"the checkpoint holds {writer}'s weight-policy state ({saved}), which schedule={schedule!r} cannot continue "
        f"from; resume it with {writer if writers else 'that schedule'}, or start the new schedule from its weights "
        "(MyModule.load_from_checkpoint, or lightning_pipe.load_stage_weights in on_fit_start)."
    )


class AsyncRuntime(BaseRuntime):
    """An asynchronous schedule (docs/async-semantics.md): windows of one stream per epoch.

    The weight policy is created at the first asynchronous step, after any checkpoint was restored;
    from then on the policy steps the optimizer (and a step-interval lr scheduler) per mini-batch.
    """

    def __init__(self, pipeline: StagePipeline) -> None:
        super().__init__(pipeline)
        context = pipeline.context
        options, row = context.options, context.options.spec
        assert row.policy is not None
        micro_batches = int(options.micro_batches)
        if context.emulating:
            self.segments: AsyncSegments = EmulatedAsyncSegments(
                options.schedule, row.policy, pipeline.executor, context.num_stages, micro_batches)  # type: ignore[arg-type]
        else:
            topology = context.topology
            self.segments = AsyncSegments(options.schedule, row.policy, pipeline.executor, topology.stage, topology.stages,
                                          micro_batches)  # type: ignore[arg-type]
        self.warmup = FlushRuntime(pipeline, row.flushed)
        self._started_with: tuple[tuple[int, ...], int] = ((), 0)  # _trained_parameters() when the policy was made

    def attach(self, pipeline: StagePipeline) -> None:
        super().attach(pipeline)
        self.warmup.attach(pipeline)
        self.segments.executor = pipeline.executor  # type: ignore[assignment]

    @property
    def active(self) -> bool:
        """Whether this batch runs the asynchronous schedule (after the synchronous warm-up's epochs
        and steps; once asynchronous, a run stays so)."""
        if self.segments.policy is not None:
            return True
        trainer, options = self.pipeline.module.trainer, self.context.options
        return trainer.current_epoch >= options.sync_warmup_epochs and trainer.global_step >= options.sync_warmup_steps

    @property
    def steps_inside(self) -> bool:
        return self.active

    def training_step(self, args: tuple, kwargs: dict, measuring: bool) -> Tensor:
        if not self.active:
            return self.warmup.training_step(args, kwargs, measuring)
        context, module = self.context, self.pipeline.module

        def split(batch: Any) -> list[Any]:
            return split_micro_batches(batch, self.pipeline.micro_batch_count(batch_size(batch), True))

        def launch(micro_batches: list[Any], stages: ModuleStages) -> list[Any]:
            if self.segments.policy is None:
                self._start(stages, micro_batches[0])
                self._started_with = self._trained_parameters()
            else:
                self._check_trained_parameters()
            every = context.options.grad_cosine_every
            cosine = every > 0 and module.trainer.global_step % every == 0
            for policy in self.segments.policies:  # weight_lag costs a pass over the weights: logged steps only
                policy.track_lag(measuring)
                policy.request_cosine(cosine)  # grad_cosine recomputes one micro-batch: every K-th step only
            if cosine:  # the recompute runs the step again, whose self.log was recorded once already
                executor = self.pipeline.executor
                for each in getattr(executor, "executors", [executor]):
                    each.recompute_context = lambda: silenced(module)
            sizes = [batch_size(mb) for mb in micro_batches]
            scaler = getattr(context.precision_plugin, "scaler", None)
            return self.segments.run_window(micro_batches, [s / sum(sizes) for s in sizes], scaler.scale if scaler else None)

        # an asynchronous window keeps accumulating into the gradients of unfinished mini-batches
        with context.precision_plugin.train_step_context():
            ran = self.pipeline.run("training_step", args, kwargs, True, split, launch)
        self.pipeline.seen_batch = True
        if self.segments.short is not None or self._ends_segment(args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)):
            self.drain()  # a short batch's mini-batch steps in the drain
        self._keep_aside()
        return self.pipeline.replayed_loss(ran)

    def backward(self) -> None:
        if not self.active:
            self.warmup.backward()
            return
        self._put_back()

    def _start(self, stages: ModuleStages, micro_batch: Any) -> None:
        """Create the weight policy at the first asynchronous step; Lightning stops stepping.

        An emulated pipeline first finds which stage uses each parameter outside the trunk, on
        ``micro_batch``, and gives every stage its own optimizer share and scheduler copy."""
        options = self.context.options
        module = self.pipeline.module
        trainer = module.trainer
        optimizer = unwrapped(trainer.optimizers[0])
        step_schedulers = [c for c in trainer.lr_scheduler_configs if c.interval == "step"]
        if len(step_schedulers) > 1:
            raise PipeConfigError(f"schedule={options.schedule!r} supports one step-interval lr scheduler, "
                                  f"got {len(step_schedulers)}.")
        for config in step_schedulers:
            config.interval = "pipeline stage step"  # hidden from Lightning: the policy steps it per STEP
        scheduler = step_schedulers[0].scheduler if step_schedulers else None
        clip = make_clip(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        if not isinstance(self.segments, EmulatedAsyncSegments):
            self.segments.start(module, optimizer, options.asynchronous, scheduler, clip, trainer.global_step)
            return
        names = emulated_stage_names(self.pipeline, stages, micro_batch)
        self.segments.start_stages(module, optimizer, options.asynchronous, scheduler, clip, trainer.global_step, names)
        for config in trainer.lr_scheduler_configs:  # Lightning saves (and LearningRateMonitor reads) stage 0's
            if config.scheduler is scheduler:
                config.scheduler = self.segments.schedulers[0]

    def _trained_parameters(self) -> tuple[tuple[int, ...], int]:
        """What the weight policy was made for: the optimizer's param-group sizes, and how many of the module's
        parameters train (a pass over the parameters' flags: microseconds per step)."""
        module = self.pipeline.module
        groups = unwrapped(module.trainer.optimizers[0]).param_groups
        return tuple(len(group["params"]) for group in groups), sum(p.requires_grad for p in module.parameters())

    def _check_trained_parameters(self) -> None:
        """Refuse a change of what trains after the policy was made: it keeps versions (or masters) of the
        parameters that trained at the first asynchronous step, and would not step the others as the schedule says."""
        (groups, trained), (groups_then, trained_then) = self._trained_parameters(), self._started_with
        if (groups, trained) == (groups_then, trained_then):
            return
        schedule = self.context.options.schedule
        raise PipeConfigError(
            f"the parameters being trained changed after schedule={schedule!r} started (param groups of "
            f"{list(groups_then)} tensors, {trained_then} trainable, are now {list(groups)} and {trained}: "
            "BackboneFinetuning unfreezing a backbone, optimizer.add_param_group, a requires_grad switched), but its "
            "weight policy holds the versions of the parameters that trained at its first step. Make the change "
            "during the synchronous warm-up (PipeStrategy(sync_warmup_epochs=N), N the epoch it happens at), or use "
            "a synchronous schedule such as '1f1b'."
        )

    def _ends_segment(self, batch_idx: int) -> bool:
        """Whether this batch is the last one before the epoch (or the run) ends."""
        trainer = self.pipeline.module.trainer
        loop = trainer.fit_loop.epoch_loop
        last_of_epoch = loop.batch_progress.is_last_batch or batch_idx + 1 >= trainer.num_training_batches
        last_of_run = trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps
        return last_of_epoch or last_of_run

    def drain(self) -> None:
        if not self.segments.in_flight:
            return
        try:
            self.segments.drain()
        except BaseException as error:
            self.pipeline.watchdog.report(error)
            raise
        outside = self.pipeline.outside
        if not outside.known and not self.context.emulating:
            with self.pipeline.watchdog.guard("which stages use the parameters outside the trunk"):
                outside.learn(self.segments.policy.used_names)
            # every rank learned the same map, so every rank raises
            reject_shared(outside.users, f"which step at different times under schedule={self.context.options.schedule!r}",
                          SharedParameterError)

    def stage_diagnostics(self) -> list[dict[str, float]]:
        """Staleness, weight copies and correction, prediction or look-ahead size of every stage this
        process runs; during a synchronous warm-up the values of synchronous training."""
        if not self.active or not self.segments.policies:
            return super().stage_diagnostics()
        return [policy.diagnostics() for policy in self.segments.policies]

    def checkpoint_state(self, policy: bool = True) -> dict[str, Any]:
        if self.segments.policy is None or not policy:
            return {}
        self.drain()
        parts = self.pipeline.gather_in_first_pipeline(self.segments.state_dict())
        return {ASYNC_STATE_KEY: merge_states(parts, self.pipeline.outside.owner())} if parts else {}

    def policy_state(self) -> tuple[str, Any] | None:
        if self.segments.policy is None:
            return None
        self.drain()
        return ASYNC_STATE_KEY, self.segments.state_dict()

    def restore(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(ASYNC_STATE_KEY)
        if isinstance(state, list):  # lightning_pipe 0.1 saved one entry per stage, each keyed by name too
            state = merge_states(state, self.pipeline.outside.owner())
        if state is not None:
            check_policy_kind(state, self.context.options.schedule)
            self.segments.restore(state)

    def optimizer_parts(self) -> list[tuple[dict[str, Any], list[list[str]]]] | None:
        if not isinstance(self.segments, EmulatedAsyncSegments) or not self.segments.policies:
            return None
        return self.segments.optimizer_parts()

    def parameter_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for policy in self.segments.policies:  # live policies step master copies
            names.update({id(m): n for n, m in getattr(policy, "masters", {}).items()})
        return names
