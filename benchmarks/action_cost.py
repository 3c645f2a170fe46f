"""What a compute action costs inside a pipeline against a tight loop (docs/avgpipe.md).

    python benchmarks/action_cost.py                        # micro-batches of 16, 32 and 64 samples
    python benchmarks/action_cost.py --sizes 32 --steps 20

One stage of ``benchmarks/avgpipe.py``'s MLP (``--layers / 2`` × (Linear(width) + ReLU), one thread)
is timed three ways per micro-batch size ``b``, all in one run:

* **loop**: forward, then backward, back to back, ``--repeats`` times (what the profiler sees);
* **after idle**: the same with a ``--idle`` ms sleep before each forward and each backward (what a
  stage does while it waits for its peer);
* **pipeline**: a 1F1B step of ``--micro-batches`` micro-batches of ``b`` samples on 2 processes
  (one stage each), every action recorded by the executor's ``ActionRecorder``; per-action medians
  over ``--steps`` steps after 3 warm-up steps, and the step time not covered by any action
  (executor bookkeeping between actions, posting receives). Once per ``--transports``: gloo's
  sockets, and shared memory (``PipeStrategy(transport="auto")``'s choice on one CPU host);
  ``gloo_unchecked`` is gloo without the size trailer after each message (what checking sizes costs).

Medians throughout. The processes run one after the other, never beside each other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.avgpipe, and a source checkout

from benchmarks.avgpipe import STAGES, Runner, Variant, free_port, make_trunk  # noqa: E402
from lightning_pipe.engine import ActionRecorder, Transport  # noqa: E402


def loop_times(args: argparse.Namespace, b: int, idle: float) -> tuple[float, float]:
    """Median forward and backward seconds of one stage at ``b`` samples, ``idle`` seconds asleep before each."""
    torch.set_num_threads(1)
    stage = make_trunk(args.width, args.layers)[: args.layers]  # half the Linear+ReLU pairs
    x = torch.randn(b, args.width, requires_grad=True)
    forwards, backwards = [], []
    for i in range(args.repeats + 10):
        if idle:
            time.sleep(idle)
        start = time.perf_counter()
        y = stage(x)
        middle = time.perf_counter()
        if idle:
            time.sleep(idle)
            middle_after = time.perf_counter()
        else:
            middle_after = middle
        y.backward(torch.ones_like(y))
        end = time.perf_counter()
        if i >= 10:
            forwards.append(middle - start)
            backwards.append(end - middle_after)
    return statistics.median(forwards), statistics.median(backwards)


def pipeline_worker(rank: int, port: int, b: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES, timeout=timedelta(seconds=120))
    if args.transport == "gloo_unchecked":  # what the 16-byte size trailer after each gloo message costs
        Transport.checks_sizes = lambda self, peer, tensor: False
    runner_args = argparse.Namespace(width=args.width, layers=args.layers, micro_batch_size=b,
                                     shared_memory=args.transport == "shared_memory")
    runner = Runner(Variant("1f1b", "1f1b", args.micro_batches), rank, runner_args)
    recorder = ActionRecorder(rank, clock=time.perf_counter)
    runner.executor.recorder = recorder
    for _ in range(3):
        runner.step()
    dist.barrier()
    recorder.enabled = True
    steps = []
    for step in range(args.steps):
        recorder.step = step
        start = time.perf_counter()
        runner.step()
        steps.append((start, time.perf_counter()))
    recorder.enabled = False
    gathered = [None] * STAGES
    dist.all_gather_object(gathered, (recorder.rows(), steps))
    if rank == 0:
        torch.save(gathered, out)
    dist.barrier()
    dist.destroy_process_group()


def pipeline_times(args: argparse.Namespace, b: int, out: str) -> list[dict[str, float]]:
    """Per rank: median forward and backward seconds in the pipeline, and uncovered seconds per step."""
    mp.start_processes(pipeline_worker, args=(free_port(), b, args, out), nprocs=STAGES, start_method="spawn")
    results = []
    for rows, steps in torch.load(out):
        durations = defaultdict(list)
        covered = defaultdict(float)
        for row in rows:
            durations[row["kind"]].append(row["end"] - row["start"])
            covered[row["step"]] += row["end"] - row["start"]
        uncovered = statistics.median((end - start) - covered[i] for i, (start, end) in enumerate(steps))
        results.append({"F": statistics.median(durations["F"]), "B": statistics.median(durations["B"]),
                        "uncovered": uncovered, "step": statistics.median(end - start for start, end in steps)})
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--width", type=int, default=512, help="width of every Linear layer")
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU pairs of the whole MLP (half per stage)")
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64], help="samples per micro-batch")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per pipeline step")
    p.add_argument("--repeats", type=int, default=200, help="timed iterations of the loops")
    p.add_argument("--idle", type=float, default=1.0, help="ms asleep before each action in the 'after idle' loop")
    p.add_argument("--steps", type=int, default=10, help="timed pipeline steps")
    p.add_argument("--transports", nargs="+", choices=["gloo", "gloo_unchecked", "shared_memory"], default=["gloo", "shared_memory"],
                   help="point-to-point layers of the pipeline runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"one stage: {args.layers // 2} × (Linear({args.width}) + ReLU), one thread; pipeline: 1f1b, 2 stages on 2 "
          f"processes, {args.micro_batches} micro-batches; medians in ms\n")
    print("| micro-batch | transport | forward: loop / after idle / pipeline (rank 0, 1) | backward: loop / after idle / "
          "pipeline (rank 0, 1) | pipeline step | not in any action |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for b in args.sizes:
            loop_f, loop_b = loop_times(args, b, 0.0)
            idle_f, idle_b = loop_times(args, b, args.idle / 1e3)
            for transport in args.transports:
                args.transport = transport
                ranks = pipeline_times(args, b, os.path.join(tmp, "rows.pt"))
                ms = lambda key: ", ".join(f"{r[key] * 1e3:.2f}" for r in ranks)  # noqa: E731
                print(f"| {b} | {transport} | {loop_f * 1e3:.2f} / {idle_f * 1e3:.2f} / {ms('F')} | {loop_b * 1e3:.2f} / "
                      f"{idle_b * 1e3:.2f} / {ms('B')} | {ms('step')} | {ms('uncovered')} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (other processes share the machine)")


if __name__ == "__main__":
    main()
