"""This rank's share of the pipeline inside Lightning: the cut module, its executor, one batch through them.

:meth:`StagePipeline.cut` builds it once per process at the strategy's first setup. The runtimes
(:mod:`.runtimes`) run training batches through :meth:`StagePipeline.run`; evaluation (validation,
test, predict) is the same for every schedule and runs here (:meth:`StagePipeline.forward_step`).
Every rank ends a step holding what the last stage logged and returned (:mod:`.log_replay`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_pipe.engine import Executor, RunOptions, Topology, Transport, Watchdog, batch_size, split_micro_batches
from lightning_pipe.engine.local import LocalPipeline
from lightning_pipe.engine.outside import OutsideParameters
from lightning_pipe.engine.random_state import StepSeeds, derive_seed
from lightning_pipe.engine.recorder import ActionRecorder
from lightning_pipe.engine.sharding import ShardedLayers, shard_optimizer_state
from lightning_pipe.engine.stand_ins import is_absent, release, replace_outside, runs_outside_code
from lightning_pipe.errors import PipeConfigError
from lightning_pipe.lightning.checkpointing import configured_order
from lightning_pipe.lightning.hook_logs import StageHookLogs
from lightning_pipe.lightning.log_replay import LogCapture, combine, read_back_values, replay
from lightning_pipe.lightning.logger_calls import LoggerCall, LoggerCalls, make_calls
from lightning_pipe.lightning.module_glue import ModuleStages, detach_to_cpu, merge_outputs, step_loss
from lightning_pipe.partition import find_trunk, stage_bounds
from lightning_pipe.partition.materialize import release_memory
from lightning_pipe.partition.split import PartitionedTrunk, check_tied_outside
from lightning_pipe.planning.planner import Plan, format_bytes
from lightning_pipe.registry import build_schedule
from lightning_pipe.schedules.ir import locate_virtual_stage, virtual_stage_of

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lightning_pipe.lightning.context import PipeContext

#: ``launch(micro_batches, stages)``: run the batch's micro-batches through the pipeline and return
#: what the last virtual stage returned for each (empty elsewhere).
Launch = Callable[[list[Any], ModuleStages], list[Any]]


@dataclass
class Ran:
    """One batch after the pipeline ran it."""

    outputs: list[Any]  #: the last stage's per-micro-batch results (losses when training); empty elsewhere
    sizes: list[int]  #: samples per micro-batch
    size: int  #: samples in the batch
    capture: LogCapture  #: the ``self.log`` calls of the step
    logger_calls: list[LoggerCall]  #: the step's calls to the loggers (:mod:`.logger_calls`)


@dataclass(frozen=True)
class Layer:
    """A trunk layer as the stage table shows it."""

    kind: str
    parameters: int


class StagePipeline:
    """This rank's stage(s) of the pipeline, ready to run batches.

    Args:
        context: this Trainer call's fixed facts (options, topology, watchdog, transport, device, precision).
        module: the LightningModule that was cut (its hooks run the steps; its trainer holds the loop's state).
        partition: this rank's share of the trunk.
        outside: the parameters outside the trunk.
        counts: trunk layers per virtual stage.
        layers: every trunk layer, before the cut.
        key_order: ``state_dict`` keys of the unpartitioned module.
        param_order: parameter names of the unpartitioned module.

    ``absent``: the ``state_dict`` names outside the trunk that this rank holds as stand-ins
    (:mod:`lightning_pipe.engine.stand_ins`): from the cut, because it never runs the code that uses
    them; from the first step on (:meth:`release_unused_outside`), because another stage trains them.
    """

    def __init__(
        self, context: PipeContext, module: LightningModule, partition: PartitionedTrunk, outside: OutsideParameters,
        counts: list[int], layers: list[Layer], key_order: list[str], param_order: list[str],
    ) -> None:
        self.context = context
        self.module = module
        self.partition = partition
        self.outside = outside
        self.counts = counts
        self.layers = layers
        self.absent: set[str] = set()
        self.released: list[tuple[str, torch.nn.Parameter]] = []  # absent since the first step
        self.key_order = key_order
        self.param_order = param_order
        #: the whole module's optimizer's parameter names per param group, as configure_optimizers lists them
        #: (checkpointing.configured_order, asked before the cut; None: unknown, the module's order stands in)
        self.optimizer_order: list[list[str]] | None = None
        self.executor: Executor | LocalPipeline | None = None
        self.seen_batch = False  # a short batch is an error only before the first one
        self.batch_fingerprint: int | None = None  # of the batch this rank loaded for the step (engine.stage.batch_fingerprint)
        self.random_base = 0  # what every stage's step seeds derive from (engine.random_state), agreed at each setup
        self.steps_run = 0  # steps of any kind run so far: alike on every stage, as they run the same loops
        self.outside_buffers: list[tuple[torch.nn.Module, str]] = []  # (module, name) of the buffers outside the trunk

    @classmethod
    def cut(cls, context: PipeContext, module: LightningModule, counts: list[int]) -> StagePipeline:
        """Keep this rank's trunk layers (every virtual stage when emulating) and stub out the rest."""
        options, topology = context.options, context.topology
        name, trunk = find_trunk(module, options.module)
        local = [virtual_stage_of(topology.stage, chunk, topology.stages, options.spec.placement)
                 for chunk in range(options.chunks_per_stage)]
        if context.emulating:  # this process holds every virtual stage
            local = list(range(context.num_stages * options.chunks_per_stage))
        layers = [Layer(type(layer).__name__, sum(p.numel() for p in layer.parameters())) for layer in trunk]  # before the cut
        key_order = list(module.state_dict().keys())
        param_order = [n for n, _ in module.named_parameters()]
        optimizer_order = configured_order(module)
        if len(counts) > 1:
            check_tied_outside(module, name)
        partition = PartitionedTrunk(trunk, name, stage_bounds(counts), local, options.checkpoint_activations)
        outside = OutsideParameters(module, name, topology)
        pipeline = cls(context, module, partition, outside, list(counts), layers, key_order, param_order)
        pipeline.optimizer_order = optimizer_order
        virtual = context.num_stages * options.chunks_per_stage
        if not context.emulating and not runs_outside_code(local, virtual, partition.looped):
            # a Sequential's middle stage: never reads the embedding, head, ... (docs/large-models.md)
            names = [k for k in key_order if not outside.in_trunk(k)]
            pipeline.absent = set(replace_outside(module, names, context.root_device))
        return pipeline

    def release_unused_outside(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
        """After the first step (:meth:`OutsideParameters.learn`): turn the parameters outside the trunk
        that this rank holds but another stage trained into stand-ins, and give their memory back (the
        head on the first stage, the embedding on the last; on a looped trunk, what each stage's step
        did not train). A parameter no stage trained stays (an evaluation may use it), as does one this
        rank trained. Return the names released (docs/large-models.md)."""
        if self.context.emulating:  # one process holds every stage: every parameter is used here
            return []
        users, stage = self.outside.users or {}, self.topology.stage
        module = self.module
        named = [(n, p) for n, p in module.named_parameters()
                 if not self.outside.in_trunk(n) and not is_absent(p) and n in users and stage not in users[n]]
        if not named:
            return []
        for optimizer in optimizers:  # never stepped here, but drop any state made ahead of a gradient
            for _, p in named:
                optimizer.state.pop(p, None)
        released = release(module, [n for n, _ in named])
        self.absent |= set(released)
        self.released += named
        release_memory()
        return released

    def shard_outside(self, sharding: ShardedLayers, called: set[str], optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
        """``data_parallel="fsdp"``, once the first step showed who trains what: make the modules outside the trunk
        that only this stage trains, and that step called, FSDP2 units like the trunk's layers
        (:meth:`OutsideParameters.only_this_stage_trains`; ``called``: the modules it called), and move their
        optimizer state onto the shards. Every copy of the stage picks the same modules. Return their names."""
        names = self.outside.only_this_stage_trains(called)
        if not names:
            return []
        modules = [self.module.get_submodule(name) for name in names]
        whole = [list(module.parameters()) for module in modules]
        sharding.add(modules)  # FSDP2 puts a sharded parameter in each one's place, in the same order
        replaced = {old: new for module, olds in zip(modules, whole) for old, new in zip(olds, module.parameters())}
        shard_optimizer_state(optimizers, replaced, sharding.mesh)
        del whole, replaced
        release_memory()
        return names

    def check_released(self) -> None:
        """Stop if a released parameter got a gradient: this rank's step uses it after all (not in the
        first step), and it computed with a stand-in's zeros. Checked after every training step,
        before anything is stepped."""
        late = sorted(n for n, p in self.released if p.grad is not None)
        if late:
            raise PipeConfigError(
                f"stage {self.topology.stage} trained {', '.join(late)} in a later step but not in the first, "
                "after which it gave them back to save memory; make the first step use every parameter it "
                "will, or pass release_unused_outside=False."
            )

    # ------------------------------------------------------------------ the executor
    def use(self, context: PipeContext) -> None:
        """Run under a later Trainer call's context (its own watchdog and process groups; the options the
        pipeline was cut with, the same layer counts and schedule)."""
        self.context = context

    @property
    def topology(self) -> Topology:
        return self.context.topology

    @property
    def watchdog(self) -> Watchdog:
        return self.context.watchdog

    @property
    def virtual_stages(self) -> int:
        return self.context.virtual_stages

    def build_executor(self, recorder: ActionRecorder | None = None) -> Executor | LocalPipeline:
        """A fresh executor for this setup (``recorder`` times a traced fit's actions)."""
        names = [self.partition.describe_chunk(c) for c in range(len(self.partition.local))]
        context = self.context
        # the last stage's initial seed (seed_everything's): the stages agree even where the user seeded each rank apart
        self.random_base = self.from_last_stage(torch.initial_seed(), "the last stage's random seed")
        self.outside_buffers = [(holder, leaf) for _, holder, leaf in self.outside.buffers()]
        self.outside.note_buffers()  # until the first training step shows which stage changes each of them
        if context.emulating:
            self.executor = LocalPipeline(context.num_stages, context.options.chunks_per_stage, self.watchdog, names,
                                          shape_headers=context.options.shape_headers,
                                          placement=context.options.spec.placement)
        else:
            self.executor = Executor(
                self.topology.stage, self.topology.pipeline_ranks, [], self.transport(), self.watchdog, names=names,
                recorder=recorder, shape_headers=context.options.shape_headers,
            )  # chunk callables are bound per step: they close over the step's arguments
        return self.executor

    def transport(self) -> Transport | None:
        """This rank's point-to-point layer (``None`` for a one-process pipeline)."""
        return self.context.transport

    # ------------------------------------------------------------------ one batch
    def micro_batch_count(self, n: int, training: bool) -> int:
        """How many micro-batches a batch of ``n`` samples splits into."""
        options = self.context.options
        micro_batches = int(options.micro_batches)
        if n >= micro_batches:
            return micro_batches
        if training and not self.seen_batch:
            raise PipeConfigError(
                f"micro_batches={micro_batches} is larger than the batch size {n}; use micro_batches <= {n} "
                "or a larger batch size."
            )
        # a short last batch: fewer, smaller micro-batches (an interleaved step needs a multiple of stages)
        if training and options.spec.synchronous:
            stages = self.context.num_stages
            count = next((c for c in range(n, 0, -1) if options.spec.requirement(stages, c) is None), 0)
            if count == 0:
                raise PipeConfigError(
                    f"a batch of {n} samples cannot feed {options.schedule} on {stages} stages; set drop_last=True in the "
                    "DataLoader."
                )
            return count
        return n

    def run(
        self, hook: str, args: tuple, kwargs: dict, training: bool, split: Callable[[Any], list[Any]], launch: Launch,
    ) -> Ran:
        """Run the user's ``hook`` over the micro-batches ``split`` makes of the batch in ``args[0]``.

        ``launch`` runs the micro-batches through the executor (a flushed step, an asynchronous
        window, an avgpipe round); a failure is reported to every other rank before it propagates.
        """
        assert self.executor is not None
        module = self.module
        batch, rest = args[0], args[1:]
        micro_batches = split(batch)
        capture, logger_calls = LogCapture(module), LoggerCalls(module)
        user_step = getattr(module, hook)
        seeds = StepSeeds(derive_seed(self.random_base, self.steps_run), micro_batches)
        self.steps_run += 1
        stages = ModuleStages(
            lambda mb: user_step(mb, *rest, **kwargs), self.partition, self.virtual_stages, capture,
            (lambda out: step_loss(out, hook)) if training else (lambda out: out), logger_calls, seeds,
            self.outside_buffers,
        )
        self.executor.chunks = stages.chunk_callables()
        try:
            with capture, logger_calls:
                outputs = launch(micro_batches, stages)
        except BaseException as error:
            self.watchdog.report(error)
            raise
        return Ran(outputs, [batch_size(mb) for mb in micro_batches], batch_size(batch), capture, logger_calls.calls)

    def flush(self, hook: str, args: tuple, kwargs: dict, training: bool, schedule: str,
              last_backward: Callable[[], Any] | None = None, chunk_last_backward: Callable[[], Any] | None = None,
              chunk_early_forward: Callable[[], Any] | None = None) -> Ran:
        """One flushed step of the synchronous ``schedule`` (forwards only when not ``training``); ``last_backward``,
        ``chunk_last_backward`` and ``chunk_early_forward`` as in :class:`~lightning_pipe.engine.executor.RunOptions`."""
        context = self.context
        scaler = getattr(context.precision_plugin, "scaler", None) if training else None
        accumulate = self.module.trainer.accumulate_grad_batches if training else 1

        def split(batch: Any) -> list[Any]:
            return split_micro_batches(batch, self.micro_batch_count(batch_size(batch), training))

        def launch(micro_batches: list[Any], _: ModuleStages) -> list[Any]:
            n = sum(batch_size(mb) for mb in micro_batches)
            weights = [batch_size(mb) / n / accumulate for mb in micro_batches] if training else None
            plan = build_schedule(schedule, context.num_stages, len(micro_batches), context.options.chunks_per_stage,
                                  not training)
            options = RunOptions(loss_weights=weights, scale_loss=scaler.scale if scaler else None,
                                 last_backward=last_backward, chunk_last_backward=chunk_last_backward,
                                 chunk_early_forward=chunk_early_forward)
            return self.executor.run(plan, micro_batches, options)

        return self.run(hook, args, kwargs, training, split, launch)

    def forward_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """Validation, test or predict: a forward-only step; every rank returns the last stage's
        merged output and logs what it logged."""
        assert self.executor is not None
        with self.executor.current_weights():  # what a checkpoint saved now holds, under every schedule
            ran = self.flush(hook, args, kwargs, False, self.context.options.spec.flushed)
        merged = detach_to_cpu(merge_outputs(ran.outputs, ran.sizes)) if ran.outputs else None
        merged, records, calls = self.step_end_from_last_stage((merged, combine(ran.capture.records, self.module),
                                                                 ran.logger_calls))
        replay(self.module, records, owner=self.holds_last_stage, one_pipeline=self.context.num_pipelines == 1)
        self._make_logger_calls(calls)
        return merged

    def replayed_loss(self, ran: Ran) -> Tensor:
        """The batch loss (micro-batch losses weighted by their sizes) on every rank of the pipeline,
        after replaying the last stage's ``self.log`` calls on each of them.

        Within one process (one stage, or the emulation) the loss and the logged values stay on the
        device: reading them would make the host wait for the step's queued work, and the device
        would idle across the step boundary. Across processes the last stage reads them back with
        one transfer per step (the other stages get host values) and every other rank fills its copy
        on its device.
        """
        # the step's precision context, as around one device's training_step: "64-true" makes float64 the default
        # dtype there, which the loss and the logged values keep
        with self.context.precision_plugin.train_step_context():
            return self._replayed_loss(ran)

    def _replayed_loss(self, ran: Ran) -> Tensor:
        module = self.module
        loss: Tensor | float = 0.0
        dtype = ran.outputs[0].dtype if ran.outputs else torch.get_default_dtype()  # the step's own loss dtype
        if ran.outputs:  # micro-batch weights as Python scalars: no host-to-device copy
            loss = torch.stack([l.detach().reshape(()).double() * (s / ran.size) for l, s in zip(ran.outputs, ran.sizes)]).sum()
        records, calls = combine(ran.capture.records, module, read_back=False), ran.logger_calls
        if self.topology.stages > 1:  # the loss and the records in one transfer per device
            scalars = [loss] if isinstance(loss, Tensor) else []
            read = read_back_values(records, *scalars)
            loss, records, calls = self.step_end_from_last_stage((read[0] if read else loss, records, calls))
        replay(module, records, owner=self.holds_last_stage, one_pipeline=self.context.num_pipelines == 1)
        self._make_logger_calls(calls)
        if isinstance(loss, Tensor):
            return loss.to(self.context.root_device, dtype)
        return torch.full((), loss, dtype=dtype, device=self.context.root_device)

    def _make_logger_calls(self, calls: list[LoggerCall]) -> None:
        """The step's calls to the loggers, made where the loggers write (:mod:`.logger_calls`)."""
        if calls and self.context.is_global_zero:
            make_calls(calls, self.module.trainer.loggers)

    @property
    def last_stage_device(self) -> int:
        """The device (stage index) holding the last virtual stage, which computes the loss: the last
        device, or device 0 under zbv's V placement."""
        return locate_virtual_stage(self.virtual_stages - 1, self.context.num_stages, self.context.options.spec.placement)[0]

    @property
    def holds_last_stage(self) -> bool:
        return self.topology.stage == self.last_stage_device

    def from_last_stage(self, payload: Any, what: str = "the last stage's metrics") -> Any:
        """Broadcast ``payload`` (``what``, for a timeout's message) from the rank holding the pipeline's last virtual
        stage to all its stages."""
        topology = self.topology
        if topology.stages == 1:
            return payload
        box = [payload if self.holds_last_stage else None]
        with self.watchdog.guard(what):
            # host values through gloo (the object group), also when the pipeline's tensors travel on NCCL
            dist.broadcast_object_list(box, src=topology.pipeline_ranks[self.last_stage_device], group=topology.object_group)
        return box[0]

    def from_every_stage(self, obj: Any) -> list[Any]:
        """Every stage's ``obj`` on every stage of the pipeline, in stage order."""
        parts: list[Any] = [None] * self.topology.stages
        with self.watchdog.guard("every stage's values logged in a hook that runs on every stage"):
            dist.all_gather_object(parts, obj, group=self.topology.object_group)  # host values through gloo
        return parts

    def stage_hook_logs(self) -> StageHookLogs | None:
        """What merges the values that hooks running on every stage log (:mod:`.hook_logs`), where the stages are
        separate processes."""
        if self.context.emulating or self.topology.stages == 1:
            return None
        return StageHookLogs(self.module, self.from_every_stage, self.topology.stage, self.last_stage_device,
                             one_pipeline=self.context.num_pipelines == 1)

    def step_end_from_last_stage(self, payload: Any) -> Any:
        """:meth:`from_last_stage` at the end of a step, also carrying the last stage's ``trainer.should_stop`` and the
        fingerprint of its batch, which every stage checks against its own.

        The step's code after the trunk runs on the last stage only, so a ``self.trainer.should_stop = True``
        there (stopping at a loss threshold) must reach every stage: a stage that did not see it would start
        the next step alone and wait for its peers forever.
        """
        trainer = self.module.trainer
        payload, stop, fingerprint = self.from_last_stage((payload, trainer.should_stop, self.batch_fingerprint))
        if self.batch_fingerprint is not None and fingerprint is not None and fingerprint != self.batch_fingerprint:
            raise PipeConfigError(
                f"stage {self.topology.stage} loaded another batch than the last stage: the integer tensors (labels, token "
                "ids) differ, so the last stage's labels do not belong to the inputs the first stage used. Every rank of "
                "a pipeline must load the same batches; a dataset that shards itself by rank must shard by pipeline: "
                "rank=trainer.global_rank // trainer.strategy.num_stages, world_size=trainer.strategy.num_pipelines "
                "(docs/faq.md)."
            )
        if bool(stop) != trainer.should_stop:  # the last stage's value decides, or the stages part ways and hang
            if trainer.should_stop:
                log.warning(f"stage {self.topology.stage} set trainer.should_stop = True in code the last stage does not "
                            "run, so the pipeline goes on: every stage stops where the last stage's value says. Set it in "
                            "the step's code after the trunk (the loss, the logged values), which the last stage runs.")
            trainer.should_stop = bool(stop)
        return payload

    def gather_in_first_pipeline(self, obj: Any) -> list[Any] | None:
        """Every stage's ``obj`` on global rank 0 (``None`` elsewhere); only pipeline 0 takes part."""
        topology = self.topology
        if topology.stages == 1:
            return [obj] if self.context.is_global_zero else None
        if topology.pipeline != 0:
            return None
        parts = [None] * topology.stages if self.context.is_global_zero else None
        with self.watchdog.guard("every stage's part of the checkpoint"):  # through host memory (gloo), even on NCCL
            dist.gather_object(obj, parts, dst=0, group=topology.object_group)
        return parts

    # ------------------------------------------------------------------ the stage table
    def describe(self, plan: Plan | None = None, measured: Sequence[float] | None = None) -> str:
        """A table of the pipeline: schedule, stages, layers and parameters per stage (and, with
        ``balance="auto"``, the predicted and measured times)."""
        context, options = self.context, self.context.options
        stages = context.num_stages
        chunked = options.chunks_per_stage > 1
        lines = [
            f"{options.schedule}, {stages} stage(s) × {context.num_pipelines} pipeline(s), "
            f"{options.micro_batches} micro-batches per batch"
            + (f", {options.avgpipe.parallel_pipelines} parallel pipelines per device" if options.spec.family == "averaging" else "")
            + (f", {options.chunks_per_stage} chunks per stage" if chunked else "")
            + (", emulated in one process" if context.emulating else "")
            + (", balance='auto'" if plan is not None else "")
        ]
        header = ["stage", "layers", "parameters"] + (["predicted time", "predicted peak memory"] if plan else [])
        header += ["measured time"] if measured else []
        rows = []
        for vs, (start, end) in enumerate(stage_bounds(self.counts)):
            device, chunk = locate_virtual_stage(vs, stages, options.spec.placement)
            where = f"{device}" + (f" chunk {chunk}" if chunked else "")
            kinds = ", ".join(layer.kind for layer in self.layers[start:end])
            row = [where, f"{self.partition.name}[{start}:{end}] {kinds}",
                   f"{sum(layer.parameters for layer in self.layers[start:end]):,}"]
            if plan is not None:
                row += [f"{plan.stages[vs].time * 1e3:.2f} ms/micro-batch", format_bytes(plan.stages[vs].memory)]
            if measured:
                row += [f"{measured[vs] * 1e3:.2f} ms/micro-batch"]
            rows.append(row)
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if plan is not None:
            lines.append(f"  predicted: {plan.step_time * 1e3:.1f} ms per batch of {plan.micro_batches} "
                         f"micro-batches of {plan.micro_batch_size:g} samples")
        return "\n".join(lines)
