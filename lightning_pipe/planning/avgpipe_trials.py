"""Measure avgpipe candidates on the real devices: step 5 of the tuner (docs/algorithms.md §13).

The tuner's prediction (:mod:`lightning_pipe.planning.avgpipe_tuner`) takes each layer's compute time from a tight
profiling loop. Inside a real round compute runs slower (up to 35 % on the 2-core CPU machine of
docs/avgpipe.md, by an amount that changes from run to run) and messages take time the prediction
does not charge, while the best predicted candidates often lie within a few percent of each other:
their order is noise. Trials run the best predicted candidates for a few rounds each with the real
executor, transport, weight policy and optimizer class, on copies of this rank's stage, and the
tuner keeps the fastest measured.

Every rank of the job calls :func:`measure_candidates` with the same candidates. A candidate is
built afresh in every window and dropped after it (so trials never hold more than one candidate's
copies, i.e. no more memory than the run they try), warmed up, then timed between barriers; the
candidates take turns in rotating order, so a slow phase of a shared machine hits each alike.
What runs is described in :mod:`lightning_pipe.planning.trials`: copies of the stage's layers, the trunk's
input on the first stage, a stand-in loss on the last.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.engine import Executor, Transport, Watchdog, split_micro_batches
from lightning_pipe.engine.policies import ElasticAveraging
from lightning_pipe.planning.avgpipe_tuner import Candidate
from lightning_pipe.planning.trials import barrier, on_device, stage_copy, synchronize
from lightning_pipe.schedules import build_avgpipe

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class TrialStage:
    """What one rank needs to run candidates of its stage.

    Args:
        layers: this rank's stage (copied to ``device`` for every trial; never modified).
        stage: this rank's stage index; ``stages``: stages per pipeline.
        ranks: global rank of every stage of this rank's pipeline.
        transport: point-to-point layer (``None`` for a one-stage pipeline).
        watchdog: bounds every wait.
        make_optimizer: builds an optimizer over the copy's parameters (the user's class and defaults).
        inputs: first stage: the trunk input of one whole Lightning batch (``None`` on other stages).
        device: where the stage runs.
        alpha: the elastic averaging rate (``None``: ``0.9 / N``).
        gradient_group: the stage group across data-parallel pipelines (``None``: one pipeline).
        gradient_world: how many pipelines ``gradient_group`` spans.
    """

    layers: nn.Module
    stage: int
    stages: int
    ranks: Sequence[int]
    transport: Transport | None
    watchdog: Watchdog
    make_optimizer: OptimizerFactory
    inputs: Any
    device: torch.device
    alpha: float | None = None
    gradient_group: Any = None
    gradient_world: int = 1


def candidate_round(trial: TrialStage, candidate: Candidate) -> Callable[[], None]:
    """A function that runs one round of ``candidate`` on this rank (fresh copies, fresh optimizer)."""
    layers, chunk = stage_copy(trial.layers, trial.stage, trial.stages, trial.device)
    optimizer = trial.make_optimizer([p for p in layers.parameters() if p.requires_grad])
    n, m = candidate.replicas, candidate.micro_batches
    policy = ElasticAveraging(layers, optimizer, trial.stage, trial.stages, m, n, trial.alpha,
                              gradient_group=trial.gradient_group, gradient_world=trial.gradient_world)
    # only the first stage holds the micro-batches, so the others cannot tell when shapes change
    executor = Executor(trial.stage, trial.ranks, [chunk], trial.transport, trial.watchdog, policy=policy,
                        shape_headers="always")
    schedule = build_avgpipe(trial.stages, m, n, candidate.advance)
    if trial.stage == 0:
        inputs = on_device(trial.inputs, trial.device)
        micro_batches = [mb for part in split_micro_batches(inputs, n) for mb in split_micro_batches(part, m)]
    else:
        micro_batches = [None] * (n * m)  # only the first stage reads its micro-batches

    def run() -> None:
        executor.run(schedule, micro_batches)

    return run


def measure_candidates(
    trial: TrialStage, candidates: Sequence[Candidate], windows: int = 2, rounds: int = 2, warmup: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[list[float]]:
    """Seconds per round of every candidate in every window, measured on this rank.

    Every rank of the job must call this with the same arguments (except ``trial``). In window
    ``w`` the candidates run in the order rotated by ``w``; each is built, runs ``warmup`` untimed
    rounds, then ``rounds`` rounds between two job-wide barriers.

    Args:
        trial: this rank's stage and its surroundings.
        candidates: what to measure (e.g. the tuner's best predicted three).
        windows: timed windows per candidate; ``rounds``: timed rounds per window.
        warmup: untimed rounds before every timed window.
        progress: called with a line of text after every timed window (e.g. ``print`` on rank 0).
    """
    if windows < 1 or rounds < 1 or warmup < 0:
        raise ValueError(f"windows={windows} and rounds={rounds} must be >= 1 and warmup={warmup} >= 0.")
    times: list[list[float]] = [[] for _ in candidates]
    for window in range(windows):
        for k in range(len(candidates)):
            i = (window + k) % len(candidates)
            run = candidate_round(trial, candidates[i])
            for _ in range(warmup):
                run()
            synchronize(trial.device)
            with trial.watchdog.guard("the other ranks' avgpipe trials"):
                barrier()
            start = time.perf_counter()
            for _ in range(rounds):
                run()
            synchronize(trial.device)
            with trial.watchdog.guard("the other ranks' avgpipe trials"):
                barrier()
            times[i].append((time.perf_counter() - start) / rounds)
            del run
            if progress is not None:
                c = candidates[i]
                progress(f"avgpipe trial {window * len(candidates) + k + 1}/{windows * len(candidates)}: N={c.replicas} "
                         f"M={c.micro_batches} a={c.advance}: {times[i][-1] * 1e3:.1f} ms per round")
    return times


@dataclass(frozen=True)
class Measured:
    """A candidate with its measured round time (the median over the trial windows)."""

    candidate: Candidate
    round_time: float
    batch: int

    @property
    def throughput(self) -> float:
        return self.batch / self.round_time if self.round_time else float("inf")


def fastest(candidates: Sequence[Candidate], times: Sequence[Sequence[float]], batch: int) -> list[Measured]:
    """The candidates with their median measured round times, fastest first (ties: the prediction's order)."""
    measured = [Measured(c, statistics.median(t), batch) for c, t in zip(candidates, times)]
    order = sorted(range(len(measured)), key=lambda i: (measured[i].round_time, i))
    return [measured[i] for i in order]
