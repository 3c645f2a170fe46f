"""The avgpipe tuner (docs/algorithms.md §13): choose N (parallel pipelines), M (micro-batches) and a
(advance forward) for a fixed partition, from profiles at two or three micro-batch sizes.

1. Fit, per stage, forward and backward time ``c0 + c1 b`` (least squares over the profiled sizes ``b``),
   activation bytes kept for backward ``c2 b`` and boundary bytes per sample; static bytes are the
   stage's parameter bytes times ``kappa`` (weights, gradient, optimizer state).
2. Enumerate ``N`` in ``1..max_replicas`` dividing the Lightning batch ``L`` (each replica gets
   ``B = L / N``), ``M`` among the divisors of ``B``, ``a`` among ``advances``. Memory per stage:
   ``N static + params + N min(M, w_s + a_s + 1) act(B / M)`` must stay below ``(1 - margin) cap``.
3. Predict the round time by merging the replicas' lists with the fitted durations
   (:func:`~lightning_pipe.schedules.build_avgpipe`) and simulating the merged lists
   (:func:`~lightning_pipe.sim.simulate.simulate`); throughput = ``L / round time``.
4. Best predicted throughput first; ties (within ``tie`` relative) go to smaller ``N``, then larger
   micro-batches ``b``, then smaller ``a``.

The Lightning batch ``L`` is fixed by the DataLoader, so every candidate trains on the same samples
per round; ``N`` only changes how they are shared between replicas.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_pipe.planning.profile import Profile
from lightning_pipe.schedules import MergeCosts, build_avgpipe
from lightning_pipe.schedules.avgpipe import warmup_forwards
from lightning_pipe.sim.simulate import Costs, Simulation, simulate


@dataclass(frozen=True)
class Line:
    """``c0 + c1 * b``."""

    c0: float
    c1: float

    def __call__(self, b: float) -> float:
        return max(0.0, self.c0 + self.c1 * b)


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """Least-squares line through ``(b, value)`` points (one point: through the origin)."""
    if len({b for b, _ in points}) < 2:
        b, v = points[0]
        return Line(0.0, v / b)
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mv = sum(v for _, v in points) / n
    c1 = sum((b - mb) * (v - mv) for b, v in points) / sum((b - mb) ** 2 for b, _ in points)
    return Line(mv - c1 * mb, c1)


@dataclass(frozen=True)
class StageFit:
    """Fitted costs of one stage (times in seconds, sizes in bytes, ``b`` in samples per micro-batch)."""

    forward: Line
    backward: Line
    activation_per_sample: float
    output_per_sample: float
    params: int
    step: float = 0.0  # seconds of one STEP plus its AVG (independent of b)


def profile_step(
    stage: nn.Module, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], alpha: float = 0.45,
    repeats: int = 5, warmup: int = 2,
) -> float:
    """Median seconds (after ``warmup`` untimed runs) of one replica's STEP and AVG on ``stage``.

    Works on a copy of ``stage`` with random gradients: ``optimizer(parameters)`` builds the
    optimizer (e.g. the user's class with its defaults), then the elastic averaging step
    ``D = alpha (W - C)``, ``W -= D``, ``C += D`` against a center copy.
    """
    replica = copy.deepcopy(stage)
    params = [p for p in replica.parameters() if p.requires_grad]
    if not params:
        return 0.0
    center = [p.detach().clone() for p in params]
    opt = optimizer(params)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        opt.step()
        with torch.no_grad():
            for w, c in zip(params, center):
                d = (w - c).mul_(alpha)
                w.sub_(d)
                c.add_(d)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_stages(profiles: Sequence[Profile], counts: Sequence[int], steps: Sequence[float] | None = None) -> list[StageFit]:
    """Per-stage fits from per-layer ``profiles`` measured at different micro-batch sizes;
    ``counts[s]`` trunk layers form stage ``s``; ``steps[s]`` is stage ``s``'s STEP + AVG time
    (:func:`profile_step`; ``None``: 0)."""
    if steps is not None and len(steps) != len(counts):
        raise ValueError(f"give one STEP time per stage ({len(counts)}), not {len(steps)}.")
    if not profiles:
        raise ValueError("the tuner needs at least one profile; profile the trunk at two or three micro-batch sizes.")
    fits, start = [], 0
    for s, count in enumerate(counts):
        end = start + count

        def total(p: Profile, attr: str) -> float:
            return float(sum(getattr(layer, attr) for layer in p.layers[start:end]))

        fits.append(StageFit(
            forward=fit_line([(p.micro_batch, total(p, "forward")) for p in profiles]),
            backward=fit_line([(p.micro_batch, total(p, "backward")) for p in profiles]),
            activation_per_sample=max(total(p, "saved") / p.micro_batch for p in profiles),
            output_per_sample=max(float(p.layers[end - 1].output) / p.micro_batch for p in profiles),
            params=int(total(profiles[0], "params")),
            step=0.0 if steps is None else float(steps[s]),
        ))
        start = end
    return fits


@dataclass(frozen=True)
class Candidate:
    """One (N, M, a) with its predictions."""

    replicas: int
    micro_batches: int
    advance: int
    micro_batch_size: int
    round_time: float
    throughput: float
    memory: tuple[float, ...]  # predicted peak bytes per stage
    feasible: bool


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def predict(
    fits: Sequence[StageFit], batch: int, replicas: int, micro_batches: int, advance: int = 0,
    bandwidth: float | None = None, latency: float = 0.0, step: float | None = None, kappa: float = 4.0,
    memory: Sequence[float] | None = None, margin: float = 0.1,
) -> Candidate:
    """Predicted round time, throughput and memory of one candidate (``batch`` = the Lightning batch).

    ``step``: seconds of one STEP + AVG; ``None`` takes the slowest stage's profiled ``fits[s].step``
    (the simulator has one STEP duration for all stages, and the slowest one sets the pace)."""
    stages = len(fits)
    b = batch // replicas // micro_batches
    round_time = simulate_round(fits, batch, replicas, micro_batches, advance, bandwidth, latency, step).step_time
    peaks = tuple(
        replicas * kappa * f.params + f.params
        + replicas * min(micro_batches, warmup_forwards(s, stages, micro_batches, advance) + 1) * f.activation_per_sample * b
        for s, f in enumerate(fits)
    )
    feasible = memory is None or all(p <= (1 - margin) * cap for p, cap in zip(peaks, memory))
    return Candidate(replicas, micro_batches, advance, b, round_time, batch / round_time if round_time else float("inf"),
                     peaks, feasible)


def simulate_round(
    fits: Sequence[StageFit], batch: int, replicas: int, micro_batches: int, advance: int = 0,
    bandwidth: float | None = None, latency: float = 0.0, step: float | None = None,
) -> Simulation:
    """One round of a candidate simulated with the fitted costs: the replicas' merged lists
    (:func:`~lightning_pipe.schedules.build_avgpipe`) through :func:`~lightning_pipe.sim.simulate.simulate`.
    Arguments as :func:`predict`."""
    if step is None:
        step = max(f.step for f in fits)
    b = batch // replicas // micro_batches
    forward = tuple(f.forward(b) for f in fits)
    backward = tuple(f.backward(b) for f in fits)
    transfer = tuple(latency + (f.output_per_sample * b / bandwidth if bandwidth else 0.0) for f in fits[:-1])
    schedule = build_avgpipe(len(fits), micro_batches, replicas, advance, MergeCosts(forward, backward, transfer, step))
    return simulate(schedule, Costs(forward, backward, transfer, step), replicas)


def tune(
    fits: Sequence[StageFit], batch: int, max_replicas: int = 4, micro_batch_choices: Sequence[int] | None = None,
    advances: Sequence[int] = (0,), memory: Sequence[float] | None = None, margin: float = 0.1,
    bandwidth: float | None = None, latency: float = 0.0, step: float | None = None, kappa: float = 4.0,
    tie: float = 1e-6,
) -> list[Candidate]:
    """Every feasible candidate, best first (see the module docstring for the rules).

    Args:
        fits: per-stage fits (:func:`fit_stages`).
        batch: the Lightning batch ``L`` (``N × B``).
        max_replicas: largest ``N`` tried.
        micro_batch_choices: allowed ``M`` values (default: every divisor of ``B``).
        advances: allowed advance-forward values ``a`` (those ``<= M`` are tried).
        memory: bytes available per stage (``None``: no limit); ``margin``: share kept free.
        bandwidth: bytes per second of every link (``None``: transfers cost only ``latency``).
        latency: seconds per message.
        step: seconds of one STEP (and its AVG) on a stage (``None``: the slowest stage's profiled
            ``StageFit.step``).
        kappa: static bytes per parameter byte for one replica (weights, gradient, optimizer state).
        tie: relative throughput difference below which two candidates tie.
    """
    candidates = []
    for n in range(1, max_replicas + 1):
        if batch % n:
            continue
        per_replica = batch // n
        for m in divisors(per_replica):
            if micro_batch_choices is not None and m not in micro_batch_choices:
                continue
            for a in (a for a in advances if a <= m):
                c = predict(fits, batch, n, m, a, bandwidth, latency, step, kappa, memory, margin)
                if c.feasible:
                    candidates.append(c)
    if not candidates:
        raise ValueError("no avgpipe candidate fits the memory limits; allow more memory, fewer replicas or smaller batches.")
    best = max(c.throughput for c in candidates)
    # within ``tie`` of each other: smaller N, then larger micro-batches, then smaller a
    return sorted(candidates, key=lambda c: (round(c.throughput / best / tie) * -1 if tie else -c.throughput,
                                             c.replicas, -c.micro_batch_size, c.advance))
