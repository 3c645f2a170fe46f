"""Throughput of avgpipe (2 parallel pipelines on 2 processes) vs gpipe and 1f1b at the same activation budget.

    python benchmarks/avgpipe.py                      # defaults: width 512, 8 layers, b = 32, budget 4
    python benchmarks/avgpipe.py --windows 7 --steps-per-window 4

Two stages in two CPU processes (gloo, one thread each) run the engine directly (no Lightning) on
an MLP trunk (``--layers`` × (Linear(width, width) + ReLU), MSE, SGD with momentum). Every variant
uses micro-batches of ``--micro-batch-size`` samples and is given the same *activation budget*: at
most ``--budget`` micro-batches in flight on the first stage (the stage that holds the most), the
peak being read off the schedule itself. Within that budget each variant takes as many
micro-batches per step as it can (up to ``--max-micro-batches``), since more micro-batches shrink
the bubble:

* ``gpipe``: all forwards first, so ``M = budget``;
* ``1f1b``: at most ``P = 2`` in flight, so ``M`` can be as large as allowed;
* ``avgpipe N=2`` (and ``advance_forward=1``): two replicas share the budget, each with its own
  mini-batch of ``M`` micro-batches; weights and optimizer state are held ``N`` times plus a center,
  which the table shows next to the activations.

Every window runs ``--steps-per-window`` steps of each variant in rotating order between barriers,
so machine noise hits all variants alike; samples/s is the median over windows of rank 0's
``steps × samples per step / seconds``, and the ratios are medians of per-window ratios.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

try:
    import lightning_pipe.engine  # noqa: F401
except ModuleNotFoundError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_pipe.engine import Executor, RunOptions, SequentialStage, Transport, Watchdog, split_micro_batches
from lightning_pipe.engine.policies import ElasticAveraging
from lightning_pipe.engine.shm import SharedMemoryTransport
from lightning_pipe.registry import build_schedule
from lightning_pipe.schedules import Kind, Schedule, build_avgpipe

STAGES = 2


@dataclass(frozen=True)
class Variant:
    """One schedule configuration: ``replicas`` mini-batches of ``micro_batches`` micro-batches per step."""

    name: str
    schedule: str
    micro_batches: int
    replicas: int = 1
    advance: int = 0

    def build(self) -> Schedule:
        if self.schedule == "avgpipe":
            return build_avgpipe(STAGES, self.micro_batches, self.replicas, self.advance)
        return build_schedule(self.schedule, STAGES, self.micro_batches)


def peak_in_flight(schedule: Schedule, device: int) -> int:
    """Most micro-batches whose activations a device holds at once (forwarded, not yet backwarded)."""
    live, peak = 0, 0
    for action in schedule.actions[device]:
        live += (action.kind is Kind.FORWARD) - (action.kind is Kind.BACKWARD)
        peak = max(peak, live)
    return peak


def largest_within(schedule: str, budget: int, limit: int, replicas: int = 1, advance: int = 0) -> Variant:
    """The variant with the most micro-batches (<= ``limit``) whose first stage stays within ``budget``."""
    best = None
    for m in range(1, limit + 1):
        variant = Variant("", schedule, m, replicas, advance)
        if max(peak_in_flight(variant.build(), d) for d in range(STAGES)) <= budget:
            best = variant
    if best is None:
        raise SystemExit(f"{schedule} cannot run within a budget of {budget} micro-batches.")
    suffix = f" N={replicas}" + (f" a={advance}" if advance else "") if schedule == "avgpipe" else ""
    return Variant(f"{schedule}{suffix} M={best.micro_batches}", schedule, best.micro_batches, replicas, advance)


def make_trunk(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


class Runner:
    """One rank's executor, weights and optimizer for one variant."""

    def __init__(self, variant: Variant, rank: int, args: argparse.Namespace) -> None:
        trunk = make_trunk(args.width, args.layers)
        half = len(trunk) // 2
        self.module = trunk[:half] if rank == 0 else trunk[half:]
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.01, momentum=0.9)
        self.variant, self.schedule = variant, variant.build()
        policy = None
        if variant.schedule == "avgpipe":
            policy = ElasticAveraging(self.module, self.optimizer, rank, STAGES, variant.micro_batches, variant.replicas)
        stage = SequentialStage(self.module, input_fn=(lambda mb: mb[0]) if rank == 0 else None,
                                loss_fn=(lambda out, mb: F.mse_loss(out, mb[1])) if rank == STAGES - 1 else None)
        cpu = torch.device("cpu")  # args.shared_memory: PipeStrategy's default on one CPU host (benchmarks/action_cost.py)
        transport = SharedMemoryTransport.create(cpu) if getattr(args, "shared_memory", False) else Transport(cpu)
        self.executor = Executor(rank, list(range(STAGES)), [stage], transport,
                                 Watchdog.from_process_group(300.0), policy=policy)
        g = torch.Generator().manual_seed(1)
        n = variant.micro_batches * args.micro_batch_size
        batches = [(torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g))
                   for _ in range(variant.replicas)]
        self.micro_batches = [mb for batch in batches for mb in split_micro_batches(batch, variant.micro_batches)]
        self.samples = variant.replicas * n

    def step(self) -> None:
        step = None if self.variant.schedule == "avgpipe" else self.optimizer.step
        self.executor.run(self.schedule, self.micro_batches, RunOptions(step=step))
        if step is not None:
            self.optimizer.zero_grad(set_to_none=True)


def timed_windows(runners: list[Runner], windows: int, steps_per_window: int) -> list[list[float]]:
    """Samples/s of every runner in every window; runners take turns in rotating order between
    barriers, so a slow phase of the machine hits each of them alike."""
    rates: list[list[float]] = [[] for _ in runners]
    for window in range(windows):
        for k in range(len(runners)):
            i = (window + k) % len(runners)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps_per_window):
                runners[i].step()
            dist.barrier()
            rates[i].append(steps_per_window * runners[i].samples / (time.perf_counter() - start))
    return rates


def worker(rank: int, port: int, variants: list[Variant], args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES, timeout=timedelta(seconds=300))
    runners = [Runner(v, rank, args) for v in variants]
    for runner in runners:  # warm-up
        runner.step()
    rates = timed_windows(runners, args.windows, args.steps_per_window)
    if rank == 0:
        torch.save(rates, out)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--width", type=int, default=512, help="width of every Linear layer")
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU pairs (half on each stage)")
    p.add_argument("--micro-batch-size", type=int, default=32, help="samples per micro-batch, equal for all variants")
    p.add_argument("--budget", type=int, default=4, help="micro-batches of activations the first stage may hold")
    p.add_argument("--max-micro-batches", type=int, default=8, help="most micro-batches per (replica) step")
    p.add_argument("--windows", type=int, default=5, help="measurement windows (each runs every variant)")
    p.add_argument("--steps-per-window", type=int, default=3, help="training steps per variant per window")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    limit = args.max_micro_batches
    variants = [
        largest_within("gpipe", args.budget, limit),
        largest_within("1f1b", args.budget, limit),
        largest_within("avgpipe", args.budget, limit, replicas=2),
        largest_within("avgpipe", args.budget, limit, replicas=2, advance=1),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rates.pt")
        mp.start_processes(worker, args=(free_port(), variants, args, out), nprocs=STAGES, start_method="spawn")
        rates = torch.load(out)
    base = rates[0]
    print(f"MLP {args.layers} × Linear({args.width}), 2 stages on 2 processes, micro-batch {args.micro_batch_size}, "
          f"activation budget {args.budget} micro-batches on a stage; {args.windows} windows × {args.steps_per_window} steps\n")
    print("| variant | samples/step | peak activations (micro-batches, stage 0 / 1) | weight + optimizer copies | "
          "samples/s (median, min-max) | vs gpipe |")
    print("|---|---|---|---|---|---|")
    for variant, r in zip(variants, rates):
        schedule = variant.build()
        peaks = " / ".join(str(peak_in_flight(schedule, d)) for d in range(STAGES))
        copies = f"{variant.replicas + 1} W + {variant.replicas} O" if variant.schedule == "avgpipe" else "1 W + 1 O"
        samples = variant.replicas * variant.micro_batches * args.micro_batch_size
        ratio = statistics.median(a / b for a, b in zip(r, base))
        print(f"| {variant.name} | {samples} | {peaks} | {copies} | {statistics.median(r):.0f} ({min(r):.0f}-{max(r):.0f}) | "
              f"{ratio:.2f} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (other processes share the machine)")


if __name__ == "__main__":
    main()
