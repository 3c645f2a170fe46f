"""PipeStrategy: Lightning glue around the pipeline engine.

Everything pipeline-specific lives in the engine (schedules, executor, p2p); this module only maps
Lightning's hooks onto it:

* ``connect``: validate the options against the Trainer and the module, before any process group.
* ``setup_environment``: process groups per pipeline and per stage.
* ``setup``: cut the trunk, keep this rank's layers, build the executor, then the optimizers.
* ``training_step``: run the whole micro-batch schedule (forwards and backwards), stash the
  gradients (Lightning zeroes gradients between ``training_step`` and ``backward``), replay the last
  stage's ``self.log`` calls on every rank, return the detached loss.
* ``backward``: put the stashed gradients back and all-reduce them across pipelines.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed import ReduceOp
from torchmetrics import Metric

from lightning_pipe.checkpoint import check_keys, merge_optimizer_states, merge_state_dicts, slice_optimizer_state
from lightning_pipe.async_options import AsyncOptions, Prediction
from lightning_pipe.async_runtime import AsyncRuntime, make_clip
from lightning_pipe import avg_autotune
from lightning_pipe.auto_balance import AutoBalance, AutoBalanceOptions, agreed_plan, memory_limit, profile_and_split, refine
from lightning_pipe.avg_autotune import AutoValues
from lightning_pipe.avg_runtime import AvgOptions, AvgRuntime, keeps_one_fifo_order
from lightning_pipe.avg_trials import TrialStage
from lightning_pipe.config import (
    PipeConfigError, check_async_trainer, check_avgpipe_options, check_module, check_options, resolve_stages,
)
from lightning_pipe.emulated import EmulatedAsyncRuntime, SharedParameterError, stage_parameter_names
from lightning_pipe.engine import Executor, Transport, Watchdog, batch_size, split_micro_batches
from lightning_pipe.engine.local import LocalPipeline
from lightning_pipe.log_replay import LogCapture, combine, replay
from lightning_pipe.model_summary import freeze_model_summaries
from lightning_pipe.module_stages import ModuleStages, step_loss
from lightning_pipe.outputs import detach_to_cpu, merge_outputs
from lightning_pipe.outside_params import OutsideParameters, reject_shared
from lightning_pipe.partition import find_trunk, stage_bounds
from lightning_pipe.partition.planner import Plan, format_bytes
from lightning_pipe.partition.split import PartitionedTrunk
from lightning_pipe.schedules import ASYNC_SCHEDULES, SYNC_SCHEDULES, build_schedule
from lightning_pipe.topology import Topology
from lightning_pipe.tracing import RunTracer, check_trace_options
from lightning_pipe.trials import device_clock

BALANCE_KEY = "pipe_balance"  #: where a checkpoint keeps the layer counts per (virtual) stage

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "pipedream", "pipedream_2bw", "pipemare", "xpipe", "avgpipe"]

_DESCRIPTIONS = {
    "gpipe": "GPipe pipeline: all forwards, then all backwards, one step per batch",
    "1f1b": "1F1B (PipeDream-Flush) pipeline: GPipe's result with at most one micro-batch per stage in flight",
    "interleaved_1f1b": "interleaved 1F1B pipeline: several chunks per device, a smaller bubble",
    "pipedream": "asynchronous PipeDream pipeline with weight stashing (no flush)",
    "pipedream_2bw": "asynchronous PipeDream-2BW pipeline: double-buffered 1-stale weights (no flush)",
    "pipemare": "asynchronous PipeMare pipeline: lr rescheduling and discrepancy correction, no stash",
    "xpipe": "asynchronous XPipe pipeline: weight prediction from the optimizer state",
    "avgpipe": "AvgPipe: parallel pipelines on the same devices joined by elastic averaging",
}


class PipeStrategy(DDPStrategy):
    """Pipeline-parallel training of an ordinary LightningModule.

    The module's trunk (one ``nn.Sequential`` attribute) is split into contiguous stages, one
    process per stage; each batch is split into micro-batches that flow through the stages in the
    order of the chosen schedule. Code in ``training_step`` before the trunk call runs on the first
    stage, code after it (and the loss) on the last.

    ``Trainer(devices=1, strategy=PipeStrategy(schedule="pipemare", stages=4))`` emulates a 4-stage
    pipeline in the one process with the same engine code (docs/emulation.md).

    Args:
        schedule: pipeline schedule. ``"gpipe"``: all forwards then all backwards (activation memory
            grows with ``micro_batches``); ``"1f1b"``: same result, at most ``stages`` micro-batches in
            flight; ``"interleaved_1f1b"``: ``chunks_per_stage`` chunks per device, bubble shrinks by that
            factor, needs ``micro_batches`` to be a multiple of ``stages``. All three equal one-device
            training up to float rounding (micro-batch gradients are summed in schedule order; the
            tests require 1e-5 relative). Asynchronous: see ``docs/async-semantics.md``. ``"avgpipe"``:
            ``parallel_pipelines`` replicas of the pipeline share the same devices (their work is
            interleaved so one fills the others' bubbles), each trains on its own part of the batch
            with its own weights and optimizer state, and every stage averages them elastically
            against a center copy that evaluation and checkpoints use (``docs/avgpipe.md``).
        micro_batches: micro-batches each batch is split into (at most the batch size). More
            micro-batches shrink the pipeline bubble ``(P-1)/(M+P-1)``; about ``4 × stages`` is a good start.
        stages: processes per pipeline; default ``world_size // pipelines``. With one process
            (``devices=1``) and ``stages > 1`` the strategy *emulates* a ``stages``-stage pipeline in that
            process: every stage runs the distributed run's code (its own weights policy, optimizer share
            and STEPs, so an asynchronous schedule's delays, stashing and prediction are exact), which lets
            you study a schedule's statistical efficiency without a cluster (docs/emulation.md).
        pipelines: data-parallel pipeline replicas; each gets its own shard of the data and gradients
            are averaged across them, so ``pipelines=N`` equals one device at ``N ×`` the batch size.
        balance: how many trunk layers each stage gets: a list of counts (one per stage, or per virtual
            stage for interleaved), ``"uniform"`` (equal counts), ``"parameters"`` (balanced parameter
            counts) or ``"auto"`` (rank 0 profiles every trunk layer on its device with the first batch
            and picks the split that minimises the slowest stage's predicted time under the memory limits,
            for the given schedule and ``micro_batches``; then every rank measures it for a few steps and
            layers move off the measured bottleneck, ``auto_balance_refine``; docs/planning.md).
        module: attribute path of the trunk ``nn.Sequential``; default: the module's only
            ``nn.Sequential`` attribute.
        chunks_per_stage: chunks (virtual stages) per device for ``"interleaved_1f1b"``; must stay 1 for
            the other schedules.
        checkpoint_activations: recompute each stage's activations during backward instead of keeping
            them (less memory, one extra forward).
        timeout: seconds any rank waits for a peer before failing with a clear error; a rank that
            raises ends every other rank at once with its error message.
        sync_warmup_epochs: asynchronous schedules only: train the first epochs with ``1f1b`` (PipeMare's
            synchronous warm-up), then switch in the same run.
        pipemare_lr_reschedule: PipeMare T1: start stage ``s`` at ``lr / tau_s`` and reach ``lr``
            geometrically over ``pipemare_lr_warmup_steps`` stage steps.
        pipemare_lr_warmup_steps: length ``K`` of T1, in optimizer steps.
        pipemare_correction: PipeMare T2: run backwards with weights corrected by ``-tau * delta``, an
            exponential average of recent updates (one extra weight copy).
        pipemare_correction_decay: decay ``gamma`` of T2's average.
        xpipe_prediction: XPipe's update direction for weight prediction: ``"adam"`` (Adam's
            bias-corrected moments), ``"momentum"`` (SGD's momentum buffer), ``"sgd"`` (the last gradient)
            or ``"auto"`` (by optimizer type).
        parallel_pipelines: avgpipe: pipeline replicas ``N`` on the same devices. Each Lightning batch is
            split into ``N`` replica mini-batches (so the batch size is ``N × B``), each into
            ``micro_batches`` micro-batches. The logged loss is the mean over replicas. ``"auto"`` (and
            ``micro_batches="auto"``, ``advance_forward="auto"``, avgpipe only): at fit start rank 0
            profiles the trunk on the first batch at three micro-batch sizes, ranks the candidates that
            fit ``auto_balance_memory`` by predicted throughput, the best ``avgpipe_trials`` are measured
            on the devices and the fastest is adopted (ALGORITHMS.md section 13; ``docs/avgpipe.md``). A
            resumed run adopts the values stored in its checkpoint.
        avgpipe_alpha: avgpipe: elastic averaging rate; ``None`` means ``0.9 / parallel_pipelines``.
        avgpipe_period: avgpipe: average every that many rounds (batches).
        avgpipe_averaging: avgpipe: ``"async"`` (each replica averages right after its step) or
            ``"sync"`` (after all replicas stepped, against the round's starting center).
        advance_forward: avgpipe: extra warm-up forwards ``a`` on every stage but the last (1F1B when 0;
            ``micro_batches`` or more: all forwards first); costs ``a`` more micro-batches of activations.
            ``"auto"``: the tuner tries 0, 1 and 2.
        avgpipe_trials: avgpipe's tuner (any ``"auto"`` option): how many of the best predicted
            candidates run a few rounds on the devices at fit start (on copies of the stages, so
            training is unchanged) before the fastest measured is chosen; ``0`` or ``1`` trusts the
            prediction alone. The prediction misses per-action costs of a real round, so its close
            calls are often wrong (docs/avgpipe.md).
        trace_dir: record when every action of every rank starts and ends during a few training steps
            and, at the end of ``fit``, write ``timeline.png`` and ``trace.json`` (Chrome trace) there,
            plus each rank's ``events-rank{r}.json`` (docs/simulator.md). Needs matplotlib.
        trace_steps: training steps recorded with ``trace_dir``: steps 2 to ``trace_steps + 1`` of the fit
            (the first pays one-time costs; a one-step fit records that one).
        auto_balance_memory: ``balance="auto"`` and avgpipe's tuner: memory limit per device in GiB (one
            value, or one per stage); default: the device's total memory on CUDA, no limit on CPU.
        auto_balance_speeds: ``balance="auto"`` only: relative speed of each stage's device (e.g.
            ``[1.0, 2.0]`` when the second is twice as fast); default: all equal.
        profile_cache: ``balance="auto"`` only: JSON file caching the per-layer profiles (keyed by model
            structure, input shape and device); default: profile at every start.
        auto_balance_refine: ``balance="auto"`` only: after the planner's split, every rank runs a few
            steps of it on copies of its layers and measures each stage; then up to this many times a
            layer of the measured bottleneck moves to its faster neighbour, kept while the measured
            bottleneck shrinks (ALGORITHMS.md section 12 step 4). ``0``: trust the profile.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: checkpoint writer plugin.
        precision_plugin: set by the Trainer from ``precision=``.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default by device (gloo on CPU, NCCL on CUDA).
    """

    strategy_name = "pipe"

    def __init__(
        self,
        schedule: ScheduleName = "1f1b",
        micro_batches: int | Literal["auto"] = 4,
        stages: int | None = None,
        pipelines: int = 1,
        balance: str | list[int] = "uniform",
        module: str | None = None,
        chunks_per_stage: int | None = None,
        checkpoint_activations: bool = False,
        timeout: float = 1800.0,
        sync_warmup_epochs: int = 0,
        pipemare_lr_reschedule: bool = True,
        pipemare_lr_warmup_steps: int = 100,
        pipemare_correction: bool = True,
        pipemare_correction_decay: float = 0.9,
        xpipe_prediction: Prediction = "auto",
        parallel_pipelines: int | Literal["auto"] = 2,
        avgpipe_alpha: float | None = None,
        avgpipe_period: int = 1,
        avgpipe_averaging: Literal["async", "sync"] = "async",
        advance_forward: int | Literal["auto"] = 0,
        avgpipe_trials: int = 3,
        trace_dir: str | None = None,
        trace_steps: int = 3,
        auto_balance_memory: float | list[float] | None = None,
        auto_balance_speeds: list[float] | None = None,
        profile_cache: str | None = None,
        auto_balance_refine: int = 2,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        if chunks_per_stage is None:
            chunks_per_stage = 2 if schedule == "interleaved_1f1b" else 1
        check_options(schedule, micro_batches, stages, pipelines, chunks_per_stage)
        check_avgpipe_options(schedule, parallel_pipelines, avgpipe_alpha, avgpipe_period, avgpipe_averaging, advance_forward,
                              avgpipe_trials)
        check_trace_options(trace_dir, trace_steps)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout),
        )
        self.schedule = schedule
        self.micro_batches = micro_batches
        self.stages = stages
        self.pipelines = pipelines
        self.balance = balance
        self.module = module
        self.chunks_per_stage = chunks_per_stage
        self.checkpoint_activations = checkpoint_activations
        self.timeout = timeout
        self.sync_warmup_epochs = sync_warmup_epochs
        self.async_options = AsyncOptions(
            pipemare_lr_reschedule, pipemare_lr_warmup_steps, pipemare_correction, pipemare_correction_decay, xpipe_prediction
        )
        # "auto" (avgpipe's tuner) is resolved at setup; until then the options hold placeholders
        self._avg_auto = AutoValues(parallel_pipelines, micro_batches, advance_forward)
        self.avgpipe_trials = avgpipe_trials
        self.avg_options = AvgOptions(parallel_pipelines if parallel_pipelines != "auto" else 1, avgpipe_alpha,
                                      avgpipe_period, avgpipe_averaging, advance_forward if advance_forward != "auto" else 0)
        self._avg: AvgRuntime | None = None
        self.trace_dir, self.trace_steps = trace_dir, trace_steps
        self._tracer: RunTracer | None = None
        if auto_balance_refine < 0:
            raise PipeConfigError(f"auto_balance_refine={auto_balance_refine} must be at least 0 (0: no refinement).")
        self.auto_balance = AutoBalanceOptions(auto_balance_memory, auto_balance_speeds, profile_cache, auto_balance_refine)
        self._plan: Plan | None = None  # balance="auto": the chosen split and its predictions
        self._measured: list[float] | None = None  # balance="auto" refined: each stage's measured time
        self._layer_params: list[int] = []
        self._async: AsyncRuntime | None = None
        self._counts: list[int] | None = None
        self._topology: Topology | None = None
        self._partition: PartitionedTrunk | None = None
        self._executor: Executor | None = None
        self._watchdog: Watchdog | None = None
        self._grad_stash: list[Tensor | None] = []
        self._generation = 0
        self._seen_batch = False
        self._layer_names: list[str] = []
        self._key_order: list[str] = []  # state_dict keys of the unpartitioned module
        self._param_order: list[str] = []  # its parameter names
        self._outside: OutsideParameters | None = None

    # ------------------------------------------------------------------ registration
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name in (*SYNC_SCHEDULES, *ASYNC_SCHEDULES, "avgpipe"):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=_DESCRIPTIONS[name], schedule=name)

    # ------------------------------------------------------------------ setup
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def num_stages(self) -> int:
        return resolve_stages(self.world_size, self.stages, self.pipelines)

    @property
    def num_pipelines(self) -> int:
        return 1 if self.emulating else self.world_size // self.num_stages

    @property
    def emulating(self) -> bool:
        """One process running every stage of a ``stages``-stage pipeline (docs/emulation.md)."""
        return self.world_size == 1 and (self.stages or 1) > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_pipelines, "rank": self.global_rank // self.num_stages}

    def _configure_launcher(self) -> None:
        resolve_stages(self.world_size, self.stages, self.pipelines)  # fail at Trainer(...), before launching
        super()._configure_launcher()

    def connect(self, model: LightningModule) -> None:
        super().connect(model)
        stages = self.num_stages
        self._counts = check_module(  # balance="auto" is resolved in setup; check the layer count now
            model, self.module, "uniform" if self.balance == "auto" else self.balance, stages * self.chunks_per_stage, self.schedule, stages,
            self.micro_batches if self.micro_batches != "auto" else 1,
        )
        if self._avg_auto.any_auto and self.balance == "auto":
            raise PipeConfigError("balance='auto' needs a fixed micro_batches; give layer counts or fix the avgpipe options.")

    def setup_environment(self) -> None:
        super().setup_environment()
        # the processes' topology: an emulated pipeline is one process holding every stage
        stages = 1 if self.emulating else self.num_stages
        self._topology = Topology(stages, self.num_pipelines, self.global_rank)
        self._topology.create_groups()
        self._generation += 1
        self._watchdog = Watchdog.from_process_group(self.timeout, self._generation)

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.precision_plugin.convert_module(module)
        if self._partition is None:
            stored = (trainer._checkpoint_connector._loaded_checkpoint or {}).get(BALANCE_KEY)
            if self.balance == "auto" and stored is not None and len(stored) == len(self._counts):
                # the checkpoint's per-stage state (asynchronous policies, avgpipe replicas) fits only its split
                rank_zero_info(f"lightning_pipe: balance='auto' adopts the checkpoint's split {stored}")
                self._counts = list(stored)
            elif self.balance == "auto":
                self._plan = self._auto_balance(trainer, module)
                self._counts = self._plan.balance
            if self._avg_auto.any_auto:
                self._tune_avgpipe(trainer, module)
            if trainer.state.fn == TrainerFn.FITTING and self._topology.stages > 1:
                freeze_model_summaries(trainer, module, self.is_global_zero)  # while every layer is here
            self._partition = self._cut(module)
            self._outside = OutsideParameters(module, self._partition.name, self._topology)
            rank_zero_info(self.describe())
        self.model_to_device()
        self._sync_metrics_within_stage_group(module)
        if self.trace_dir is not None and trainer.state.fn == TrainerFn.FITTING:
            if self.emulating:
                raise PipeConfigError(
                    "trace_dir times a pipeline whose stages run at once in separate processes; an emulated one runs "
                    "them one after another in this process. Set devices to the number of stages, or trace_dir=None."
                )
            # every fit records its own steps
            self._tracer = RunTracer(self.trace_dir, self.trace_steps, self.global_rank, device_clock(self.root_device))
        self._executor = self._build_executor()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            check_async_trainer(self.schedule, trainer.accumulate_grad_batches, len(self.optimizers))
            self._setup_runtime()
        self.setup_precision_plugin()
        # Lightning clips with this rank's parameters only; the pipeline needs the global norm
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: self._outside.clip_by_global_norm(
            optimizer, clip_val, self.root_device
        )
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _setup_runtime(self) -> None:
        """The runtime of an asynchronous schedule or of avgpipe (created once, given each fit's executor)."""
        topology = self._topology
        if self.schedule in ASYNC_SCHEDULES:
            if self._async is None and self.emulating:
                self._async = EmulatedAsyncRuntime(self.schedule, self._executor, self.num_stages, self.micro_batches)
            elif self._async is None:
                self._async = AsyncRuntime(self.schedule, self._executor, topology.stage, topology.stages, self.micro_batches)
            self._async.executor = self._executor
        elif self.schedule == "avgpipe":
            if self.emulating:
                raise PipeConfigError(
                    "schedule='avgpipe' runs one process per stage and cannot be emulated in one process; "
                    "set devices to the number of stages (or stages=None)."
                )
            if self._avg is None:
                self._avg = AvgRuntime(self._executor, topology.stage, topology.stages, self.avg_options, self._tagged)
            self._avg.executor = self._executor

    def _sync_metrics_within_stage_group(self, module: LightningModule) -> None:
        # every stage of a pipeline holds a replica of the last stage's metric state (see
        # log_replay), so metrics must only sync across pipelines, never across stages
        for metric in module.modules():
            if isinstance(metric, Metric):
                metric.process_group = self._topology.stage_group

    def _tune_avgpipe(self, trainer: Trainer, module: LightningModule) -> None:
        """avgpipe's ``"auto"`` options: adopt a checkpoint's values, or profile, predict and try the best
        candidates on the devices (avg_autotune.py); every rank adopts the same values."""
        stored = (trainer._checkpoint_connector._loaded_checkpoint or {}).get(avg_autotune.CHECKPOINT_KEY)
        if stored is not None:
            rank_zero_info(f"lightning_pipe: avgpipe adopts the tuned values of the checkpoint: {stored}")
            self._adopt_avgpipe(stored)
            return
        stages = self.num_stages
        memory = memory_limit(self.auto_balance, self.root_device)
        memory = [memory] * stages if isinstance(memory, float) else memory

        def work() -> avg_autotune.Prediction:
            with self.precision_plugin.train_step_context():
                prediction = avg_autotune.predict_candidates(
                    trainer, module, self.module, list(self._counts), self._avg_auto, self.root_device, memory
                )
            if self._tagged:
                return prediction
            fifo = [c for c in prediction.ranked if keeps_one_fifo_order(stages, c.micro_batches, c.replicas, c.advance)]
            if not fifo:
                raise PipeConfigError("no avgpipe candidate keeps one message order across replicas, as NCCL needs; "
                                      "use gloo or parallel_pipelines=1.")
            return replace(prediction, ranked=fifo)

        prediction = avg_autotune.agreed(self.global_rank == 0, self.world_size, work)
        with self.precision_plugin.train_step_context():
            choice = avg_autotune.decide(
                prediction, self.avgpipe_trials, lambda p: self._trial_stage(module, p), self.global_rank == 0,
                self.world_size, progress=rank_zero_info,
            )
        rank_zero_info(avg_autotune.describe(choice))
        self._adopt_avgpipe(choice.as_options())

    def _trial_stage(self, module: LightningModule, prediction: avg_autotune.Prediction) -> TrialStage:
        """This rank's stage, as avgpipe's trials run it (copies of its layers, the real transport)."""
        topology = self._topology
        _, trunk = find_trunk(module, self.module)
        start, end = stage_bounds(self._counts)[topology.stage]
        return TrialStage(
            trunk[start:end], topology.stage, topology.stages, topology.pipeline_ranks, self._transport(), self._watchdog,
            avg_autotune.optimizer_factory(prediction.optimizer), prediction.inputs if topology.stage == 0 else None,
            self.root_device, self.avg_options.alpha, topology.stage_group if self.num_pipelines > 1 else None,
            self.num_pipelines,
        )

    def _adopt_avgpipe(self, values: dict[str, int]) -> None:
        self.micro_batches = int(values["micro_batches"])
        self.avg_options = replace(self.avg_options, parallel_pipelines=int(values["parallel_pipelines"]),
                                   advance_forward=int(values["advance_forward"]))
        self._avg_auto = AutoValues(self.avg_options.parallel_pipelines, self.micro_batches, self.avg_options.advance_forward)

    def _auto_balance(self, trainer: Trainer, module: LightningModule) -> Plan:
        """Rank 0 profiles and splits, every rank receives the same plan, then all refine it on the
        devices (auto_balance.py)."""
        stages = self.num_stages  # of the pipeline, also when one process emulates it

        def work() -> AutoBalance:
            with self.precision_plugin.train_step_context():
                return profile_and_split(trainer, module, self.module, self.schedule, stages, self.micro_batches,
                                         self.chunks_per_stage, self.auto_balance, self.root_device,
                                         self.checkpoint_activations)

        auto = agreed_plan(self.global_rank == 0, self.world_size, work)
        if not self.auto_balance.refine or self._topology.stages == 1 or self.chunks_per_stage > 1:
            return auto.plan  # nothing to measure in one process; interleaved splits are searched locally already
        _, trunk = find_trunk(module, self.module)
        with self.precision_plugin.train_step_context():
            plan, self._measured = refine(auto, self.auto_balance, trunk, self._topology, self._transport(), self._watchdog,
                                          self.root_device, self.checkpoint_activations, rank_zero_info)
        return plan

    @property
    def _tagged(self) -> bool:
        """Whether messages may carry tags (gloo), so replicas need not share one FIFO order (NCCL);
        a one-stage pipeline sends none."""
        return self._get_process_group_backend() == "gloo" or self.num_stages == 1

    def _transport(self) -> Transport | None:
        """This rank's point-to-point layer (``None`` for a one-stage pipeline)."""
        if self._topology.stages == 1:
            return None
        return Transport(self.root_device, tagged=self._tagged)

    def _cut(self, module: LightningModule) -> PartitionedTrunk:
        assert self._topology is not None and self._counts is not None
        name, trunk = find_trunk(module, self.module)
        topology = self._topology
        local = [chunk * topology.stages + topology.stage for chunk in range(self.chunks_per_stage)]
        if self.emulating:  # this process holds every virtual stage
            local = list(range(self.num_stages * self.chunks_per_stage))
        self._layer_names = [type(layer).__name__ for layer in trunk]  # before other stages' layers go
        self._layer_params = [sum(p.numel() for p in layer.parameters()) for layer in trunk]
        self._key_order = list(module.state_dict().keys())
        self._param_order = [n for n, _ in module.named_parameters()]
        return PartitionedTrunk(trunk, name, stage_bounds(self._counts), local, self.checkpoint_activations)

    def _build_executor(self) -> Executor | LocalPipeline:
        assert self._topology is not None and self._partition is not None
        if self.emulating:
            names = [self._partition.describe_chunk(c) for c in range(len(self._partition.local))]
            return LocalPipeline(self.num_stages, self.chunks_per_stage, self._watchdog, names)
        return Executor(
            self._topology.stage,
            self._topology.pipeline_ranks,
            [],  # chunk callables are bound per step (they close over the step's arguments)
            self._transport(),
            self._watchdog,
            names=[self._partition.describe_chunk(c) for c in range(len(self._partition.local))],
            recorder=self._tracer.recorder if self._tracer is not None else None,
        )

    def describe(self) -> str:
        """A table of the pipeline: schedule, stages, layers and parameters per stage."""
        stages = self.num_stages
        lines = [
            f"lightning_pipe: {self.schedule}, {stages} stage(s) × {self.num_pipelines} pipeline(s), "
            f"{self.micro_batches} micro-batches per batch"
            + (f", {self.avg_options.parallel_pipelines} parallel pipelines per device" if self.schedule == "avgpipe" else "")
            + (f", {self.chunks_per_stage} chunks per stage" if self.chunks_per_stage > 1 else "")
            + (", emulated in one process" if self.emulating else "")
            + (", balance='auto'" if self._plan is not None else "")
        ]
        if self._counts is not None and self._partition is not None:
            name = self._partition.name
            header = ["stage", "layers", "parameters"] + (["predicted time", "predicted peak memory"] if self._plan else [])
            header += ["measured time"] if self._measured else []
            rows = []
            for vs, (start, end) in enumerate(stage_bounds(self._counts)):
                device, chunk = vs % stages, vs // stages
                where = f"{device}" + (f" chunk {chunk}" if self.chunks_per_stage > 1 else "")
                row = [where, f"{name}[{start}:{end}] {', '.join(self._layer_names[start:end])}",
                       f"{sum(self._layer_params[start:end]):,}"]
                if self._plan is not None:
                    predicted = self._plan.stages[vs]
                    row += [f"{predicted.time * 1e3:.2f} ms/micro-batch", format_bytes(predicted.memory)]
                if self._measured:
                    row += [f"{self._measured[vs] * 1e3:.2f} ms/micro-batch"]
                rows.append(row)
            widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
            for row in [header, *rows]:
                lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
            if self._plan is not None:
                lines.append(f"  predicted: {self._plan.step_time * 1e3:.1f} ms per batch of {self._plan.micro_batches} "
                             f"micro-batches of {self._plan.micro_batch_size:g} samples")
        return "\n".join(lines)

    # ------------------------------------------------------------------ training
    def _micro_batch_count(self, n: int, training: bool) -> int:
        if n >= self.micro_batches:
            return self.micro_batches
        if training and not self._seen_batch:
            raise PipeConfigError(
                f"micro_batches={self.micro_batches} is larger than the batch size {n}; use micro_batches <= {n} "
                "or a larger batch size."
            )
        # a short last batch: fewer, smaller micro-batches (interleaved training needs a multiple of stages)
        if training and self.schedule == "interleaved_1f1b":
            count = n - n % self.num_stages
            if count == 0:
                raise PipeConfigError(
                    f"a batch of {n} samples cannot feed {self.num_stages} interleaved stages; set drop_last=True in the DataLoader."
                )
            return count
        return n

    def _run_schedule(
        self, hook: str, args: tuple, kwargs: dict, training: bool, asynchronous: bool = False
    ) -> tuple[Any, list[Any], list[int], LogCapture]:
        """Run the user's ``hook`` over the micro-batches of one batch through the pipeline (one
        flushed step, or one window of an asynchronous segment).

        Returns the schedule's outputs on the last stage (empty elsewhere), the micro-batch sizes,
        the batch size and the captured ``self.log`` calls.
        """
        assert self._executor is not None and self._partition is not None and self._topology is not None
        module = self.lightning_module
        batch, rest = args[0], args[1:]
        n = batch_size(batch)
        averaging = training and self._avg is not None
        if averaging:  # N replica mini-batches, each split into micro-batches (replica-major)
            micro_batches, count = self._avg.split(batch, self.micro_batches, first=not self._seen_batch)
        else:
            count = self._micro_batch_count(n, training)
            micro_batches = split_micro_batches(batch, count)
        sizes = [batch_size(mb) for mb in micro_batches]
        capture = LogCapture(module)
        user_step = getattr(module, hook)
        virtual_stages = self.num_stages * self.chunks_per_stage
        stages = ModuleStages(
            lambda mb: user_step(mb, *rest, **kwargs),
            self._partition,
            virtual_stages,
            capture,
            (lambda out: step_loss(out, hook)) if training else (lambda out: out),
        )
        self._executor.chunks = stages.chunk_callables()
        if asynchronous and self._async.policy is None:
            self._start_async(stages, micro_batches[0])
        weights = [s / n / module.trainer.accumulate_grad_batches for s in sizes] if training else None
        if averaging:
            weights = self._avg.loss_weights(sizes, count)
        scaler = getattr(self.precision_plugin, "scaler", None) if training else None
        scale = scaler.scale if scaler else None
        try:
            with capture:
                if averaging:
                    outputs = self._avg.run_round(micro_batches, weights, count)
                elif asynchronous:
                    outputs = self._async.run_window(micro_batches, weights, scale)
                else:
                    sync_name = self.schedule if self.schedule in SYNC_SCHEDULES else "1f1b"  # warm-up, evaluation
                    schedule = build_schedule(sync_name, self.num_stages, count, self.chunks_per_stage, not training)
                    outputs = self._executor.run(schedule, micro_batches, weights, scale_loss=scale)
        except BaseException as error:
            if self._watchdog is not None:
                self._watchdog.report(error)
            raise
        return outputs, sizes, n, capture

    def _start_avg(self) -> None:
        """Create the replicas and the center at the first avgpipe round (after any checkpoint was restored)."""
        trainer = self.lightning_module.trainer
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise PipeConfigError("schedule='avgpipe' steps inside the pipeline without fp16 loss scaling; use precision='bf16-mixed' or 32.")
        optimizer = _unwrapped(self.optimizers[0])
        data_parallel = self.num_pipelines > 1
        self._avg.start(
            self.lightning_module, optimizer, self.micro_batches,
            make_clip(trainer.gradient_clip_val, trainer.gradient_clip_algorithm),
            self._topology.stage_group if data_parallel else None, self.num_pipelines,
        )

    def _avg_training_step(self, args: tuple, kwargs: dict) -> Tensor:
        """One avgpipe round: every replica's forwards, backwards, STEP and AVG; returns the mean loss."""
        if self._avg.policy is None:
            self._start_avg()
        with self.precision_plugin.train_step_context():
            losses, sizes, n, capture = self._run_schedule("training_step", args, kwargs, True)
        self._seen_batch = True
        if not self._outside.known:
            self._outside.learn(self._avg.policy.used_names)
            # every rank learned the same map, so every rank raises
            reject_shared(self._outside.users, "which avgpipe replicas step independently", PipeConfigError)
        self._grad_stash = []
        return self._replayed_loss(losses, sizes, n, capture)

    def _replayed_loss(self, losses: list[Any], sizes: list[int], n: int, capture: LogCapture) -> Tensor:
        """The batch loss (micro-batch losses weighted by their sizes) on every rank of the pipeline,
        after replaying the last stage's ``self.log`` calls on each of them."""
        module = self.lightning_module
        loss = sum(s / n * float(l) for s, l in zip(sizes, losses)) if losses else 0.0
        loss, records = self._from_last_stage((loss, combine(capture.records, module)))
        replay(module, records, owner=self._topology.is_last_stage)
        return torch.tensor(loss, device=self.root_device)

    def _asynchronous_now(self) -> bool:
        """Whether this epoch runs the asynchronous schedule (after the synchronous warm-up)."""
        trainer = self.lightning_module.trainer
        return self._async is not None and trainer.current_epoch >= self.sync_warmup_epochs

    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Forwards and backwards of every micro-batch; returns the batch loss on every rank.

        Flushing schedules run one whole step here. Asynchronous ones run one window of the
        stream: earlier micro-batches may still be in flight afterwards and STEPs happen inside.
        """
        if self._tracer is not None:
            self._tracer.start_step()
        try:
            if self._avg is not None:
                return self._avg_training_step(args, kwargs)
            return self._pipeline_training_step(args, kwargs)
        finally:
            if self._tracer is not None:
                self._tracer.end_step()

    def _pipeline_training_step(self, args: tuple, kwargs: dict) -> Tensor:
        """A flushed step, or one window of an asynchronous segment (and its drain at the segment's end)."""
        asynchronous = self._asynchronous_now()
        params = self._trainable_parameters()
        # a flushed step starts from empty gradients (kept ones belong to gradient accumulation);
        # an asynchronous window keeps accumulating into the gradients of unfinished mini-batches
        kept = [None] * len(params) if asynchronous else [p.grad for p in params]
        if not asynchronous:
            for p in params:
                p.grad = None
        with self.precision_plugin.train_step_context():
            losses, sizes, n, capture = self._run_schedule("training_step", args, kwargs, True, asynchronous)
        self._seen_batch = True
        if asynchronous and self._ends_segment(args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)):
            self._drain()
        if not self._outside.known and not asynchronous:
            self._outside.learn()
        self._grad_stash = [p.grad for p in params]
        for p, grad in zip(params, kept):
            p.grad = grad
        loss = self._replayed_loss(losses, sizes, n, capture)
        if asynchronous:
            self._log_async_diagnostics(n)
        return loss

    # ------------------------------------------------------------------ asynchronous schedules
    def _start_async(self, stages: ModuleStages, micro_batch: Any) -> None:
        """Create the weight policy at the first asynchronous step; Lightning stops stepping.

        An emulated pipeline first finds which stage uses each parameter outside the trunk, on
        ``micro_batch``, and gives every stage its own optimizer share and scheduler copy."""
        trainer = self.lightning_module.trainer
        optimizer = _unwrapped(self.optimizers[0])
        step_schedulers = [c for c in trainer.lr_scheduler_configs if c.interval == "step"]
        if len(step_schedulers) > 1:
            raise PipeConfigError(f"schedule={self.schedule!r} supports one step-interval lr scheduler, got {len(step_schedulers)}.")
        for config in step_schedulers:
            config.interval = "pipeline stage step"  # hidden from Lightning: the policy steps it per STEP
        scheduler = step_schedulers[0].scheduler if step_schedulers else None
        clip = make_clip(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        if isinstance(self._async, EmulatedAsyncRuntime):
            self._start_emulated(stages, micro_batch, optimizer, scheduler, clip)
        else:
            self._async.start(self.lightning_module, optimizer, self.async_options, scheduler, clip, trainer.global_step)

    def _start_emulated(self, stages: ModuleStages, micro_batch: Any, optimizer: Any, scheduler: Any, clip: Any) -> None:
        module, trainer = self.lightning_module, self.lightning_module.trainer
        probe = ModuleStages(stages.step, stages.partition, stages.virtual_stages, LogCapture(module), stages.output_to_loss)
        try:
            with probe.capture:
                names = stage_parameter_names(
                    module, self._partition.bounds, self._partition.trunk, probe.chunk_callables(), micro_batch
                )
        except SharedParameterError as error:
            raise PipeConfigError(str(error).replace("an asynchronous schedule", f"schedule={self.schedule!r}")) from None
        self._async.start_stages(module, optimizer, self.async_options, scheduler, clip, trainer.global_step, names)
        for config in trainer.lr_scheduler_configs:  # Lightning saves (and LearningRateMonitor reads) stage 0's
            if config.scheduler is scheduler:
                config.scheduler = self._async.schedulers[0]
        self._outside.users = {n: [s] for s, owned in enumerate(names) for n in owned if not self._outside.in_trunk(n)}

    def _ends_segment(self, batch_idx: int) -> bool:
        """Whether this batch is the last one before the epoch (or the run) ends."""
        trainer = self.lightning_module.trainer
        loop = trainer.fit_loop.epoch_loop
        last_of_epoch = loop.batch_progress.is_last_batch or batch_idx + 1 >= trainer.num_training_batches
        last_of_run = trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps
        return last_of_epoch or last_of_run

    def _drain(self) -> None:
        """Finish every micro-batch in flight (before evaluation, checkpoints, epoch end)."""
        if self._async is None or not self._async.in_flight:
            return
        try:
            self._async.drain()
        except BaseException as error:
            if self._watchdog is not None:
                self._watchdog.report(error)
            raise
        if not self._outside.known and not self.emulating:
            self._outside.learn(self._async.policy.used_names)
            # every rank learned the same map, so every rank raises
            reject_shared(self._outside.users, f"which step at different times under schedule={self.schedule!r}", PipeConfigError)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Asynchronous schedules and avgpipe step inside the pipeline: only run the closure (training_step and backward)."""
        if self._asynchronous_now() or self._avg is not None:
            return closure()
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def on_validation_start(self) -> None:
        self._drain()
        super().on_validation_start()

    def on_train_end(self) -> None:
        self._drain()
        if self._tracer is not None:
            title = f"{self.schedule}: {self.num_stages} stages, M={self.micro_batches}, measured"
            for path in self._tracer.write(self.global_rank, self.world_size, title):
                rank_zero_info(f"lightning_pipe: wrote {path}")
        super().on_train_end()

    def _log_async_diagnostics(self, batch_size_: int) -> None:
        """Per-stage staleness, weight copies and prediction/correction norm, logged on every rank."""
        trainer = self.lightning_module.trainer
        if not trainer._logger_connector.should_update_logs:
            return
        stages = [_diagnostics(policy) for policy in self._async.policies]
        if self._topology.stages > 1:
            mine = stages[0]
            stages = [None] * self._topology.stages
            dist.all_gather_object(stages, mine, group=self._topology.pipeline_group)
        for stage, values in enumerate(stages):
            for key, value in values.items():
                self.lightning_module.log(f"pipe/stage{stage}/{key}", float(value), on_step=True, on_epoch=False,
                                          batch_size=batch_size_)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._forward_step("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._forward_step("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._forward_step("predict_step", args, kwargs)

    def _forward_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """Forward-only pipeline; every rank returns the last stage's (merged) output and logs."""
        module = self.lightning_module
        outputs, sizes, _, capture = self._run_schedule(hook, args, kwargs, training=False)
        merged = detach_to_cpu(merge_outputs(outputs, sizes)) if outputs else None
        merged, records = self._from_last_stage((merged, combine(capture.records, module)))
        replay(module, records, owner=self._topology.is_last_stage)
        return merged

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    def _from_last_stage(self, payload: Any) -> Any:
        """Broadcast ``payload`` from the pipeline's last stage to all its stages."""
        topology = self._topology
        assert topology is not None
        if topology.stages == 1:
            return payload
        box = [payload if topology.is_last_stage else None]
        try:
            dist.broadcast_object_list(box, src=topology.last_stage_rank, group=topology.pipeline_group)
        except RuntimeError as error:
            raise self._watchdog.explain(error, "the last stage's metrics") from error
        return box[0]

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Restore the gradients the schedule computed (no autograd runs here)."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        params = self._trainable_parameters()
        for p, grad in zip(params, self._grad_stash):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad
        self._grad_stash = []
        if not module.trainer.fit_loop._should_accumulate():
            self._outside.sum_shared_gradients()
            if self.num_pipelines > 1:
                self._average_across_pipelines(params)
        return self.precision_plugin.post_backward(closure_loss, module)

    def _average_across_pipelines(self, params: Sequence[torch.nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self._topology.stage_group)
        flat /= self.num_pipelines
        for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    # ------------------------------------------------------------------ checkpoints
    def _gather_in_first_pipeline(self, obj: Any) -> list[Any] | None:
        """Every stage's ``obj`` on global rank 0 (``None`` elsewhere); only pipeline 0 takes part."""
        topology = self._topology
        if topology.stages == 1:
            return [obj] if self.global_rank == 0 else None
        if topology.pipeline != 0:
            return None
        parts = [None] * topology.stages if self.global_rank == 0 else None
        dist.gather_object(obj, parts, dst=0, group=topology.pipeline_group)
        return parts

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unpartitioned module's state_dict on rank 0 (``{}`` elsewhere)."""
        if self._partition is None:
            return super().lightning_module_state_dict()
        self._drain()
        local = apply_to_collection(self.lightning_module.state_dict(), Tensor, lambda t: t.detach().cpu())
        parts = self._gather_in_first_pipeline(local)
        return merge_state_dicts(parts, self._key_order, self._outside.owner()) if parts else {}

    def _local_param_names(self, optimizer: Any) -> list[list[str]]:
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        for policy in self._async.policies if self._async is not None else []:  # live policies step master copies
            names.update({id(m): n for n, m in getattr(policy, "masters", {}).items()})
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """One torch-format optimizer state for the whole module on rank 0 (``{}`` elsewhere)."""
        optimizer = _unwrapped(optimizer)
        if self._partition is None:
            return optimizer.state_dict()
        self._drain()
        if isinstance(self._async, EmulatedAsyncRuntime) and self._async.policies:  # every stage's optimizer share
            parts = [
                (apply_to_collection(o.state_dict(), Tensor, lambda t: t.detach().cpu()), self._async.param_names(s))
                for s, o in enumerate(self._async.optimizers)
            ]
            return merge_optimizer_states(parts, self._param_order, {})
        state = apply_to_collection(optimizer.state_dict(), Tensor, lambda t: t.detach().cpu())
        parts = self._gather_in_first_pipeline((state, self._local_param_names(optimizer)))
        return merge_optimizer_states(parts, self._param_order, self._outside.owner()) if parts else {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write on rank 0 to a temporary file in the target directory, then rename it into place,
        so a save killed half-way never leaves a truncated file under the final name."""
        if self._async is not None and self._async.policy is not None and self._partition is not None:
            self._drain()
            if self.emulating:
                parts = [policy.state_dict() for policy in self._async.policies]
            else:
                parts = self._gather_in_first_pipeline(self._async.policy.state_dict())
            if parts:
                checkpoint["pipe_async_state"] = parts  # per stage: what resuming exactly needs
        if self._avg is not None and self._avg.policy is not None and self._partition is not None:
            parts = self._gather_in_first_pipeline(self._avg.policy.state_dict())
            if parts:
                checkpoint["pipe_avgpipe_state"] = parts  # per stage: replicas, their optimizer states, round count
        if self._counts is not None:  # what a resumed run with balance="auto" adopts instead of planning again
            checkpoint[BALANCE_KEY] = list(self._counts)
        if self.schedule == "avgpipe":  # what a resumed run with "auto" options adopts instead of tuning again
            o = self.avg_options
            checkpoint[avg_autotune.CHECKPOINT_KEY] = avg_autotune.options_record(
                o.parallel_pipelines, self.micro_batches, o.advance_forward)
        if not self.is_global_zero:
            return
        path = str(filepath)
        if "://" in path:  # remote filesystems: their own transaction semantics apply
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        partial = f"{path}.partial-{os.getpid()}"
        try:
            self.checkpoint_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        module = self.lightning_module
        state = checkpoint["state_dict"]
        if self._partition is None:
            check_keys(list(state), list(module.state_dict()), strict)
            module.load_state_dict(state, strict=strict)
            return
        check_keys(list(state), self._key_order, strict)
        local = set(module.state_dict())
        module.load_state_dict({k: v for k, v in state.items() if k in local}, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        states = checkpoint.get("pipe_async_state")
        if states is not None and self._async is not None and len(states) == self.num_stages:
            self._async.restore(states if self.emulating else [states[self._topology.stage]])
        states = checkpoint.get("pipe_avgpipe_state")
        if states is not None and self._avg is not None and len(states) == self._topology.stages:
            self._avg.restore(states[self._topology.stage])
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            raw = _unwrapped(optimizer)
            raw.load_state_dict(slice_optimizer_state(state, self._local_param_names(raw), self._param_order))
        _optimizers_to_device(self.optimizers, self.root_device)

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``group=None`` reduces over the data-parallel (stage) group: every stage of a pipeline
        already holds the same replayed value, so reducing over the world would count it once per stage."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._topology is not None:
            group = self._topology.stage_group
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        value = torch.tensor(int(decision), device=self.root_device)
        value = _sync_ddp_if_available(value, None, reduce_op=ReduceOp.SUM)
        return bool(value == self.world_size) if all else bool(value)

    def on_exception(self, exception: BaseException) -> None:
        if self._watchdog is not None:
            self._watchdog.report(exception)
        super().on_exception(exception)


def _diagnostics(policy: Any) -> dict[str, float]:
    """One stage's staleness, weight copies and prediction/correction norm."""
    values = {"staleness": policy.staleness_sum / max(policy.backwards, 1), "weight_copies": float(policy.max_copies)}
    norm = getattr(policy, "prediction_norm", getattr(policy, "correction_norm", None))
    if norm is not None:
        values["prediction_norm" if hasattr(policy, "prediction_norm") else "correction_norm"] = norm
    return values


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (or ``optimizer`` itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
