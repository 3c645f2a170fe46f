"""``parallel_pipelines="auto"`` / ``micro_batches="auto"`` for avgpipe: profile at fit start, then tune.

Rank 0 takes the first training batch, profiles every trunk layer (``partition.profile``) at three
micro-batch sizes, fits and ranks the candidates (:mod:`lightning_pipe.avg_tuner`), and every rank
receives the choice. Random states and buffers are restored, so training runs exactly as it would
have with the chosen values given by hand.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_pipe.auto_balance import first_batch, preserved_buffers, preserved_random_state
from lightning_pipe.avg_tuner import Candidate, fit_stages, profile_step, tune
from lightning_pipe.config import PipeConfigError
from lightning_pipe.engine import batch_size, split_micro_batches
from lightning_pipe.log_replay import LogCapture
from lightning_pipe.partition import find_trunk
from lightning_pipe.partition.profile import capture_trunk_input, profile_trunk

MAX_REPLICAS = 4  # largest N the tuner tries for parallel_pipelines="auto"


def profile_sizes(batch: int) -> list[int]:
    """Three micro-batch sizes spread over ``1..batch`` (fewer when the batch is tiny)."""
    return sorted({max(1, batch // 16), max(1, batch // 4), max(1, batch // 2)})


def stage_steps(module: LightningModule, trunk: torch.nn.Sequential, counts: list[int], device: torch.device) -> list[float]:
    """Per stage, the median time of one STEP + AVG with the user's optimizer class and defaults
    (``configure_optimizers`` is called once to learn them; its objects are discarded)."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    optimizer = _init_optimizers_and_lr_schedulers(module)[0][0]
    steps, start = [], 0
    for count in counts:
        stage = trunk[start:start + count]
        start += count
        steps.append(profile_step(copy.deepcopy(stage).to(device), lambda ps: type(optimizer)(ps, **optimizer.defaults)))
    return steps


def profile_and_tune(
    trainer: Trainer, module: LightningModule, trunk_name: str | None, counts: list[int],
    replicas: int | str, micro_batches: int | str, advance: int, device: torch.device, memory: float | None = None,
) -> tuple[Candidate, list[Candidate]]:
    """Rank 0's work: the chosen candidate and the ranking (``"auto"`` marks what is tuned)."""
    _, trunk = find_trunk(module, trunk_name)
    with preserved_random_state(), preserved_buffers(module):
        batch, hook = first_batch(trainer, module)
        size = batch_size(batch)
        step = getattr(module, hook)
        profiles = []
        for b in profile_sizes(size):
            micro_batch = split_micro_batches(batch, math.ceil(size / b))[0]
            with LogCapture(module):
                sample = capture_trunk_input(module, trunk, lambda: step(micro_batch, 0), hook)
            profiles.append(profile_trunk(trunk, sample, device, repeats=3, warmup=1, module=module))
        steps = stage_steps(module, trunk, counts, device)
    fits = fit_stages(profiles, counts, steps)
    try:
        ranked = tune(
            fits, size, max_replicas=MAX_REPLICAS if replicas == "auto" else int(replicas),
            micro_batch_choices=None if micro_batches == "auto" else (int(micro_batches),), advances=(advance,),
            memory=None if memory is None else [memory] * len(counts),
        )
    except ValueError as error:
        raise PipeConfigError(str(error)) from None
    if replicas != "auto":
        ranked = [c for c in ranked if c.replicas == int(replicas)]
    if not ranked:
        raise PipeConfigError(
            f"no avgpipe candidate with parallel_pipelines={replicas} and micro_batches={micro_batches} fits a batch of "
            f"{size}; let both be 'auto' or change the batch size."
        )
    return ranked[0], ranked[:5]


def describe(ranked: list[Candidate]) -> str:
    """The top candidates as a small table (rank 0 prints it at setup)."""
    lines = ["avgpipe tuner (predicted from profiles; best first):", "  N  M  b  round ms  samples/s"]
    for c in ranked:
        lines.append(f"  {c.replicas}  {c.micro_batches}  {c.micro_batch_size}  {c.round_time * 1e3:.2f}  {c.throughput:.0f}")
    return "\n".join(lines)


def agreed(is_rank_zero: bool, world_size: int, work: Any) -> Any:
    """``work()`` on rank 0, broadcast to every rank (its error too)."""
    from lightning_pipe.auto_balance import agreed_plan

    return agreed_plan(is_rank_zero, world_size, work)
