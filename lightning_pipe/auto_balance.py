"""``balance="auto"``: profile the trunk on rank 0 at setup, split it by the planner, agree on it.

Steps (all before the trunk is cut, so every layer is still present on every rank):

1. Rank 0 takes the first batch of the loop that is starting (``trainer.fit_loop._data_source``,
   the same source Lightning's own loop reads: a DataLoader passed to ``fit``, or the
   LightningModule's / datamodule's ``train_dataloader()``, called once more). Python, NumPy and
   torch random states are restored afterwards, so the data order and initialisation of the run
   are the same as without profiling. The batch goes through the module's batch-transfer hooks.
2. It splits off the first micro-batch and runs the module's own step on it until the trunk call
   (:func:`~lightning_pipe.partition.profile.capture_trunk_input`): the trunk input as training
   produces it, with ``self.log`` calls swallowed.
3. It profiles the trunk layer by layer on its device (cached in ``profile_cache``) and runs the
   exact min-max split of ALGORITHMS.md section 12 for the configured schedule and micro-batch count
   under the per-device memory limits and speeds.
4. The chosen split (or rank 0's error) is broadcast to every rank, so all ranks cut identically.
5. :func:`refine` (every rank): the split's stages are measured on the devices for a few steps and
   layers move off the measured bottleneck while that shrinks it (ALGORITHMS.md section 12 step 4).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pipe.config import PipeConfigError
from lightning_pipe.engine import Transport, Watchdog, split_micro_batches
from lightning_pipe.log_replay import LogCapture
from lightning_pipe.partition import find_trunk, stage_bounds
from lightning_pipe.partition.planner import GIB, Machine, Plan, PlanError, StageCosts, fixed_plan, refine_split
from lightning_pipe.partition.profile import Profile, capture_trunk_input, profile_trunk
from lightning_pipe.schedules import SYNC_SCHEDULES
from lightning_pipe.topology import Topology
from lightning_pipe.trials import measure_stage, on_device

_STEPS = {
    TrainerFn.FITTING: ("fit_loop", "training_step"),
    TrainerFn.VALIDATING: ("validate_loop", "validation_step"),
    TrainerFn.TESTING: ("test_loop", "test_step"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_step"),
}


@dataclass(frozen=True)
class AutoBalanceOptions:
    """Options of ``balance="auto"`` (see :class:`~lightning_pipe.PipeStrategy`).

    Args:
        memory_gib: memory limit per device in GiB (one value, or one per stage); ``None``: the
            device's total memory on CUDA, no limit on CPU.
        speeds: relative speed of each stage's device (``1.0`` = the profiling device).
        cache: JSON file for profiles; ``None``: profile every run.
        refine: most boundary moves of the refinement from measured stage times (0: none).
    """

    memory_gib: float | Sequence[float] | None = None
    speeds: Sequence[float] | None = None
    cache: str | None = None
    refine: int = 2


@dataclass(frozen=True)
class AutoBalance:
    """Rank 0's result: the chosen plan, with what refinement needs on every rank."""

    plan: Plan
    profile: Profile  # the profile the plan came from (memory checks of refinement moves)
    inputs: Any  # the trunk input of the whole profiled batch (the first stage feeds it to the trials)


def memory_limit(options: AutoBalanceOptions, device: torch.device) -> float | list[float] | None:
    """Bytes per device: the option, else the CUDA device's total memory, else none."""
    if options.memory_gib is not None:
        if isinstance(options.memory_gib, (int, float)):
            return float(options.memory_gib) * GIB
        return [float(m) * GIB for m in options.memory_gib]
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return None


@contextmanager
def preserved_random_state() -> Iterator[None]:
    """Restore Python, NumPy and torch (CPU and CUDA) random states on exit."""
    python = random.getstate()
    torch_state = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        import numpy

        numpy_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        numpy, numpy_state = None, None
    try:
        yield
    finally:
        random.setstate(python)
        torch.set_rng_state(torch_state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


@contextmanager
def preserved_buffers(module: torch.nn.Module) -> Iterator[None]:
    """Restore every buffer of ``module`` on exit (profiling runs layers in training mode)."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def first_batch(trainer: Trainer, module: LightningModule) -> tuple[Any, str]:
    """The first batch of the loop that is starting (after the batch-transfer hooks) and the step
    hook that consumes it."""
    loop_name, hook = _STEPS.get(trainer.state.fn, _STEPS[TrainerFn.FITTING])
    source = getattr(trainer, loop_name)._data_source
    if not source.is_defined():
        raise PipeConfigError(f"balance='auto' profiles one batch but no {source.name} is defined; pass a dataloader or give a list of layer counts.")
    with preserved_random_state():
        loaders = source.dataloader()
        if isinstance(loaders, dict):
            loaders = next(iter(loaders.values()))
        elif isinstance(loaders, (list, tuple)):
            loaders = loaders[0]
        iterator = iter(loaders)
        try:
            batch = next(iterator)
        except StopIteration:
            raise PipeConfigError(f"balance='auto' profiles one batch but {source.name} is empty.") from None
        finally:
            del iterator  # shuts down worker processes
    return module._apply_batch_transfer_handler(batch), hook


def profile_and_split(
    trainer: Trainer,
    module: LightningModule,
    trunk_name: str | None,
    schedule: str,
    stages: int,
    micro_batches: int,
    chunks: int,
    options: AutoBalanceOptions,
    device: torch.device,
    recompute: bool = False,
) -> AutoBalance:
    """Rank 0's work: sample batch, trunk input, profile, split (see the module docstring).

    Random states and the module's buffers (e.g. BatchNorm running statistics) are restored
    afterwards, so the run trains exactly as it would have without profiling.
    """
    _, trunk = find_trunk(module, trunk_name)
    with preserved_random_state(), preserved_buffers(module):
        batch, hook = first_batch(trainer, module)
        micro_batch = split_micro_batches(batch, micro_batches)[0]
        step = getattr(module, hook)
        with LogCapture(module):
            sample = capture_trunk_input(module, trunk, lambda: step(micro_batch, 0), hook)
            inputs = capture_trunk_input(module, trunk, lambda: step(batch, 0), hook) if options.refine else None
        profile = profile_trunk(trunk, sample, device, cache=options.cache, module=module)
    plan = fixed_plan(profile, schedule, stages, micro_batches, machine_of(options, device, recompute), chunks)
    inputs = on_device(inputs, torch.device("cpu"))  # broadcast to every rank (captured inputs are detached)
    return AutoBalance(plan, profile, inputs)


def machine_of(options: AutoBalanceOptions, device: torch.device, recompute: bool = False) -> Machine:
    """The planner's view of the devices: memory limits, speeds, activation recomputation."""
    return Machine(memory=memory_limit(options, device), speeds=options.speeds, recompute=recompute)


def refine(
    auto: AutoBalance, options: AutoBalanceOptions, trunk: torch.nn.Sequential, topology: Topology, transport: Transport | None,
    watchdog: Watchdog, device: torch.device, recompute: bool = False, report: Callable[[str], None] | None = None,
) -> tuple[Plan, list[float]]:
    """Every rank: ALGORITHMS.md section 12 step 4 on the real devices (:func:`~lightning_pipe.partition.planner.refine_split`).

    Each split tried runs a few synchronous steps on copies of every stage's layers
    (:func:`lightning_pipe.trials.measure_stage`, the schedule itself when synchronous, 1F1B for the
    asynchronous ones, whose compute is the same); every rank learns every stage's time, the
    slowest over data-parallel pipelines, so all ranks make the same moves. Returns the plan's
    predictions for the split kept and its measured stage times (seconds per micro-batch).
    """
    plan = auto.plan
    schedule = plan.schedule if plan.schedule in SYNC_SCHEDULES else "1f1b"
    machine = machine_of(options, device, recompute)
    costs = StageCosts(auto.profile, plan.schedule, topology.stages, plan.micro_batches, machine, chunks=1)

    def measure(counts: list[int]) -> list[float]:
        start, end = stage_bounds(counts)[topology.stage]
        with preserved_random_state():
            mine = measure_stage(trunk[start:end], topology.stage, topology.stages, topology.pipeline_ranks, transport,
                                 watchdog, schedule, plan.micro_batches, auto.inputs if topology.stage == 0 else None, device)
        everyone: list[Any] = [None] * topology.world_size
        if topology.world_size > 1:
            dist.all_gather_object(everyone, (topology.stage, mine))
        else:
            everyone = [(topology.stage, mine)]
        return [max(t for s, t in everyone if s == stage) for stage in range(topology.stages)]

    def tell(counts: list[int], times: list[float], kept: bool) -> None:
        if report is not None:
            ms = ", ".join(f"{t * 1e3:.2f}" for t in times)
            report(f"balance='auto' refinement: {counts} measured [{ms}] ms per micro-batch per stage"
                   + ("" if kept else " (slower bottleneck, not kept)"))

    counts, times = refine_split(plan.balance, measure, costs.feasible, options.refine, tell)
    return (plan if counts == plan.balance else costs.plan(counts)), times


def agreed_plan(is_rank_zero: bool, world_size: int, work: Any, what: str = "balance='auto'") -> Any:
    """Run ``work()`` on rank 0 and broadcast its result (or its error) to every rank; ``what`` names
    the work in the error the other ranks raise."""
    box: list[Any] = [None]
    if is_rank_zero:
        try:
            box[0] = work()
        except (PlanError, PipeConfigError) as error:
            box[0] = error
        except Exception as error:  # any other failure must still reach (and end) the other ranks
            box[0] = RuntimeError(f"{what} failed on rank 0: {type(error).__name__}: {error}")
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise PipeConfigError(str(box[0]))
    return box[0]
