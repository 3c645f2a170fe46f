"""Throughput of the asynchronous schedules against gpipe and the no-bubble limit (2 stages).

    python benchmarks/async_throughput.py --workloads W1 W2 --micro-batches 4 --windows 5

Same workloads, processes, threads and timing method as ``benchmarks/throughput.py`` (whose
building blocks this script reuses): one pair of gloo processes per workload builds every variant,
then times windows of training steps in rotating order. An asynchronous variant runs one window of
its endless stream per step (no flush, no drain inside the timing). References per window:

* *no-bubble limit* = 2 × single-thread throughput (whole model on one process, same micro-batches):
  two stages at single-thread speed and no idle time;
* *machine bound* = both stages computing at once without any communication, limited by the slower
  stage: what two busy processes on this machine can reach without a bubble.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (  # noqa: E402  (a sibling script)
    STAGES,
    WORKLOADS,
    Engine,
    SingleThread,
    StagesAtOnce,
    Variant,
    Workload,
    gather_windows,
    run_job,
    sgd,
    stage_layers,
    timed_windows,
)

from lightning_pipe.engine import Executor, RunOptions, SequentialStage, Transport, Watchdog, split_micro_batches  # noqa: E402
from lightning_pipe.engine.policies.options import AsyncOptions, DoubleBufferOptions  # noqa: E402
from lightning_pipe.engine.shm import SharedMemoryTransport  # noqa: E402
from lightning_pipe.registry import SCHEDULES, names  # noqa: E402
from lightning_pipe.schedules import async_schedule  # noqa: E402

ASYNC_SCHEDULES = names("asynchronous")


class AsyncEngine(Variant):
    """One window of an asynchronous schedule per step (the stream never drains while timed)."""

    def __init__(self, schedule: str, workload: Workload, micro_batches: int, rank: int, group: Any,
                 moves: str = "auto", lookahead: float | None = None, shared_memory: bool = True,
                 lag_every: int | None = None, cosine_every: int | None = None) -> None:
        suffix = {"auto": "", "copy": " (copy loads)", "redirect": " (redirected backwards)"}[moves]
        self.name = f"ours {schedule}{suffix}" + ("" if shared_memory else " (gloo)")
        if lag_every is not None:
            self.name += f" (weight_lag every {lag_every})"
        self.lag_every = lag_every
        if cosine_every is not None:
            self.name += f" (grad_cosine every {cosine_every})"
        self.cosine_every = cosine_every
        if lookahead is not None:
            self.name += f" (lookahead {lookahead:g})"
        self.schedule = schedule
        self.samples_per_step = workload.batch
        self.micro_batches = micro_batches
        layers = stage_layers(workload, rank)
        policy_class = SCHEDULES[schedule].policy
        if moves != "auto":  # a live policy copying its loads (as before exchanges), or redirecting (as on torch 2.11)
            policy_class = type(f"{moves.title()}{policy_class.__name__}", (policy_class,), {"moves_values": moves})
        options = AsyncOptions() if lookahead is None else AsyncOptions(pipedream_2bw=DoubleBufferOptions(lookahead))
        policy = policy_class(layers, sgd(layers.parameters()), rank, STAGES, micro_batches, options)
        loss = workload.loss
        stage = SequentialStage(
            layers,
            input_fn=(lambda mb: mb[0]) if rank == 0 else None,
            loss_fn=(lambda output, mb: loss(output, mb[1])) if rank == STAGES - 1 else None,
        )
        cpu = torch.device("cpu")  # shared memory: PipeStrategy's default on one CPU host
        transport = SharedMemoryTransport.create(cpu) if shared_memory else Transport(cpu, group=group)
        self.executor = Executor(rank, list(range(STAGES)), [stage], transport, Watchdog(timeout=300.0), policy=policy)
        self.policy = policy
        self.batch = workload.make_batch(workload.batch)
        self.window = 0

    def step(self) -> Tensor | None:
        parts = split_micro_batches(self.batch, self.micro_batches)
        schedule = async_schedule(self.schedule, STAGES, self.micro_batches, self.window)
        logged = self.lag_every is not None and self.window % self.lag_every == 0
        if self.lag_every is not None:  # what PipeStrategy does on the steps Lightning logs (stage_metrics)
            self.policy.track_lag(logged)
        measured = self.cosine_every is not None and self.window % self.cosine_every == 0
        if self.cosine_every is not None:  # what PipeStrategy(grad_cosine_every=K) does on every K-th step
            self.policy.request_cosine(measured)
        window = RunOptions(first_micro_batch=self.window * self.micro_batches, carry_over=True)
        losses = self.executor.run(schedule, parts, window)
        if logged or measured:  # and the read-back when the metrics are logged (here: every measured step, the worst case)
            self.policy.diagnostics()
        self.window += 1
        return torch.stack(losses).mean() if losses else None


def worker(rank: int, workload_name: str, micro_batches: int, args: dict[str, Any]) -> dict[str, Any]:
    workload = WORKLOADS[workload_name]
    variants: list[Variant] = [
        SingleThread(workload, micro_batches, rank),
        StagesAtOnce(workload, micro_batches, rank),
        Engine("gpipe", workload, micro_batches, rank, dist.new_group(backend="gloo")),
    ]
    for schedule in args["schedules"]:
        variants.append(AsyncEngine(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo")))
    for schedule in args["schedules"] if args["gloo"] else []:
        variants.append(AsyncEngine(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo"), shared_memory=False))
    for moves in ("copy", "redirect"):
        for schedule in args[f"{moves}_loads"]:
            variants.append(AsyncEngine(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo"), moves))
    for schedule in args["schedules"] if args["weight_lag"] else []:
        variants.append(AsyncEngine(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo"),
                                    lag_every=args["weight_lag"]))
    for schedule in args["schedules"] if args["grad_cosine"] else []:
        variants.append(AsyncEngine(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo"),
                                    cosine_every=args["grad_cosine"]))
    for lookahead in args["lookahead"]:
        variants.append(AsyncEngine("pipedream_2bw", workload, micro_batches, rank, dist.new_group(backend="gloo"),
                                    lookahead=lookahead))
    clocks = timed_windows(variants, args["windows"], args["steps_per_window"], args["warmup_steps"], dist.barrier, {})
    return {"workload": workload_name, "micro_batches": micro_batches, "windows": gather_windows(clocks)}


def report(jobs: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | M | variant | samples/s median (min-max) | vs gpipe | vs no-bubble limit | vs machine bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for job in jobs:
        windows = job["windows"]
        rate = {name: [w["samples"] / w["seconds"] for w in ws] for name, ws in windows.items()}
        limit = [2 * x for x in rate["single thread"]]
        machine = [w["samples"] / max(r["compute_seconds"] for r in w["ranks"]) for w in windows["stages at once, no communication"]]
        for name in ["ours gpipe", *(n for n in windows if n.startswith("ours ") and n != "ours gpipe")]:
            values = rate[name]

            def ratio(reference: list[float]) -> str:
                return f"{statistics.median(a / b for a, b in zip(values, reference)):.2f}"

            lines.append(
                f"| {job['workload']} | {job['micro_batches']} | {name} | {statistics.median(values):.0f} "
                f"({min(values):.0f}-{max(values):.0f}) | {ratio(rate['ours gpipe'])} | {ratio(limit)} | {ratio(machine)} |"
            )
        lines.append(
            f"| {job['workload']} | {job['micro_batches']} | no-bubble limit (2 × single thread) | "
            f"{statistics.median(limit):.0f} | | 1.00 | |"
        )
        lines.append(
            f"| {job['workload']} | {job['micro_batches']} | machine bound (stages at once) | {statistics.median(machine):.0f} | | | 1.00 |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2"], choices=sorted(WORKLOADS))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4])
    parser.add_argument("--schedules", nargs="+", default=list(ASYNC_SCHEDULES), choices=ASYNC_SCHEDULES)
    parser.add_argument("--copy-loads", nargs="*", default=[], choices=("pipemare", "xpipe"),
                        help="also time these live policies with copied instead of exchanged loads")
    parser.add_argument("--redirect-loads", nargs="*", default=[], choices=("pipemare", "xpipe"),
                        help="also time these live policies redirecting their backwards through saved-tensor hooks "
                             "instead of exchanging storages (what they do on a torch without the exchange, such as 2.11)")
    parser.add_argument("--lookahead", type=float, nargs="*", default=[],
                        help="also time pipedream_2bw with these look-ahead values (its `lookahead` option)")
    parser.add_argument("--gloo", action="store_true",
                        help="also time each schedule over gloo ('ours' uses shared memory, PipeStrategy's default on one CPU host)")
    parser.add_argument("--weight-lag", type=int, default=None, metavar="N",
                        help="also time each schedule measuring weight_lag every N-th step (1: every step, the worst case; "
                             "PipeStrategy measures it on the steps Lightning logs, every 50 by default)")
    parser.add_argument("--grad-cosine", type=int, default=None, metavar="K",
                        help="also time each schedule measuring grad_cosine every K-th step (PipeStrategy(grad_cosine_every=K); "
                             "1: every step, the worst case)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant")
    parser.add_argument("--steps-per-window", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per job before its processes are killed")
    args = parser.parse_args()
    options = {k: getattr(args, k) for k in ("schedules", "copy_loads", "redirect_loads", "lookahead", "windows",
                                             "steps_per_window", "warmup_steps", "gloo", "weight_lag", "grad_cosine")}
    jobs = []
    for workload in args.workloads:
        for m in args.micro_batches:
            print(f"running {workload}, M={m} ...", file=sys.stderr, flush=True)
            job = run_job(worker, workload, m, options, timeout=args.timeout)
            jobs.append({**job, "schedules": args.schedules})
    print(report(jobs))


if __name__ == "__main__":
    main()
