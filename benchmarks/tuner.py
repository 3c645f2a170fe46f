"""The avgpipe tuner's choice against the best measured of its top three candidates (issue 5).

    python benchmarks/tuner.py                       # defaults: MLP 8 × Linear(512), batch 128
    python benchmarks/tuner.py --windows 5 --steps-per-window 3

1. Profile the MLP trunk of ``benchmarks/avgpipe.py`` in this process (one thread, like each
   worker) at three micro-batch sizes (``L/16``, ``L/4``, ``L/2`` as at fit start), fit per stage
   (:func:`lightning_pipe.planning.avgpipe_tuner.fit_stages`), and profile each stage's STEP + AVG
   (:func:`lightning_pipe.planning.avgpipe_tuner.profile_step`).
2. Tune ``N <= --max-replicas``, every ``M`` dividing ``L / N``, ``a`` in ``--advances``
   (:func:`lightning_pipe.planning.avgpipe_tuner.tune`): the prediction's ranking.
3. Trials, as at fit start (``avgpipe_trials``): the best ``--trials`` predicted candidates run on the
   2 gloo processes with :func:`lightning_pipe.avg_trials.measure_candidates` (its defaults: 2 windows
   of 2 rounds after a warm-up round); the fastest is the tuner's choice.
4. Independently of the trials, the prediction's top three run with ``benchmarks/avgpipe.py``'s
   runner (its own model copies, MSE loss, fresh data), ``--steps-per-window`` steps per candidate
   per window in rotating order between barriers, so machine noise hits all alike. Measured
   samples/s is rank 0's median over windows.

The goal: the tuner's choice measured / best measured of the three >= 0.9. The table also shows the
prediction alone's choice (rank 1), i.e. the tuner with ``avgpipe_trials=0``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.avgpipe, and a source checkout

from benchmarks.avgpipe import STAGES, Runner, Variant, free_port, make_trunk, timed_windows  # noqa: E402
from lightning_pipe.engine import Transport, Watchdog  # noqa: E402
from lightning_pipe.planning.avgpipe_autotune import profile_sizes  # noqa: E402
from lightning_pipe.planning.avgpipe_trials import TrialStage, fastest, measure_candidates  # noqa: E402
from lightning_pipe.planning.avgpipe_tuner import Candidate, fit_stages, profile_step, tune  # noqa: E402
from lightning_pipe.planning.profile import profile_trunk  # noqa: E402


def runner_args(args: argparse.Namespace, c: Candidate) -> argparse.Namespace:
    """``benchmarks/avgpipe.py``'s runner options for one candidate (its micro-batch size)."""
    out = copy.copy(args)
    out.micro_batch_size = c.micro_batch_size
    return out


def variant(c: Candidate) -> Variant:
    return Variant(f"N={c.replicas} M={c.micro_batches} a={c.advance}", "avgpipe", c.micro_batches, c.replicas, c.advance)


def worker(rank: int, port: int, candidates: list[Candidate], args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES, timeout=timedelta(seconds=300))
    trial_times = None
    if args.trials > 1:  # exactly what fit start runs: copies of this rank's stage, the real executor and transport
        trunk = make_trunk(args.width, args.layers)
        half = len(trunk) // 2
        inputs = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(2))
        trial = TrialStage(trunk[:half] if rank == 0 else trunk[half:], rank, STAGES, list(range(STAGES)),
                           Transport(torch.device("cpu")), Watchdog.from_process_group(300.0),
                           lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), inputs if rank == 0 else None,
                           torch.device("cpu"))
        trial_times = measure_candidates(trial, candidates[:args.trials])
    top = candidates[:3]
    runners = [Runner(variant(c), rank, runner_args(args, c)) for c in top]
    for runner in runners:  # warm-up
        runner.step()
        runner.step()
    rates = timed_windows(runners, args.windows, args.steps_per_window)
    if rank == 0:
        torch.save((trial_times, rates), out)
    dist.barrier()
    dist.destroy_process_group()


def ping_pong(rank: int, port: int, numel: int, out: str) -> None:
    """Median one-way time of a ``numel``-float message between the 2 processes (ping-pong / 2)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES, timeout=timedelta(seconds=120))
    t, times = torch.zeros(numel), []
    for _ in range(50):
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append((time.perf_counter() - start) / 2)
    if rank == 0:
        torch.save(statistics.median(times[10:]), out)
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--width", type=int, default=512, help="width of every Linear layer")
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU pairs (half on each stage)")
    p.add_argument("--batch", type=int, default=128, help="the Lightning batch L shared by the replicas")
    p.add_argument("--max-replicas", type=int, default=4, help="largest N the tuner tries")
    p.add_argument("--advances", type=int, nargs="+", default=[0], help="advance-forward values a the tuner tries")
    p.add_argument("--trials", type=int, default=3,
                   help="best predicted candidates measured by the tuner's trials (avgpipe_trials; 0: prediction only)")
    p.add_argument("--measure-latency", action="store_true",
                   help="measure a message's one-way time (gloo ping-pong) and give it to the tuner as latency; "
                        "the fit-start tuner does not (it takes communication as free)")
    p.add_argument("--windows", type=int, default=5, help="measurement windows (each runs every candidate)")
    p.add_argument("--steps-per-window", type=int, default=4, help="training steps per candidate per window")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    trunk = make_trunk(args.width, args.layers)
    half = len(trunk) // 2
    profiles = [profile_trunk(trunk, torch.randn(b, args.width), "cpu", repeats=5, warmup=2)
                for b in profile_sizes(args.batch)]
    counts = [half, len(trunk) - half]
    steps = [profile_step(trunk[:half], lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)),
             profile_step(trunk[half:], lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9))]
    fits = fit_stages(profiles, counts, steps)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rates.pt")
        latency = 0.0
        if args.measure_latency:
            numel = args.batch // 4 * args.width  # a micro-batch of L/4 samples' boundary
            mp.start_processes(ping_pong, args=(free_port(), numel, out), nprocs=STAGES, start_method="spawn")
            latency = torch.load(out)
        ranked = tune(fits, args.batch, max_replicas=args.max_replicas, advances=tuple(args.advances), latency=latency)
        candidates = ranked[:max(3, args.trials)]
        mp.start_processes(worker, args=(free_port(), candidates, args, out), nprocs=STAGES, start_method="spawn")
        trial_times, rates = torch.load(out)
    top = candidates[:3]
    measured = [statistics.median(r) for r in rates]
    best = max(measured)
    chosen = fastest(candidates[:args.trials], trial_times, args.batch)[0].candidate if trial_times else top[0]
    trial_ms = {c: statistics.median(t) * 1e3 for c, t in zip(candidates, trial_times or [])}
    print(f"MLP {args.layers} × Linear({args.width}), 2 stages on 2 processes (one thread each), Lightning batch "
          f"{args.batch}; STEP+AVG profiled {steps[0] * 1e3:.2f} / {steps[1] * 1e3:.2f} ms; message latency given to "
          f"the tuner {latency * 1e3:.2f} ms; trials of the best {args.trials}; "
          f"{args.windows} windows × {args.steps_per_window} steps per candidate\n")
    print("| predicted rank | candidate (N, M, a) | micro-batch | predicted samples/s | trial ms/round | "
          "measured samples/s (median, min-max) | measured / best measured |")
    print("|---|---|---|---|---|---|---|")
    for i, (c, r) in enumerate(zip(top, rates)):
        mark = " (tuner's choice)" if c == chosen else ""
        trial = f"{trial_ms[c]:.1f}" if c in trial_ms else "-"
        print(f"| {i + 1}{mark} | ({c.replicas}, {c.micro_batches}, {c.advance}) | {c.micro_batch_size} | "
              f"{c.throughput:.0f} | {trial} | {statistics.median(r):.0f} ({min(r):.0f}-{max(r):.0f}) | "
              f"{statistics.median(r) / best:.2f} |")
    if chosen not in top:
        print(f"(the tuner chose ({chosen.replicas}, {chosen.micro_batches}, {chosen.advance}), outside the prediction's top three)")
    prediction_only = measured[0] / best
    print(f"\nprediction alone (avgpipe_trials=0): rank 1 / best measured = {prediction_only:.2f}")
    if chosen in top:
        ratio = measured[top.index(chosen)] / best
        print(f"tuner's choice / best measured: {ratio:.2f} (goal >= 0.90: {'met' if ratio >= 0.9 else 'not met'})")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (other processes share the machine)")


if __name__ == "__main__":
    main()
