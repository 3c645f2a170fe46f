"""``balance="auto"``: profile the trunk, split it by the planner, agree on it, refine it on the devices.

Steps (all before the trunk is cut, so every layer is still present on every rank; the Lightning
side, :mod:`lightning_pipe.lightning.auto`, supplies the first batch and the trunk input):

1. Rank 0 profiles the trunk layer by layer on its device (cached in ``profile_cache``) on the trunk
   input of one micro-batch and runs the exact min-max split of docs/algorithms.md §12 for the
   configured schedule and micro-batch count under the per-device memory limits and speeds
   (:func:`split_by_profile`).
2. The chosen split (or rank 0's error) is broadcast to every rank, so all ranks cut identically
   (:func:`agreed`).
3. :func:`refine` (every rank): the split's stages are measured on the devices for a few steps and
   layers move off the measured bottleneck while that shrinks it (docs/algorithms.md §12 step 4).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.engine import Topology, Transport, Watchdog
from lightning_pipe.errors import PipeConfigError
from lightning_pipe.partition import stage_bounds
from lightning_pipe.planning.noise import MAX_SPREAD, MIN_GAIN
from lightning_pipe.planning.planner import GIB, Machine, Plan, StageCosts, fixed_plan, refine_split
from lightning_pipe.planning.profile import Profile, profile_trunk
from lightning_pipe.planning.trials import measure_stage, on_device
from lightning_pipe.registry import SCHEDULES


@dataclass(frozen=True)
class AutoBalanceOptions:
    """Options of ``balance="auto"`` (see :class:`~lightning_pipe.PipeStrategy`).

    Args:
        memory_gib: memory limit per device in GiB (one value, or one per stage); ``None``: the
            device's total memory on CUDA, no limit on CPU. avgpipe's tuner obeys it too.
        speeds: relative speed of each stage's device (e.g. ``[1.0, 2.0]`` when the second is twice as
            fast); ``None``: all equal.
        profile_cache: JSON file caching the per-layer profiles (keyed by model structure, input shape
            and device); ``None``: profile at every start.
        refine: after the planner's split, every rank runs a few steps of it on copies of its layers
            and measures each stage; then up to this many times a layer of the measured bottleneck
            moves to its faster neighbour, kept while the measured bottleneck shrinks
            (docs/algorithms.md §12 step 4). ``0``: trust the profile.
        max_spread: bound on the spread of the profile's latest timed rounds (interquartile range of
            the per-round totals over their median; ``0.25`` = 25 %): above it more rounds are timed
            (at most 4× as many), and a profile still above it is not cached and gets a warning that
            its split rests on noise. ``None``: trust the first rounds. Structurally identical layers
            share one cost either way (docs/planning.md, "Noise").
        min_gain: the uniform split is kept unless the planner's split is predicted this much faster
            (``0.05`` = 5 %): smaller predicted gains are noise or the cost model's own approximation.
    """

    memory_gib: float | list[float] | None = None
    speeds: list[float] | None = None
    profile_cache: str | None = None
    refine: int = 2
    max_spread: float | None = MAX_SPREAD
    min_gain: float = MIN_GAIN

    def __post_init__(self) -> None:
        memory = self.memory_gib if isinstance(self.memory_gib, list) else [self.memory_gib]
        if self.memory_gib is not None and (not memory or min(memory) <= 0):
            raise PipeConfigError(f"auto_balance memory_gib={self.memory_gib} must be positive (GiB per device, one "
                                  "value or one per stage), or None for the device's memory.")
        if self.speeds is not None and (not self.speeds or min(self.speeds) <= 0):
            raise PipeConfigError(f"auto_balance speeds={self.speeds} must be positive (one relative speed per stage).")
        if self.refine < 0:
            raise PipeConfigError(f"auto_balance refine={self.refine} must be at least 0 (0: no refinement).")
        if self.min_gain < 0:
            raise PipeConfigError(f"auto_balance min_gain={self.min_gain} must be at least 0 (e.g. 0.05 for 5 %).")
        if self.max_spread is not None and self.max_spread < 0:
            raise PipeConfigError(f"auto_balance max_spread={self.max_spread} must be at least 0 (e.g. 0.25 for 25 %), "
                                  "or None to trust the first timed rounds.")


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


def split_by_profile(
    trunk: torch.nn.Sequential,
    sample: Any,
    inputs: Any,
    schedule: str,
    stages: int,
    micro_batches: int,
    chunks: int,
    options: AutoBalanceOptions,
    device: torch.device,
    recompute: bool = False,
    module: torch.nn.Module | None = None,
) -> AutoBalance:
    """Rank 0's work after the trunk input was captured: profile every layer, split by the planner.

    Args:
        trunk: the whole trunk.
        sample: the trunk's input for one micro-batch (what each layer is profiled on).
        inputs: the trunk's input for one whole batch (the refinement's first stage feeds it), or ``None``.
        schedule, stages, micro_batches, chunks: the pipeline being planned.
        options: ``balance="auto"``'s options; ``device``: where to profile; ``recompute``: activation
            recomputation (``checkpoint_activations``).
        module: the module owning the trunk (keys the profile cache).
    """
    profile = profile_trunk(trunk, sample, device, cache=options.profile_cache, module=module, max_spread=options.max_spread)
    plan = fixed_plan(profile, schedule, stages, micro_batches, machine_of(options, device, recompute), chunks,
                      min_gain=options.min_gain)
    inputs = on_device(inputs, torch.device("cpu"))  # broadcast to every rank (captured inputs are detached)
    return AutoBalance(plan, profile, inputs)


def machine_of(options: AutoBalanceOptions, device: torch.device, recompute: bool = False) -> Machine:
    """The planner's view of the devices: memory limits, speeds, activation recomputation."""
    return Machine(memory=memory_limit(options, device), speeds=options.speeds, recompute=recompute)


def refine(
    auto: AutoBalance, options: AutoBalanceOptions, trunk: torch.nn.Sequential, topology: Topology, transport: Transport | None,
    watchdog: Watchdog, device: torch.device, recompute: bool = False, report: Callable[[str], None] | None = None,
) -> tuple[Plan, list[float]]:
    """Every rank: docs/algorithms.md §12 step 4 on the real devices (:func:`~lightning_pipe.planning.planner.refine_split`).

    Each split tried runs a few synchronous steps on copies of every stage's layers
    (:func:`lightning_pipe.planning.trials.measure_stage`, the schedule itself when synchronous, 1F1B for the
    asynchronous ones, whose compute is the same); every rank learns every stage's time, the
    slowest over data-parallel pipelines, so all ranks make the same moves. Returns the plan's
    predictions for the split kept and its measured stage times (seconds per micro-batch).
    """
    plan = auto.plan
    schedule = SCHEDULES[plan.schedule].flushed
    machine = machine_of(options, device, recompute)
    costs = StageCosts(auto.profile, plan.schedule, topology.stages, plan.micro_batches, machine, chunks=1)

    def measure(counts: list[int]) -> list[float]:
        start, end = stage_bounds(counts)[topology.stage]
        with preserved_random_state():
            mine = measure_stage(trunk[start:end], topology.stage, topology.stages, topology.pipeline_ranks, transport,
                                 watchdog, schedule, plan.micro_batches, auto.inputs if topology.stage == 0 else None, device)
        everyone: list[Any] = [None] * topology.world_size
        if topology.world_size > 1:
            with watchdog.guard("every stage's measured time"):
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


def noise_warning(profile: Profile, options: AutoBalanceOptions, balance: list[int]) -> str | None:
    """What rank 0 warns when the profile's timed rounds still spread more than ``max_spread``."""
    if not profile.noisy:
        return None
    return (f"balance='auto': the profile's timed rounds still spread {profile.spread:.0%} after {profile.timed_rounds} "
            f"rounds (bound {options.max_spread:.0%}, auto_balance max_spread), so the split {balance} rests on noisy "
            "timings (structurally identical layers were still given one cost); give balance as a list, or profile on a "
            "quieter machine with profile_cache set so later starts reuse it.")


def agreed(is_rank_zero: bool, world_size: int, work: Callable[[], Any], what: str = "balance='auto'") -> Any:
    """Run ``work()`` on rank 0 and broadcast its result (or its error) to every rank; ``what`` names
    the work in the error the other ranks raise."""
    box: list[Any] = [None]
    if is_rank_zero:
        try:
            box[0] = work()
        except PipeConfigError as error:
            box[0] = error
        except Exception as error:  # any other failure must still reach (and end) the other ranks
            box[0] = RuntimeError(f"{what} failed on rank 0: {type(error).__name__}: {error}")
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise PipeConfigError(str(box[0]))
    return box[0]
