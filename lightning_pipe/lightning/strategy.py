"""``PipeStrategy``: Lightning's hooks, mapped onto the pipeline.

Only glue lives here; each hook delegates:

* ``PipeStrategy(...)`` and ``connect``: check the options (:mod:`.options`, :mod:`.checks`) before
  any process starts;
* ``setup_environment``: process groups per pipeline and per stage, the watchdog, the transport; then the
  :class:`~.context.PipeContext` that the helpers below get instead of the strategy;
* ``setup``: choose the split (:mod:`.auto` for ``balance="auto"`` and avgpipe's tuner), cut the trunk
  and build the executor (:class:`~.pipeline.StagePipeline`), then the runtime of the schedule's
  family (:mod:`.runtimes`);
* ``training_step`` / ``backward`` / ``optimizer_step``: the runtime;
* ``validation_step`` / ``test_step`` / ``predict_step``: a forward-only pipeline step;
* checkpoints: every stage's piece gathered on rank 0 into one ordinary checkpoint (:mod:`.checkpointing`).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import Any, ContextManager, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torchmetrics import Metric
from typing_extensions import override

from lightning_pipe.engine import Topology, Transport, Watchdog, batch_size, ending, shm
from lightning_pipe.engine.policies import AvgPipeOptions, DoubleBufferOptions, PipeDreamOptions, PipeMareOptions, XPipeOptions
from lightning_pipe.engine.policies.options import Averaging, Prediction
from lightning_pipe.engine.sharding import ShardedLayers, pipeline_mesh, single_tensor_updates_where_mixed
from lightning_pipe.engine.stage import batch_fingerprint
from lightning_pipe.engine.stand_ins import move_stand_ins
from lightning_pipe.engine.watchdog import FAILURE_GRACE
from lightning_pipe.errors import CheckpointMismatchError, LightningPipeError, PipeConfigError
from lightning_pipe.lightning import _compat, auto, checkpointing, checks, hook_logs, loss_scaling, preemption, sharded, startup
from lightning_pipe.lightning import options as options_module
from lightning_pipe.lightning.context import PipeContext
from lightning_pipe.lightning.hook_logs import StageHookLogs
from lightning_pipe.lightning.launcher import PipeLauncher
from lightning_pipe.lightning.model_summary import freeze_model_summaries
from lightning_pipe.lightning.options import PipeOptions
from lightning_pipe.lightning.pipeline import StagePipeline
from lightning_pipe.lightning.preemption import Preemption
from lightning_pipe.lightning.runtimes import Runtime, make_runtime, unwrapped
from lightning_pipe.lightning.stage_metrics import StageMetrics
from lightning_pipe.partition.materialize import INIT_HOOK, MetaConstruction, has_meta_tensors, materialize, release_memory
from lightning_pipe.planning.auto_balance import AutoBalanceOptions
from lightning_pipe.planning.planner import Plan
from lightning_pipe.planning.trials import device_clock
from lightning_pipe.registry import DEFAULT, SCHEDULES, ScheduleName
from lightning_pipe.sim.tracing import RunTracer

log = logging.getLogger(__name__)
rank_zero_info = rank_zero_only(log.info)  # messages every rank would repeat: global rank 0 says them


class _NamesItsOptions(type(DDPStrategy)):  # type: ignore[misc]
    """``PipeStrategy(micro_batch=4)`` says which option was meant instead of Python's bare TypeError."""

    @property
    def __signature__(cls) -> inspect.Signature:
        """``inspect.signature(PipeStrategy)``: ``__init__``'s options with their types and defaults (without this,
        ``__call__`` below would make it ``(*args, **kwargs)`` for IDEs and documentation tools)."""
        try:
            signature = inspect.signature(cls.__init__, eval_str=True)
        except NameError:  # an annotation only importable for type checkers: keep it as text
            signature = inspect.signature(cls.__init__)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        known = inspect.signature(cls.__init__).parameters
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, [k for k in known if k != "self"], n=1)
                hint = f"; did you mean {close[0]}=?" if close else ""
                raise PipeConfigError(f"PipeStrategy has no option {name!r}{hint} (docs/options.md lists them all).")
        return super().__call__(*args, **kwargs)


class PipeStrategy(DDPStrategy, metaclass=_NamesItsOptions):
    """Pipeline-parallel training of an ordinary LightningModule.

    The module's trunk (an ``nn.Sequential`` or a looped ``nn.ModuleList``, docs/models.md) is split into contiguous stages, one
    process per stage; each batch is split into micro-batches that flow through the stages in the
    order of the chosen schedule. Code in ``training_step`` before the trunk call runs on the first
    stage, code after it (and the loss) on the last.

    ``Trainer(devices=1, strategy=PipeStrategy(schedule="pipemare", stages=4))`` emulates a 4-stage
    pipeline in the one process with the same engine code (docs/emulation.md).

    Args:
        schedule: pipeline schedule. ``"gpipe"``: all forwards then all backwards (activation memory
            grows with ``micro_batches``); ``"1f1b"``: same result, at most ``stages`` micro-batches in
            flight; ``"interleaved_1f1b"``: ``chunks_per_stage`` chunks per device, bubble shrinks by that
            factor, needs ``micro_batches`` to be a multiple of ``stages``. Zero-bubble, with each backward
            split into the input's gradient and the weights' gradients, the latter filling the bubble
            (docs/algorithms.md §4a): ``"zb_h1"`` (1f1b's peak activation memory, a third of its bubble),
            ``"zbv"`` (two chunks per device in a V: the first and the last virtual stage on device 0;
            almost no bubble) and ``"dualpipev"`` (zbv's V with whole backwards in the steady state, less
            overhead; ``micro_batches >= 2 * stages``). All six equal one-device training up to float
            rounding (micro-batch gradients are summed in schedule order; the tests require 1e-5
            relative). Asynchronous (``"pipedream"``, ``"pipedream_2bw"``, ``"pipemare"``, ``"xpipe"``):
            see ``docs/async-semantics.md``. ``"avgpipe"``: parallel replicas of the pipeline share the
            same devices, each trains on its own part of the batch with its own weights and optimizer
            state, and every stage averages them elastically against a center copy that evaluation and
            checkpoints use (``docs/avgpipe.md``).
        micro_batches: micro-batches each batch is split into (at most the batch size). More
            micro-batches shrink the pipeline bubble ``(P-1)/(M+P-1)``; about ``4 × stages`` is a good
            start. ``"auto"`` (avgpipe only): chosen by its tuner at fit start.
        stages: processes per pipeline; default ``world_size // pipelines``. With one process
            (``devices=1``) and ``stages > 1`` the strategy *emulates* a ``stages``-stage pipeline in that
            process: every stage runs the distributed run's code (its own weights policy, optimizer share
            and STEPs, so an asynchronous schedule's delays, stashing and prediction, and avgpipe's replicas
            and averaging, are exact), which lets you study a schedule's statistical efficiency without a
            cluster (docs/emulation.md).
        pipelines: data-parallel pipeline replicas; each gets its own shard of the data and gradients
            are averaged across them, so ``pipelines=N`` equals one device at ``N ×`` the batch size.
            Synchronous schedules only. Each pipeline holds its stage whole, or a shard of it with
            ``data_parallel="fsdp"``.
        balance: how many trunk layers each stage gets: a list of counts (one per stage, or per virtual
            stage for interleaved), ``"uniform"`` (equal counts), ``"parameters"`` (balanced parameter
            counts) or ``"auto"`` (rank 0 profiles every trunk layer on its device with the first batch
            and picks the split that minimises the slowest stage's predicted time under the memory limits,
            for the given schedule and ``micro_batches``; then every rank measures it for a few steps and
            layers move off the measured bottleneck; see ``auto_balance`` and docs/planning.md).
        module: dotted path of the trunk, an ``nn.Sequential`` (called once in the step) or an
            ``nn.ModuleList`` (looped over once); default: the one holding most of the module's
            parameters (an error lists the candidates when that is doubtful; docs/models.md).
        chunks_per_stage: chunks (virtual stages) per device for ``"interleaved_1f1b"`` (default 2) and
            ``"zbv"``/``"dualpipev"`` (exactly 2); must stay 1 for the other schedules.
        checkpoint_activations: recompute each stage's activations during backward instead of keeping
            them (less memory, one extra forward). The zero-bubble schedules, ``"pipemare"`` and ``"xpipe"``
            refuse it (docs/options.md).
        timeout: seconds a rank waits for a peer's activation or gradient before failing with
            :class:`~lightning_pipe.PipelineTimeout` naming it; a rank that raises ends every other rank
            at once with its error message, and a hung rank is ended a few seconds after the others
            gave up (docs/failures.md).
        startup_timeout: seconds the ranks wait for each other while starting (rendezvous, process
            groups, ``balance="auto"`` and the avgpipe tuner at setup).
        checkpoint_timeout: seconds the ranks wait for each other around a checkpoint (rank 0 writes
            the file while the others wait; a slow filesystem must not lose it).
        sync_warmup_epochs: asynchronous schedules only: train the first epochs with ``1f1b`` (PipeMare's
            synchronous warm-up), then switch in the same run.
        sync_warmup_steps: asynchronous schedules only: train the first optimizer steps with ``1f1b``,
            then switch at the next batch, also within an epoch (with ``sync_warmup_epochs``, the
            warm-up lasts until both are reached).
        delay_warmup_steps: asynchronous schedules with stale gradients (pipedream, pipedream_2bw,
            pipemare, xpipe): a learning-rate warm-up scaled by each stage's delay. A stage whose
            gradients are ``tau_s >= 1`` STEPs stale multiplies its learning rate by
            ``min(1, (k + 1) / (delay_warmup_steps * tau_s))`` at its ``k``-th optimizer step (on top of
            the user's scheduler and PipeMare's T1); stages with fresh gradients are untouched. ``0``
            (the default): off (docs/lm-quality.md measures it).
        grad_cosine_every: asynchronous schedules with stale gradients: every ``K``-th training step, measure
            on one micro-batch per stage the cosine between the stale gradient the stage took and the
            gradient at the weights its step updates, logged with the stage metrics as
            ``pipe/stage{s}/grad_cosine`` (the latest measurement). It recomputes that micro-batch's forward
            and backward on the stage; training is unchanged. ``0`` (the default): off (docs/metrics.md).
        quality_warning: warn once, on rank 0 at fit start, when a schedule with stale gradients runs with
            an Adam-like optimizer (Adam, AdamW, RAdam, Adamax; NAdam outside the recipe that keeps
            quality), with the cost measured on the language-model benchmark at that stage count and the
            recipe that keeps quality there (:class:`~lightning_pipe.AsyncQualityWarning`,
            docs/async-semantics.md). ``False`` silences it, as does a ``warnings`` filter on that class.
        pipemare: PipeMare's learning-rate rescheduling and discrepancy correction
            (:class:`~lightning_pipe.PipeMareOptions`; a dict of its fields works too).
        xpipe: XPipe's weight prediction (:class:`~lightning_pipe.XPipeOptions`).
        pipedream_2bw: 2BW's look-ahead along the last update (:class:`~lightning_pipe.DoubleBufferOptions`).
        pipedream: PipeDream's optional vertical sync (:class:`~lightning_pipe.PipeDreamOptions`).
        avgpipe: avgpipe's parallel pipelines, averaging and tuner (:class:`~lightning_pipe.AvgPipeOptions`).
        auto_balance: ``balance="auto"``'s memory limits, device speeds, profile cache and refinement
            (:class:`~lightning_pipe.AutoBalanceOptions`); avgpipe's tuner obeys its memory limits too.
        trace_dir: record when every action of every rank starts and ends during a few training steps
            and, at the end of ``fit``, write ``timeline.png`` and ``trace.json`` (Chrome trace) there,
            plus each rank's ``events-rank{r}.json`` (docs/simulator.md). Needs matplotlib.
        trace_steps: training steps recorded with ``trace_dir``: steps 2 to ``trace_steps + 1`` of the fit
            (the first pays one-time costs; a one-step fit records that one).
        stage_metrics: on the steps Lightning logs (``Trainer(log_every_n_steps=...)``), log every stage's
            compute and wait time, idle share (bubble) and peak memory as ``pipe/stage{s}/...``, plus the
            asynchronous schedules' staleness, weight lag (how far the weights a gradient was taken at are
            from those it updates) and correction or prediction size; other steps pay nothing (docs/metrics.md).
        shape_headers: ``"on_change"``: an activation tells the next stage its shapes only when its
            micro-batch's shapes differ from the previous micro-batch's on the same link (a short last
            batch, a new sequence length); the next stage posts the other receives at once. Both sides
            decide alike from the micro-batches they both hold. ``"always"``: every activation carries
            its shapes, for stages whose output shapes depend on the data, not only on the input shapes
            (an error says so when it happens).
        transport: how CPU stages on one host exchange activations and gradients. ``"auto"``: through
            shared memory where the host allows it (Linux, x86-64), else the process group;
            ``"shared_memory"``: the same, and an error where it is unavailable; ``"process_group"``:
            always ``torch.distributed`` (gloo). CUDA tensors and peers on other hosts always use the
            process group. Shared memory skips gloo's loopback sockets (docs/benchmarks.md).
        pipemare_lr_reschedule: deprecated, use ``pipemare={"lr_reschedule": ...}``.
        pipemare_lr_warmup_steps: deprecated, use ``pipemare={"lr_warmup_steps": ...}``.
        pipemare_correction: deprecated, use ``pipemare={"correction": ...}``.
        pipemare_correction_decay: deprecated, use ``pipemare={"correction_decay": ...}``.
        xpipe_prediction: deprecated, use ``xpipe={"prediction": ...}``.
        parallel_pipelines: deprecated, use ``avgpipe={"parallel_pipelines": ...}``.
        avgpipe_alpha: deprecated, use ``avgpipe={"alpha": ...}``.
        avgpipe_period: deprecated, use ``avgpipe={"period": ...}``.
        avgpipe_averaging: deprecated, use ``avgpipe={"averaging": ...}``.
        advance_forward: deprecated, use ``avgpipe={"advance_forward": ...}``.
        avgpipe_trials: deprecated, use ``avgpipe={"trials": ...}``.
        auto_balance_memory: deprecated, use ``auto_balance={"memory_gib": ...}``.
        auto_balance_speeds: deprecated, use ``auto_balance={"speeds": ...}``.
        profile_cache: deprecated, use ``auto_balance={"profile_cache": ...}``.
        auto_balance_refine: deprecated, use ``auto_balance={"refine": ...}``.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: checkpoint writer plugin.
        precision_plugin: set by the Trainer from ``precision=``.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default by device (gloo on CPU, NCCL on CUDA).
        save_distributed_checkpoint: write each checkpoint as a directory in which every rank writes only
            its own stage (``torch.distributed.checkpoint``); it resumes under another split, stage count
            or the one-device emulation, and :func:`~lightning_pipe.consolidate_checkpoint` turns it into
            one ordinary checkpoint. ``False`` (the default): one file, every stage gathered on rank 0.
            Every schedule: an asynchronous one's and avgpipe's weight-policy state is written by name
            too, each rank its own parameters' (docs/large-models.md).
        release_unused_outside: synchronous schedules (and an asynchronous one's synchronous warm-up)
            on several processes: after the first training step, give back the parameters outside the
            trunk that this rank holds but another stage trained (the head on the first stage, the
            embedding on the last; every stage of a looped trunk keeps only what its step trained),
            keeping a one-element stand-in for each. ``False`` keeps them: for a step that reads such a
            parameter without training it (under ``torch.no_grad``, for a metric), which would read the
            stand-in's zeros. A parameter first trained in a later step stops training with an error
            that names it (docs/large-models.md).
        data_parallel: how the ``pipelines`` copies of a stage share it. ``"ddp"`` (the default): every
            pipeline holds its whole stage and gradients are all-reduced across pipelines. ``"fsdp"``: each
            trunk layer (or chunk: ``fsdp_unit``) is an FSDP2 unit sharded over the ``"dp"`` dimension of a
            ``("dp", "pp")`` device mesh, across the pipelines' copies of its stage, so parameters,
            gradients and optimizer state take about ``1/pipelines`` of the memory per rank; gradients are
            reduce-scattered once per step; from the second step on, the modules outside the trunk that only
            this stage trains are sharded too (a tied or directly read weight stays replicated). Schedules
            ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``; needs one process per stage and pipeline (no
            emulation) and ``save_distributed_checkpoint=True`` to write checkpoints (docs/parallelism.md).
        fsdp_reshard: with ``data_parallel="fsdp"``, when a sharded layer's gathered copy is freed. ``"step"``
            (the default): each layer is all-gathered once per step and kept whole until the step's
            reduce-scatter, so during a step the stage's parameters are whole (between steps, and in the
            optimizer, sharded). ``"micro_batch"``: freed after every micro-batch's forward and backward and
            gathered again for the next, ``2 × micro_batches`` all-gathers per layer per step, for the least
            memory within the step (one layer whole at a time).
        fsdp_unit: with ``data_parallel="fsdp"``, what one FSDP2 unit is. ``"layer"`` (the default): each
            trunk layer, gathered and reduce-scattered on its own. ``"stage"``: each chunk of the stage (the
            whole stage, except with ``interleaved_1f1b``), gathered in one all-gather and reduce-scattered in
            one reduce-scatter, with FSDP2's hooks once per chunk call; with ``fsdp_reshard="micro_batch"`` the
            whole chunk is then gathered for every forward and backward. Needs an ``nn.Sequential`` trunk
            (docs/parallelism.md).
    """

    strategy_name = "pipe"

    def __init__(
        self,
        schedule: ScheduleName = DEFAULT,
        micro_batches: int | Literal["auto"] = 4,
        stages: int | None = None,
        pipelines: int = 1,
        balance: str | list[int] = "uniform",
        module: str | None = None,
        chunks_per_stage: int | None = None,
        checkpoint_activations: bool = False,
        timeout: float = 1800.0,
        startup_timeout: float = 1800.0,
        checkpoint_timeout: float = 3600.0,
        sync_warmup_epochs: int = 0,
        sync_warmup_steps: int = 0,
        delay_warmup_steps: int = 0,
        grad_cosine_every: int = 0,
        quality_warning: bool = True,
        pipemare: PipeMareOptions = PipeMareOptions(),
        xpipe: XPipeOptions = XPipeOptions(),
        pipedream_2bw: DoubleBufferOptions = DoubleBufferOptions(),
        pipedream: PipeDreamOptions = PipeDreamOptions(),
        avgpipe: AvgPipeOptions = AvgPipeOptions(),
        auto_balance: AutoBalanceOptions = AutoBalanceOptions(),
        trace_dir: str | None = None,
        trace_steps: int = 3,
        stage_metrics: bool = True,
        shape_headers: Literal["on_change", "always"] = "on_change",
        transport: Literal["auto", "shared_memory", "process_group"] = "auto",
        pipemare_lr_reschedule: bool | None = None,
        pipemare_lr_warmup_steps: int | None = None,
        pipemare_correction: bool | None = None,
        pipemare_correction_decay: float | None = None,
        xpipe_prediction: Prediction | None = None,
        parallel_pipelines: int | Literal["auto"] | None = None,
        avgpipe_alpha: float | None = None,
        avgpipe_period: int | None = None,
        avgpipe_averaging: Averaging | None = None,
        advance_forward: int | Literal["auto"] | None = None,
        avgpipe_trials: int | None = None,
        auto_balance_memory: float | list[float] | None = None,
        auto_balance_speeds: list[float] | None = None,
        profile_cache: str | None = None,
        auto_balance_refine: int | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        save_distributed_checkpoint: bool = False,
        release_unused_outside: bool = True,
        data_parallel: Literal["ddp", "fsdp"] = "ddp",
        fsdp_reshard: Literal["step", "micro_batch"] = "step",
        fsdp_unit: Literal["layer", "stage"] = "layer",
    ) -> None:
        given = locals()  # every option by its name: a new option is a parameter here and a field of PipeOptions
        self.options: PipeOptions = options_module.resolve(
            {name: given[name] for name in options_module.FIELDS},
            {name: given[name] for name in options_module.DEPRECATED},
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=self.options.process_group_timeout),
        )
        self._counts: list[int] | None = None  # layers per virtual stage, known once connected
        #: the model the launcher checked in this process and its layer counts (see checks.CheckingLauncher)
        self.checked: tuple[LightningModule | None, list[int] | None] = (None, None)
        self._plan: Plan | None = None  # balance="auto": the chosen split and its predictions
        self._measured: list[float] | None = None  # balance="auto" refined: each stage's measured time
        self._avgpipe_tuned = False  # avgpipe's "auto" values were chosen at setup (options now hold them)
        self._topology: Topology | None = None
        self._watchdog: Watchdog | None = None
        self._transport: Transport | None = None
        self._context: PipeContext | None = None  # this Trainer call's fixed facts, for the helpers (setup_environment)
        self._pipeline: StagePipeline | None = None
        self._runtime: Runtime | None = None
        self._tracer: RunTracer | None = None
        self._metrics: StageMetrics | None = None
        self._hook_logs: StageHookLogs | None = None  # merges what hooks running on every stage log
        self._step_hook_logs: StageHookLogs | None = None  # the same, where on_before_optimizer_step is overridden
        self._backward_hook_logs: StageHookLogs | None = None  # ... where on_after_backward is
        self._batch_rows = 0  # the rows of the batch the step is training on
        self._generation = 0
        self._loading: Any = None  # the checkpoint file being restored, for error messages
        self._preemption: Preemption | None = None
        self._construction: MetaConstruction | None = None  # what configure_model / init_module built on meta
        self._restore_after_setup: bool | None = None
        self._sharded: ShardedLayers | None = None  # data_parallel="fsdp": this rank's trunk layers, sharded

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register every schedule of :mod:`lightning_pipe.registry` as a strategy name."""
        for name, row in SCHEDULES.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=row.description, schedule=name)

    # ------------------------------------------------------------------ where this process stands
    @property
    def schedule(self) -> str:
        """The schedule's name."""
        return self.options.schedule

    @property
    def micro_batches(self) -> int:
        """Micro-batches per batch (per replica with avgpipe; after tuning when ``"auto"``)."""
        return self.options.micro_batches  # type: ignore[return-value]

    @property
    @override
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def num_stages(self) -> int:
        return checks.resolve_stages(self.world_size, self.options.stages, self.options.pipelines)

    @property
    def num_pipelines(self) -> int:
        return 1 if self.emulating else self.world_size // self.num_stages

    @property
    def measuring_step(self) -> bool:
        """Whether the per-stage metrics measure the current training step (one Lightning logs)."""
        return self._metrics is not None and self._metrics.measuring

    @property
    def emulating(self) -> bool:
        """One process running every stage of a ``stages``-stage pipeline (docs/emulation.md)."""
        return self.world_size == 1 and (self.options.stages or 1) > 1

    @property
    def topology(self) -> Topology:
        assert self._topology is not None, "the process groups are created in setup_environment"
        return self._topology

    @property
    def watchdog(self) -> Watchdog:
        assert self._watchdog is not None, "the watchdog is created in setup_environment"
        return self._watchdog

    @property
    def context(self) -> PipeContext:
        """This Trainer call's fixed facts (options, topology, watchdog, transport, device, precision), which the
        pipeline, the runtimes, :mod:`.auto` and the stage metrics get instead of the strategy (:mod:`.context`)."""
        assert self._context is not None, "the pipe context is made at the end of setup_environment"
        return self._context

    @property
    def knows_peers(self) -> bool:
        """Whether this rank's watchdog knows the other ranks' processes, so that a failure from now on
        ends them through its reaper (before that, the launcher ends the ranks it started)."""
        return self._watchdog is not None and bool(self._watchdog.peers)

    @property
    def tagged(self) -> bool:
        """Whether messages may carry tags (gloo), so avgpipe's replicas need not share one FIFO order
        (NCCL); a one-stage pipeline sends none."""
        return _compat.process_group_backend(self) == "gloo" or self.num_stages == 1

    @property
    def sharding(self) -> ShardedLayers | None:
        """With ``data_parallel="fsdp"``: this rank's trunk layers as FSDP2 units over the stage group
        (``None`` with ``"ddp"``, and before setup)."""
        return self._sharded

    def transport(self) -> Transport | None:
        """This rank's point-to-point layer (``None`` for a one-process pipeline); one per rank, since a
        shared-memory channel counts its messages."""
        return self._transport

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_pipelines, "rank": self.global_rank // self.num_stages}

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Note the fingerprint of the batch this rank loaded, while it is in host memory, for the end of the step to
        check that the stages agree (:meth:`StagePipeline.step_end_from_last_stage`)."""
        if self._pipeline is not None and self.num_stages > 1 and not self.emulating:
            self._pipeline.batch_fingerprint = batch_fingerprint(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Seed the DataLoader's workers by pipeline, not by rank, under ``seed_everything(..., workers=True)``.

        Lightning seeds each worker from the global rank, so the stages of one pipeline drew different random
        numbers in their workers: a random masking or label mix in the dataset or collate gave the first stage
        inputs that did not match the last stage's labels. Every stage of a pipeline now seeds its workers as
        the data-parallel replica it is part of (pipeline 0 as one device's rank 0).
        """
        if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", False) is None:
            dataloader.worker_init_fn = partial(pl_worker_init_function, rank=self.global_rank // self.num_stages)  # type: ignore[attr-defined]
        return super().process_dataloader(dataloader)

    # ------------------------------------------------------------------ before any process starts
    @override
    def _configure_launcher(self) -> None:
        checks.resolve_stages(self.world_size, self.options.stages, self.options.pipelines)  # at Trainer(...)
        checks.check_data_parallel(self.options, self.world_size)
        super()._configure_launcher()
        if _compat.is_script_launcher(self.launcher):  # check the model before the other ranks start
            _compat.set_launcher(self, PipeLauncher(self))

    @override
    def connect(self, model: LightningModule) -> None:
        super().connect(model)
        checked, counts = self.checked
        if model is not checked:  # not checked by the launcher in this process (another rank, torchrun, one process)
            counts = checks.check_model(self.options, self.num_stages, self.num_pipelines, model)
        self._counts = counts

    # ------------------------------------------------------------------ building the model
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Where ``configure_model`` (and ``trainer.init_module()``) create tensors: on the meta device,
        so that no rank ever holds the whole model; at setup each rank gives real memory only to its own
        stage, initialised as on one device (docs/large-models.md). ``empty_init=False``: on the
        device, as Lightning's other strategies do."""
        if empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        construction = MetaConstruction()
        with construction, self.precision_plugin.tensor_init_context():
            yield
        if self._construction is None:
            self._construction = construction
        else:  # init_module, then configure_model: one construction, in that order
            self._construction.finished += construction.finished

    @property
    def layer_counts(self) -> list[int] | None:
        """Trunk layers per virtual stage, in pipeline order: the split in use (``balance="auto"``: the one it
        chose). ``None`` until the model was checked (in the launching process, before the other ranks start)."""
        return None if self._counts is None else list(self._counts)

    @property
    def plan(self) -> Plan | None:
        """With ``balance="auto"``: the plan its split came from (the split, and the planner's predicted times
        and memory per stage); ``None`` with a given balance, and before setup."""
        return self._plan

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """A model built on the meta device has no memory to restore a checkpoint into before setup, and a
        sharded checkpoint is read by stage. Decided once, at the first read (Lightning reads it before and
        after setup, and the answer must not change in between)."""
        if self._restore_after_setup is None:
            module = self.lightning_module
            self._restore_after_setup = self.options.save_distributed_checkpoint or (
                module is not None and has_meta_tensors(module))
        return self._restore_after_setup

    # ------------------------------------------------------------------ setup
    @override
    def setup_distributed(self) -> None:
        """As Lightning's, but every wait of the rendezvous is bounded by ``startup_timeout`` (:mod:`.startup`)."""
        if self.world_size > 1 and not torch.distributed.is_initialized():
            self.set_world_ranks()
            assert self.cluster_environment is not None
            startup.init_process_group(self.cluster_environment, _compat.process_group_backend(self), self.global_rank,
                                       self.world_size, self.options.startup_timeout, self.root_device)
        super().setup_distributed()  # the group exists: Lightning only sets its own state

    @override
    def setup_environment(self) -> None:
        if self._preemption is None:
            if self.cluster_environment is not None:
                self.set_world_ranks()  # this rank's number, for the preemption's messages
            forward = self.launcher.kill if isinstance(self.launcher, PipeLauncher) and self.launcher.procs else None
            self._preemption = Preemption(self.global_rank, self.options.timeout, self.options.checkpoint_timeout, forward)
        self._preemption.install(starting=True)  # a SIGTERM from here to the first step ends the job at once
        super().setup_environment()
        self._generation += 1
        self._watchdog = Watchdog.from_process_group(self.options.timeout, self._generation)
        self._watchdog.collective_bound = ("startup_timeout", self.options.startup_timeout)  # until startup.end
        self._watchdog.listen(self.world_size)  # before the collective below: every listener counts
        with self._watchdog.guard("the other ranks to start"):
            self._watchdog.learn_peers()  # who to end if this rank gives up on a hung one
        # the processes' topology: an emulated pipeline is one process holding every stage
        stages = 1 if self.emulating else self.num_stages
        self._topology = Topology(stages, self.num_pipelines, self.global_rank)
        with self._watchdog.guard("the other ranks to create the pipeline's process groups"):
            self._topology.create_groups(directional=not self.tagged, timeout=timedelta(seconds=self.options.startup_timeout))
            if self._transport is None:  # the executors built at the first setup keep theirs
                self._transport = self._create_transport()
        # the first point where the watchdog, the process groups and the transport all exist: one context per call
        self._context = PipeContext(
            options=self.options, topology=self._topology, watchdog=self._watchdog, transport=self._transport,
            root_device=self.root_device, precision_plugin=self.precision_plugin, num_stages=self.num_stages,
            num_pipelines=self.num_pipelines, emulating=self.emulating, global_rank=self.global_rank,
            world_size=self.world_size, tagged=self.tagged,
        )

    def _create_transport(self) -> Transport | None:
        """Collective: the point-to-point layer of this rank (see the ``transport`` option)."""
        if self.topology.stages == 1:
            return None
        choice, reason = self.options.transport, shm.available()
        if choice == "shared_memory" and reason is not None:
            raise PipeConfigError(f"transport='shared_memory' cannot work here: {reason}. Use transport='auto'.")
        common = {"tagged": self.tagged, "channels": self.topology.channel_groups}
        if choice == "process_group" or reason is not None or self.root_device.type != "cpu":
            return Transport(self.root_device, **common)
        # CPU peers on other hosts, or in a container of their own, still go through the process group
        return shm.SharedMemoryTransport.create(self.root_device, peer_failed=lambda: self.watchdog.heard, **common)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.precision_plugin.convert_module(module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._pipeline is not None and self._pipeline.module is not module:
            # a later Trainer call with another LightningModule (trainer.test(Model.load_from_checkpoint(...))): the
            # pipeline's stage is the earlier module's layers, so this one is cut anew, under the same split
            self._pipeline = self._runtime = self._sharded = None
        if self._pipeline is None:
            if self._counts is None or checks.builds_in_configure_model(module):  # configure_model has run now
                self._counts = checks.check_model(self.options, self.num_stages, self.num_pipelines, module, built=True)
            on_meta = has_meta_tensors(module)
            if on_meta:
                checks.check_meta_build(self.options)
            self._choose_split(trainer, module)
            if fitting and self.topology.stages > 1:
                freeze_model_summaries(trainer, module, self.is_global_zero)  # while every layer is here
            self._pipeline = StagePipeline.cut(self.context, module, self._counts)
            if on_meta:  # only this rank's stage gets memory
                sharding = self._new_sharding(deferred=True) if self.options.data_parallel == "fsdp" else None
                materialize(module, self._construction or MetaConstruction(), getattr(module, INIT_HOOK, None),
                            sharding.shard_initialised if sharding is not None else None)
                if sharding is not None:  # a layer at a time: the rank never holds its whole stage unsharded
                    sharding.shard_pending()
                    self._sharded = sharding
            else:  # built whole in __init__: give the other stages' layers back
                release_memory()
            self._construction = None
            rank_zero_info(self.describe())
        elif has_meta_tensors(module):
            raise PipeConfigError(
                f"{type(module).__name__}.configure_model built new layers on a later Trainer call, after the pipeline "
                "was cut; make it return early once the model exists (if self.model is not None: return)."
            )
        self._pipeline.use(self.context)  # a later call's watchdog and process groups
        self._hook_logs = self._pipeline.stage_hook_logs()
        if self._hook_logs is not None:  # what the module's epoch-end hooks log on the last stage reaches the loggers
            self._hook_logs.wrap_epoch_ends()
        self.model_to_device()
        if self.options.data_parallel == "fsdp" and self._sharded is None:  # before the optimizer: it keeps the shards
            self._sharded = self._new_sharding(deferred=False)
        for metric in module.modules():
            # every stage of a pipeline holds a replica of the last stage's metric state (see
            # log_replay), so metrics must only sync across pipelines, never across stages
            if isinstance(metric, Metric):
                metric.process_group = self.topology.stage_group
        self._tracer = self._new_tracer() if fitting else None
        self._metrics = StageMetrics(self.context, module, self.options.stage_metrics)
        self._pipeline.build_executor(self._metrics.recorder(self._tracer.recorder if self._tracer is not None else None))
        if fitting:
            checks.check_sharded_checkpoints(self.options, bool(trainer.checkpoint_callbacks))
            self.setup_optimizers(trainer)
            self._update_mixed_groups_per_tensor()
            checks.check_trainer(self.options.spec, trainer.accumulate_grad_batches, len(self.optimizers), trainer.callbacks)
            checks.check_callbacks(trainer.callbacks, self.num_stages)
            checks.check_optimizers(self.optimizers, self.num_stages)
            if self.options.quality_warning and self.is_global_zero:
                checks.warn_quality(self.options.schedule, self.num_stages, self.optimizers[0])
            if self._runtime is None:
                self._runtime = make_runtime(self._pipeline, self._sharded)
            self._runtime.attach(self._pipeline)
            logs, callbacks = self._hook_logs, trainer.callbacks
            self._step_hook_logs = logs if hook_logs.overrides(hook_logs.BEFORE_OPTIMIZER_STEP, module, callbacks) else None
            self._backward_hook_logs = logs if hook_logs.overrides([hook_logs.AFTER_BACKWARD], module, callbacks) else None
        self.setup_precision_plugin()
        scaler = loss_scaling.scaler_of(self.precision_plugin)
        if fitting:
            loss_scaling.check_loss_scaling(self.options.schedule, self.options.spec.steps_inside, scaler)
        if scaler is not None:  # every stage skips an overflowed step together (docs/failures.md)
            loss_scaling.agree_on_overflow(scaler)
        # Lightning clips with this rank's parameters only; the pipeline needs the global norm
        _compat.route_gradient_clipping(self.precision_plugin, lambda optimizer, clip_val: self._pipeline.outside.clip_by_global_norm(
            optimizer, clip_val, self.root_device
        ))
        startup.end(self.topology, self.options.process_group_timeout)
        self.watchdog.collective_bound = None
        if isinstance(self.launcher, PipeLauncher):
            self.launcher.startup_over()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
            if self.is_global_zero:  # what a save killed half-way left in a checkpoint directory of this fit
                for callback in trainer.checkpoint_callbacks:
                    if getattr(callback, "dirpath", None):
                        checkpointing.remove_stale_partials(callback.dirpath)

    def _new_sharding(self, deferred: bool) -> ShardedLayers:
        """``data_parallel="fsdp"``: this rank's trunk layers as FSDP2 units over the ("dp", "pp") mesh; ``deferred``:
        each sharded as it is materialized from the meta device (:meth:`ShardedLayers.shard_initialised`)."""
        assert self._pipeline is not None
        partition = self._pipeline.partition
        layers = [partition.trunk._modules[str(i)] for i in sorted(partition.owned)]
        if self.options.fsdp_unit == "stage" and partition.looped:
            raise PipeConfigError(
                f"fsdp_unit='stage' shards each chunk as one module call, and {partition.name} is an nn.ModuleList "
                "whose blocks the step calls one by one; use fsdp_unit='layer', or make the trunk an nn.Sequential."
            )
        topology = self.topology
        mesh = pipeline_mesh(topology.stage_group, topology.pipeline_group, topology.pipelines, topology.stages,
                             topology.rank, self.root_device)
        return ShardedLayers(layers, mesh, self.root_device, self.options.fsdp_reshard, self.options.fsdp_unit,
                             partition.chunks, deferred=deferred)

    def _update_mixed_groups_per_tensor(self) -> None:
        """``data_parallel="fsdp"``: a param group holding the trunk's shards and whole parameters from outside
        the trunk updates them one by one (a ``foreach`` update refuses the mix; see :mod:`~lightning_pipe.engine.sharding`)."""
        if self._sharded is not None:
            for optimizer in self.optimizers:
                single_tensor_updates_where_mixed(unwrapped(optimizer))

    def _choose_split(self, trainer: Trainer, module: LightningModule) -> None:
        """``balance="auto"`` and avgpipe's ``"auto"`` options (a checkpoint's choice when resuming)."""
        options = self.options
        stored = _compat.loaded_checkpoint(trainer).get(checkpointing.BALANCE_KEY)
        if options.balance == "auto" and stored is not None and len(stored) == len(self._counts):
            # the checkpoint's per-stage state (asynchronous policies, avgpipe replicas) fits only its split
            rank_zero_info(f"balance='auto' adopts the checkpoint's split {stored}")
            self._counts = list(stored)
        elif options.balance == "auto":
            self._plan, self._measured = auto.balance(self.context, trainer, module)
            self._counts = self._plan.balance
        self._avgpipe_tuned = options.tuned and options.spec.family == "averaging"
        if options.tuned:
            values = auto.tune_avgpipe(self.context, trainer, module, list(self._counts))
            self._adopt_options(options_module.adopt_tuned(options, values))

    def _adopt_options(self, options: PipeOptions) -> None:
        """avgpipe's tuned values: the one replacement of the context, before the pipeline and the runtime exist
        (:meth:`PipeContext.adopt` raises otherwise)."""
        self._context = self.context.adopt(options, built=self._pipeline is not None or self._runtime is not None)
        self.options = options

    def _new_tracer(self) -> RunTracer | None:
        """Every fit with ``trace_dir`` records its own steps."""
        if self.options.trace_dir is None:
            return None
        if self.emulating:
            raise PipeConfigError(
                "trace_dir times a pipeline whose stages run at once in separate processes; an emulated one runs "
                "them one after another in this process. Set devices to the number of stages, or trace_dir=None."
            )
        return RunTracer(self.options.trace_dir, self.options.trace_steps, self.global_rank, device_clock(self.root_device))

    def describe(self) -> str:
        """A table of the pipeline: schedule, stages, layers and parameters per stage."""
        assert self._pipeline is not None
        return self._pipeline.describe(self._plan, self._measured)

    # ------------------------------------------------------------------ training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Run the batch through the pipeline (forwards and backwards of every micro-batch); return
        its loss on every rank. Flushing schedules run one whole step here; asynchronous ones one
        window of the stream, with optimizer steps inside."""
        assert self._runtime is not None and self._metrics is not None
        self._agree_at_step_boundary()
        if self._tracer is not None:
            self._tracer.start_step()
        self._metrics.begin()
        try:
            loss = self._runtime.training_step(args, kwargs, self._metrics.measuring)
        finally:
            if self._tracer is not None:
                self._tracer.end_step()
        self._batch_rows = batch_size(args[0])
        self._metrics.end(self._runtime.stage_diagnostics, self._batch_rows)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Restore the gradients the schedule computed (no autograd runs here)."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        assert self._runtime is not None
        self._runtime.backward()
        if self._backward_hook_logs is None:
            return self.precision_plugin.post_backward(closure_loss, module)
        return self._backward_hook_logs.around(  # what on_after_backward logs on each stage, merged (hook_logs)
            hook_logs.AFTER_BACKWARD, lambda: self.precision_plugin.post_backward(closure_loss, module), self._batch_rows)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Schedules that step inside the pipeline only run the closure (training_step and backward); the others
        step as Lightning does, with what the hooks before the update log merged over the stages (:mod:`.hook_logs`)."""
        if self._runtime is not None and self._runtime.steps_inside:
            return closure()
        if self._step_hook_logs is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        step = super().optimizer_step  # what on_before_optimizer_step logs on each stage, merged (hook_logs)
        return self._step_hook_logs.step(lambda wrapped: step(optimizer, wrapped, model, **kwargs), closure, lambda: self._batch_rows)

    def _drain(self) -> None:
        if self._runtime is not None:
            self._runtime.drain()

    @override
    def on_validation_start(self) -> None:
        self._drain()
        self._handle_sigterm()
        super().on_validation_start()

    @override
    def on_train_start(self) -> None:
        self._handle_sigterm()
        super().on_train_start()

    @override
    def on_test_start(self) -> None:
        self._handle_sigterm()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._handle_sigterm()
        super().on_predict_start()

    # ------------------------------------------------------------------ preemption (SIGTERM)
    def _handle_sigterm(self) -> None:
        """Replace Lightning's SIGTERM handler, which calls a collective inside the signal handler (:mod:`.preemption`)."""
        if self._preemption is not None:
            self._preemption.install()

    def _agree_at_step_boundary(self) -> None:
        """At a step boundary, every rank in step: did any rank receive SIGTERM? Then all stop after this batch.

        The same all-reduce checks that the ranks agree on whether this batch ends the epoch: a rank whose DataLoader
        ran out first would go on to the epoch's end while the others wait in the next batch's collectives, until
        ``process_group_timeout`` (an hour by default), with no word of why."""
        if self._preemption is None:
            return
        self._handle_sigterm()
        received = self._preemption.pending
        trainer = self.lightning_module.trainer
        if self.world_size > 1:
            # predict shares the samples out unevenly (Lightning's unrepeated sampler), and its pipelines never meet
            # during the epoch: each agrees within itself
            within = trainer.state.stage == RunningStage.PREDICTING and self.num_pipelines > 1 and self._topology is not None
            ranks = list(self._topology.pipeline_ranks) if within else list(range(self.world_size))
            values = [int(received)] + [0] * len(ranks)
            values[1 + ranks.index(self.global_rank)] = int(_compat.batch_is_last(trainer))
            flags = torch.tensor(values, dtype=torch.int32, device=self.root_device)  # one copy there and one back
            with self._guard("every rank at the step boundary (the SIGTERM check)"):
                torch.distributed.all_reduce(flags, op=ReduceOp.SUM, group=self._topology.pipeline_group if within else None)
            values = flags.tolist()
            received, last = bool(values[0]), [r for r, flag in zip(ranks, values[1:]) if flag]
            if last and len(last) < len(ranks):
                raise PipeConfigError(checks.uneven_batches_message(last, [r for r in ranks if r not in last],
                                                                    trainer.state.stage.value))
        self._preemption.steps_begin()  # every rank is past start-up: a SIGTERM now stops after a batch
        if self._preemption.stop_now(received) and not trainer.received_sigterm:
            _compat.set_received_sigterm(trainer)

    @override
    def on_train_end(self) -> None:
        self._drain()
        if self._tracer is not None:
            title = f"{self.schedule}: {self.num_stages} stages, M={self.micro_batches}, measured"
            for path in self._tracer.write(self.global_rank, self.world_size, title):
                rank_zero_info(f"wrote {path}")
        super().on_train_end()

    # ------------------------------------------------------------------ evaluation
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._forward_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._forward_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._forward_step("predict_step", args, kwargs)

    def _forward_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        assert self._pipeline is not None
        self._agree_at_step_boundary()
        try:
            return self._pipeline.forward_step(hook, args, kwargs)
        finally:
            if self._sharded is not None:  # no backward frees what the forwards gathered
                self._sharded.reshard()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unpartitioned module's state_dict on rank 0 (``{}`` elsewhere)."""
        if self._pipeline is None:
            return super().lightning_module_state_dict()
        self._drain()
        if self.options.save_distributed_checkpoint:
            return sharded.model_part(self._pipeline)
        checks.check_sharded_checkpoints(self.options, True)
        return checkpointing.module_state(self._pipeline)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """One torch-format optimizer state for the whole module on rank 0 (``{}`` elsewhere)."""
        if self._pipeline is None:
            return unwrapped(optimizer).state_dict()
        self._drain()
        if self.options.save_distributed_checkpoint:
            return sharded.optimizer_part(self._pipeline, self._runtime, unwrapped(optimizer))
        return checkpointing.optimizer_state(self._pipeline, self._runtime, unwrapped(optimizer))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add the pipeline's own state, then write on rank 0 (atomically: see :func:`~.checkpointing.atomic_save`)."""
        distributed = self.options.save_distributed_checkpoint and self._pipeline is not None
        if self._runtime is not None:  # sharded: the policy's state stays with each rank (sharded.policy_part)
            checkpoint.update(self._runtime.checkpoint_state(policy=not distributed))
        if self._counts is not None:  # what a resumed run with balance="auto" adopts instead of planning again
            checkpoint[checkpointing.BALANCE_KEY] = list(self._counts)
        if distributed:
            assert self._pipeline is not None
            with self._guard("every rank's part of the sharded checkpoint"):
                sharded.save(self._pipeline, checkpoint, filepath, sharded.policy_part(self._pipeline, self._runtime), self.barrier)
        elif self.is_global_zero:
            checkpointing.atomic_save(self.checkpoint_io, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory: this rank's part only (its model entries loaded in place); a file: all of it,
        and a file that cannot be read fails with :class:`~lightning_pipe.CheckpointFileError` naming it."""
        self._loading = checkpoint_path
        if not sharded.is_sharded(checkpoint_path):
            checkpoint = checkpointing.read(self.checkpoint_io, checkpoint_path, weights_only)
        elif self._pipeline is None:
            raise PipeConfigError(
                f"{checkpoint_path} is a sharded checkpoint, which each stage reads after setup; resume it with "
                "PipeStrategy(save_distributed_checkpoint=True), or make one file of it with "
                "lightning_pipe.consolidate_checkpoint."
            )
        else:
            checkpoint = sharded.load(self._pipeline, checkpoint_path)
        if self._pipeline is not None and self._counts is not None:  # read after setup: too late to adopt its choices
            auto.check_resumed_choices(self.options, self._counts, self._avgpipe_tuned, checkpoint, checkpoint_path)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if sharded.SHARDED_KEY in checkpoint:  # loaded in place by load_checkpoint
            return
        try:
            checkpointing.load_module_state(self.lightning_module, checkpoint["state_dict"], self._pipeline, strict)
        except CheckpointMismatchError as error:
            where = f"{self._loading}: " if self._loading is not None else ""
            raise CheckpointMismatchError(f"{where}{error}") from None

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._runtime is not None:
            try:
                self._runtime.restore(checkpoint)
            except CheckpointMismatchError as error:  # say which file: a run may resume one of many
                where = f"{self._loading}: " if self._loading is not None else ""
                raise CheckpointMismatchError(f"{where}{error}") from None
        assert self._pipeline is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if sharded.SHARDED_KEY in checkpoint:
                sharded.load_optimizer(self._pipeline, self._runtime, unwrapped(optimizer), state)
            else:
                checkpointing.load_optimizer_state(self._pipeline, self._runtime, unwrapped(optimizer), state)
        self._update_mixed_groups_per_tensor()  # a loaded state brings its own param groups' settings
        _compat.optimizers_to_device(self.optimizers, self.root_device)

    # ------------------------------------------------------------------ collectives
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``group=None`` reduces over the data-parallel (stage) group: every stage of a pipeline
        already holds the same replayed value, so reducing over the world would count it once per stage;
        with one pipeline that group is this rank alone, and the value is returned as it is."""
        if not isinstance(tensor, Tensor) or (group is None and self.num_pipelines == 1):
            return tensor
        if group is None and self._topology is not None:
            group = self._topology.stage_group
        with self._guard("every rank's value (a reduced metric)"):
            return _compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        value = torch.tensor(int(decision), device=self.root_device)
        with self._guard("every rank's decision (e.g. a callback's)"):
            value = _compat.sync_ddp_if_available(value, None, reduce_op=ReduceOp.SUM)
        return bool(value == self.world_size) if all else bool(value)

    # Lightning's own collectives: a peer's failure reads as PeerFailure here too, not as gloo's words
    @override
    def barrier(self, name: str | None = None) -> None:
        with self._guard(f"the other ranks at a barrier{f' ({name})' if name else ''}"):
            super().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._guard(f"rank {src}'s broadcast"):
            return super().broadcast(obj, src)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """The whole world (``group=None``, or ``WORLD``, which ``LightningModule.all_gather`` passes) means the
        data-parallel (stage) group, as in :meth:`reduce`: the step's code after the trunk (``self.all_gather`` in
        ``validation_step``) runs on the last stage only, and every stage already holds the same replayed values.
        With one pipeline the tensor is returned as it is, as on one device."""
        if group is None or group is torch.distributed.group.WORLD:
            if self.num_pipelines == 1:
                return tensor
            group = self._topology.stage_group if self._topology is not None else group
        with self._guard("every rank's tensor (all_gather)"):
            return super().all_gather(tensor, group, sync_grads)

    def _guard(self, what: str) -> ContextManager[None]:
        return self._watchdog.guard(what) if self._watchdog is not None else nullcontext()

    @override
    def teardown(self) -> None:
        if self._preemption is not None:
            self._preemption.uninstall()
        if self._hook_logs is not None:
            self._hook_logs.unwrap()
        if self._pipeline is not None and self._pipeline.absent and self.lightning_module is not None:
            # Lightning moves the module to the CPU next: a stand-in on a GPU would arrive there at full size
            move_stand_ins(self.lightning_module, torch.device("cpu"))
        if self._watchdog is not None:
            self._watchdog.close()
        module = self.lightning_module
        if module is not None and has_meta_tensors(module):  # a failure before setup gave it memory: nothing to move
            with _compat.module_hidden(self):
                super().teardown()
            return
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks why this one fails, and make sure none outlives the job."""
        if self.world_size > 1:  # be gone well within the peers' reaper grace (engine/ending.py)
            ending.skip_final_collection()
        if isinstance(exception, SIGTERMException):  # every rank stops at the same batch: not a failure to report
            if self.is_global_zero:
                log.warning(preemption.outcome(self.lightning_module.trainer))
            if self._watchdog is not None:
                self._watchdog.end_stragglers(FAILURE_GRACE)
            super().on_exception(exception)
            return
        if self._watchdog is not None:
            self._watchdog.report(exception)
            # e.g. a raw collective error inside Lightning; Ctrl-C reaches every rank of a terminal itself
            if not isinstance(exception, (LightningPipeError, KeyboardInterrupt)):
                report = self._watchdog.peer_error(wait=self._watchdog.grace)
                if report is not None and not report.startswith(f"rank {self.global_rank} "):
                    log.error(f"rank {self.global_rank} failed ({type(exception).__name__}: {exception}) "
                              f"after {report}")
            self._watchdog.end_stragglers(FAILURE_GRACE)
        super().on_exception(exception)
