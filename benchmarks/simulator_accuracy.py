"""Simulated vs measured time per training step, 2 stages, every schedule the engine runs.

    python benchmarks/simulator_accuracy.py --workloads W1 W2 --micro-batches 4

Workloads, processes (2 × 1 thread, gloo) and window timing are those of ``benchmarks/throughput.py``,
whose building blocks this script reuses. One pair of processes per (workload, M) runs
``--windows`` rounds; each round

1. **measures the costs, apart from the runs they predict.** For every schedule, each rank runs its
   own stage's compute actions of that schedule (forwards, backwards, STEPs, in list order, with
   the schedule's weight policy) on fixed inputs, without communication and without the other
   stage: the median forward (the last stage's includes the loss), backward and STEP time over
   ``--cost-windows`` steps after one of warm-up. Twice: *alone* (the other rank waits at a
   barrier) and *together* (both ranks run their stage at the same moment, as they compute in a
   pipeline on a 2-core machine). The transfer time is half the median round trip of the boundary
   activation out (header and payload, the executor's ``Transport``) and its gradient back.
   A third set, *in the pipeline*, comes from one untimed step of the schedule run right before its
   timed window with the executor's ``ActionRecorder`` on (``lightning_pipe.sim.simulate.measured_costs``:
   the median recorded forward, backward and STEP of each stage, with the time to post the message
   each sends, and the median delay of the messages a receive was already waiting for);
2. **times one window of every schedule** (rotating order): ``Executor`` with ``build_schedule``
   for gpipe and 1f1b (optimizer step at the STEP action), and one window of ``async_schedule`` per
   step for pipedream, pipedream_2bw, pipemare and xpipe with their weight policies (the stream
   never drains while timed);
3. **simulates** every schedule with that round's costs: ``simulate(build_schedule(...))`` (the
   makespan) for the flushing schedules, ``simulate_async(...)`` (steady-state time per window) for
   the others.

The zero-bubble schedules (zb_h1, and zbv with two chunks per process, cut as ``Workload.v_split``) are
predicted from the *in the pipeline* costs only: their ``I`` and ``W`` halves and zbv's four virtual
stages are what the recorder sees (``measured_costs`` reads ``W``'s share of each backward); the solo
runs above know only whole backwards of the two-stage cut.

Ratios are medians over rounds of simulated / measured within a round, so a slow phase of a shared
machine affects both sides alike.
The ratio simulated / measured is printed for both cost sets (goal: 0.85-1.15). The simulator
knows nothing of the executor's Python overhead between actions or of the CPU time transfers take
on both ends (gloo copies messages in its own threads, on the same 2 cores), so those show up as
ratios below 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_throughput import AsyncEngine  # noqa: E402  (sibling scripts)
from throughput import (  # noqa: E402
    STAGES,
    WORKLOADS,
    Engine,
    Variant,
    WindowClock,
    Workload,
    gather_windows,
    run_job,
    sgd,
    stage_layers,
    wait_until_quiet,
)

from lightning_pipe.engine import ActionRecorder, Transport, split_micro_batches  # noqa: E402
from lightning_pipe.engine.p2p import ACTIVATION_TAG, GRADIENT_TAG, Header  # noqa: E402
from lightning_pipe.registry import SCHEDULES, build_schedule, names  # noqa: E402
from lightning_pipe.schedules import Kind, async_schedule  # noqa: E402

ASYNC_SCHEDULES = names("asynchronous")
from lightning_pipe.sim.simulate import Costs, measured_costs, simulate, simulate_async  # noqa: E402

SYNC = ("gpipe", "1f1b")
SPLIT = ("zb_h1", "zbv", "dualpipev")  # zero-bubble: predicted from the costs recorded in the pipeline only


# ---------------------------------------------------------------------------------------- costs
def _stage_work(workload: Workload, micro_batches: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per micro-batch: (input of this stage, output gradient or target)."""
    parts = split_micro_batches(workload.make_batch(workload.batch), micro_batches)
    with torch.no_grad():
        boundary = [workload.model()[: workload.split](x) for x, _ in parts]
    g = torch.Generator().manual_seed(7)
    if rank == 0:
        return [(x, torch.randn(b.shape, generator=g)) for (x, _), b in zip(parts, boundary)]
    return [(b, y) for b, (_, y) in zip(boundary, parts)]


def solo_costs(workload: Workload, micro_batches: int, rank: int, schedule: str, windows: int) -> dict[str, float]:
    """Run this rank's own compute actions of ``schedule`` (and its weight policy) with fixed inputs and
    no communication; return the median forward, backward and STEP seconds (the first window or
    step is warm-up and not counted)."""
    layers = stage_layers(workload, rank)
    optimizer = sgd(layers.parameters())
    policy = SCHEDULES[schedule].policy(layers, optimizer, rank, STAGES, micro_batches) if schedule in ASYNC_SCHEDULES else None
    work = _stage_work(workload, micro_batches, rank)
    if policy is None:
        lists = [build_schedule(schedule, STAGES, micro_batches).compute_actions(rank)] * (1 + windows)
    else:
        lists = [async_schedule(schedule, STAGES, micro_batches, t).compute_actions(rank) for t in range(1 + windows)]
    clock = time.perf_counter
    times: dict[Kind, list[float]] = {Kind.FORWARD: [], Kind.BACKWARD: [], Kind.STEP: []}
    outputs: dict[int, torch.Tensor] = {}
    for window, actions in enumerate(lists):
        for action in actions:
            mb = action.micro_batch
            start = clock()
            if action.kind is Kind.FORWARD:
                inputs, other = work[mb % micro_batches]
                with policy.forward(mb) if policy else nullcontext():
                    if rank == 0:
                        outputs[mb] = layers(inputs)
                    else:
                        received = inputs.detach().requires_grad_()  # the executor's receives track gradients
                        outputs[mb] = workload.loss(layers(received), other) / micro_batches
            elif action.kind is Kind.BACKWARD:
                output = outputs.pop(mb)
                with policy.backward(mb) if policy else nullcontext():
                    if rank == 0:
                        output.backward(work[mb % micro_batches][1])
                    else:
                        output.backward()
                if policy:
                    policy.finished(mb)
            elif policy is not None:
                policy.step()
            else:
                optimizer.step()
                optimizer.zero_grad()
            if window > 0:
                times[action.kind].append(clock() - start)
    return {"forward": statistics.median(times[Kind.FORWARD]), "backward": statistics.median(times[Kind.BACKWARD]),
            "step": statistics.median(times[Kind.STEP])}


def time_transfer(workload: Workload, micro_batches: int, rank: int, group: Any, reps: int) -> float:
    """Half the median round trip: boundary activation 0 -> 1 (header + payload), its gradient 1 -> 0."""
    transport = Transport(torch.device("cpu"), group=group)
    activation = _stage_work(workload, micro_batches, 1)[0][0]
    trips = []
    for rep in range(3 + reps):
        dist.barrier(group=group)
        start = time.perf_counter()
        if rank == 0:
            for work, _ in transport.send_activation(activation.requires_grad_(), 1):
                work.wait()
            meta = Header.of(activation).metas
            for work, _ in transport.post_payload(meta, 1, GRADIENT_TAG):
                work.wait()
        else:
            header_work, header = transport.post_header(0)
            header_work.wait()
            received = transport.post_payload(Header.decode(header).metas, 0, ACTIVATION_TAG)
            for work, _ in received:
                work.wait()
            for work, _ in transport.send_gradients([received[0][1]], 0):
                work.wait()
        if rep >= 3:
            trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def measure_costs(workload: Workload, micro_batches: int, rank: int, group: Any, windows: int) -> dict[str, Any]:
    """Per schedule, this rank's stage costs alone and together; the transfer time (every rank calls this)."""
    costs: dict[str, Any] = {"transfer": time_transfer(workload, micro_batches, rank, group, reps=10)}
    for schedule in (*SYNC, *ASYNC_SCHEDULES):
        alone: dict[str, float] = {}
        for turn in range(STAGES):  # one stage at a time: the other rank waits at the barrier
            dist.barrier()
            if turn == rank:
                alone = solo_costs(workload, micro_batches, rank, schedule, windows)
        dist.barrier()
        together = solo_costs(workload, micro_batches, rank, schedule, windows)
        costs[schedule] = {"alone": alone, "together": together}
    dist.barrier()
    return costs


def recorded_costs(variant: Variant, rank: int) -> dict[str, float]:
    """One untimed step of ``variant`` with the executor's recorder on (every rank calls this); the
    costs it shows (:func:`lightning_pipe.sim.simulate.measured_costs`): this rank's forward, backward and
    STEP, and the boundary's transfer time. ``time.time()`` is one clock for both processes here."""
    variant.executor.recorder = recorder = ActionRecorder(rank)
    recorder.enabled = True
    variant.step()
    variant.executor.recorder = None
    everyone: list[Any] = [None] * STAGES
    dist.all_gather_object(everyone, recorder.events)
    name = variant.name.split()[1]  # "ours <schedule>"
    row = SCHEDULES[name]
    costs = measured_costs([e for events in everyone for e in events], STAGES, row.default_chunks, placement=row.placement)
    whole = {"forward": list(costs.forward), "backward": list(costs.backward), "transfer": list(costs.transfer),
             "step": costs.step, "weight_share": list(costs.weight_share)}
    return {"forward": costs.forward[rank], "backward": costs.backward[rank], "step": costs.step,
            "transfer": costs.link(0), "all": whole}


def worker(rank: int, workload_name: str, micro_batches: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rounds of: measure the costs, then one timed window of every schedule (rotating order), so
    that each prediction is compared with runs made under the same machine conditions."""
    workload = WORKLOADS[workload_name]
    torch.manual_seed(0)
    group = dist.new_group(backend="gloo")
    variants: list[Variant] = [Engine(s, workload, micro_batches, rank, dist.new_group(backend="gloo")) for s in (*SYNC, *SPLIT)]
    for schedule in ASYNC_SCHEDULES:
        variants.append(AsyncEngine(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo")))
    for variant in variants:
        for _ in range(args["warmup_steps"]):
            variant.step()
    clocks = {v.name: WindowClock() for v in variants}
    costs = []
    for window in range(args["windows"]):
        costs.append(measure_costs(workload, micro_batches, rank, group, args["cost_windows"]))
        shift = window % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            gc.collect()
            dist.barrier()
            costs[-1].setdefault(variant.name.split()[1], {})["pipeline"] = recorded_costs(variant, rank)  # "ours <schedule>"
            dist.barrier()
            clocks[variant.name].start()
            for _ in range(args["steps_per_window"]):
                variant.step()
            dist.barrier()
            clocks[variant.name].stop(samples=args["steps_per_window"] * workload.batch)
    traces: dict[str, list[dict[str, Any]]] = {}
    if args["trace"]:  # one more step of every schedule with the executor's recorder on
        for variant in variants:
            variant.executor.recorder = recorder = ActionRecorder(rank)
            recorder.enabled = True
            dist.barrier()
            variant.step()
            recorder.enabled = False
            variant.executor.recorder = None
            traces[variant.name] = recorder.rows()
    per_rank: list[Any] = [None] * STAGES
    dist.all_gather_object(per_rank, (costs, traces))
    rounds = [list(r) for r in zip(*(c for c, _ in per_rank))]  # rounds[w][rank]
    traces = {name: [row for _, t in per_rank for row in t[name]] for name in traces}
    return {"workload": workload_name, "micro_batches": micro_batches, "costs": rounds, "windows": gather_windows(clocks),
            "traces": traces}


# ---------------------------------------------------------------------------------------- report
MODES = ("alone", "together", "pipeline")


def costs_of(ranks: list[dict[str, Any]], schedule: str, mode: str) -> Costs:
    """Costs of one round from every rank's measurements (``mode``: one of :data:`MODES`)."""
    if mode == "pipeline":  # every virtual stage, as the recorder saw them (all ranks hold the same)
        return Costs(**ranks[0][schedule]["pipeline"]["all"])
    return Costs(
        forward=[r[schedule][mode]["forward"] for r in ranks],
        backward=[r[schedule][mode]["backward"] for r in ranks],
        transfer=[ranks[0][schedule][mode]["transfer"] if mode == "pipeline" else ranks[0]["transfer"]],
        step=max(r[schedule][mode]["step"] for r in ranks),  # one STEP cost for every device: the slower one
    )


def predicted(schedule: str, m: int, costs: Costs) -> float:
    if schedule in ASYNC_SCHEDULES:
        return simulate_async(schedule, STAGES, m, costs, windows=8).step_time
    return simulate(build_schedule(schedule, STAGES, m, SCHEDULES[schedule].default_chunks), costs).step_time


def modes_of(schedule: str) -> tuple[str, ...]:
    return ("pipeline",) if schedule in SPLIT else MODES


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.2f}"


def quiet_rounds(job: dict[str, Any], max_load: float) -> list[int]:
    """Rounds in which other processes used at most ``max_load`` cores during every schedule's window."""
    windows = job["windows"]
    return [w for w in range(len(job["costs"])) if all(v[w]["other_load"] <= max_load for v in windows.values())]


def report(jobs: list[dict[str, Any]], max_load: float = 0.25, min_rounds: int = 2) -> str:
    selected, notes = [], []
    for job in jobs:
        keep = quiet_rounds(job, max_load)
        note = f"{job['workload']} M={job['micro_batches']}: {len(keep)}/{len(job['costs'])}"
        if len(keep) < min_rounds:
            keep, note = list(range(len(job["costs"]))), note + " (too few quiet, all kept)"
        notes.append(note)
        selected.append({**job, "costs": [job["costs"][w] for w in keep],
                         "windows": {name: [v[w] for w in keep] for name, v in job["windows"].items()}})
    lines = []
    lines.append("| workload | M | schedule | costs | forward ms, stage 0/1 | backward ms | STEP ms | transfer ms |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for job in selected:
        wl, m, rounds = job["workload"], job["micro_batches"], job["costs"]
        for schedule in (*SYNC, *SPLIT, *ASYNC_SCHEDULES):
            for mode in modes_of(schedule):
                if schedule in SPLIT:  # per virtual stage
                    whole = [r[0][schedule][mode]["all"] for r in rounds]
                    cells = ["/".join(_ms([w[key][vs] for w in whole]) for vs in range(len(whole[0]["forward"])))
                             for key in ("forward", "backward")] + [_ms([w["step"] for w in whole])]
                    lines.append(f"| {wl} | {m} | {schedule} | {mode} | {' | '.join(cells)} | "
                                 f"{'/'.join(_ms([w['transfer'][b] for w in whole]) for b in range(len(whole[0]['transfer'])))} |")
                    continue
                cells = [
                    "/".join(_ms([r[s][schedule][mode][key] for r in rounds]) for s in range(STAGES))
                    for key in ("forward", "backward", "step")
                ]
                lines.append(f"| {wl} | {m} | {schedule} | {mode} | {' | '.join(cells)} | {_ms([r[0]['transfer'] for r in rounds])} |")
    lines += [
        "",
        "| workload | M | schedule | measured ms/step, median (min-max) | simulated, costs alone | ratio | "
        "simulated, costs together | ratio | simulated, costs in the pipeline | ratio | other load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for job in selected:
        wl, m, rounds = job["workload"], job["micro_batches"], job["costs"]
        for schedule in (*SYNC, *SPLIT, *ASYNC_SCHEDULES):
            windows = job["windows"][f"ours {schedule}"]
            measured = [w["seconds"] / (w["samples"] / WORKLOADS[wl].batch) for w in windows]
            cells = []
            for mode in MODES:
                if mode not in modes_of(schedule):
                    cells.append("n/a | n/a")
                    continue
                sims = [predicted(schedule, m, costs_of(r, schedule, mode)) for r in rounds]
                ratio = statistics.median(p / x for p, x in zip(sims, measured))  # same round: same conditions
                cells.append(f"{_ms(sims)} | {ratio:.2f}")
            load = statistics.median(w["other_load"] for w in windows)
            lines.append(
                f"| {wl} | {m} | {schedule} | {_ms(measured)} ({min(measured) * 1e3:.1f}-{max(measured) * 1e3:.1f}) | "
                f"{' | '.join(cells)} | {load:.2f} |"
            )
    lines.append(
        "\nCosts rows: zero-bubble schedules per virtual stage (zbv: 0-3, device 0 holds 0 and 3), backward = I + W. "
        "Simulated columns: median over rounds of the prediction from that round's costs; ratio: median over rounds of "
        "simulated / measured in the same round. other load: cores used by other processes during the schedule's windows "
        f"(median). Rounds kept (every schedule's window with other load <= {max_load} cores): {', '.join(notes)}."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2"], choices=sorted(WORKLOADS))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4])
    parser.add_argument("--windows", type=int, default=5, help="rounds: cost measurement, then one timed window per schedule")
    parser.add_argument("--steps-per-window", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--cost-windows", type=int, default=1,
                        help="windows (steps) of every stage's solo run per round and schedule, after one of warm-up")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job before its processes are killed")
    parser.add_argument("--json", type=Path, default=None, help="also write every round's raw numbers here")
    parser.add_argument("--from-json", type=Path, default=None, help="do not run: report a --json file again")
    parser.add_argument("--trace", type=Path, default=None,
                        help="also record one step of every schedule and write measured and simulated timelines here")
    parser.add_argument("--max-other-load", type=float, default=0.25,
                        help="leave out rounds in which other processes used more cores than this (all kept if < 2 remain)")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="before each job wait up to this many seconds for other processes to go idle")
    args = parser.parse_args()
    if args.from_json:  # report (and draw) a saved run again, e.g. with another --max-other-load
        jobs = json.loads(args.from_json.read_text())["jobs"]
        print(report(jobs, args.max_other_load))
        if args.trace:
            write_traces(jobs, args.trace)
        return
    options = {k: getattr(args, k) for k in ("windows", "steps_per_window", "warmup_steps", "cost_windows")}
    options["trace"] = args.trace is not None
    print(f"torch {torch.__version__}, {STAGES} processes × 1 thread, gloo", flush=True)
    jobs = []
    for workload in args.workloads:
        for m in args.micro_batches:
            load = wait_until_quiet(args.quiet_wait) if args.quiet_wait > 0 else float("nan")
            print(f"running {workload}, M={m} (other load before start: {load:.2f} cores) ...", file=sys.stderr, flush=True)
            start = time.monotonic()
            jobs.append(run_job(worker, workload, m, options, timeout=args.timeout))
            print(f"  {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "jobs": jobs}))
        print(f"raw rounds: {args.json}", file=sys.stderr)
    print(report(jobs, args.max_other_load))
    if args.trace:
        write_traces(jobs, args.trace)


def write_traces(jobs: list[dict[str, Any]], directory: Path) -> None:
    """A measured and a simulated timeline per (workload, M, schedule), for comparing them by eye."""
    from lightning_pipe.sim.plot import timeline_png
    from lightning_pipe.sim.tracing import events_from_rows

    print("\nOne recorded step per schedule (--trace), ms per stage 0/1: compute = forward + backward + STEP as "
          "recorded, simulated = the same from the last round's costs (together), waits = receives waiting, "
          "gaps = time between consecutive recorded actions of a stage (executor and Python overhead).\n")
    print("| workload | M | schedule | step (measured) | compute | compute simulated | waits | gaps |")
    print("|---|---|---|---|---|---|---|---|")
    for job in jobs:
        wl, m = job["workload"], job["micro_batches"]
        for schedule in (*SYNC, *SPLIT, *ASYNC_SCHEDULES):
            events, _ = events_from_rows(job["traces"][f"ours {schedule}"])
            stem = directory / f"{wl}-M{m}-{schedule}"
            timeline_png(events, f"{stem}-measured.png", title=f"{wl}, {schedule}, M={m}: one measured step", show_waits=True)
            costs = costs_of(job["costs"][-1], schedule, "pipeline" if schedule in SPLIT else "together")
            if schedule in ASYNC_SCHEDULES:
                sim = simulate_async(schedule, STAGES, m, costs, windows=4)
            else:
                sim = simulate(build_schedule(schedule, STAGES, m, SCHEDULES[schedule].default_chunks), costs)
            timeline_png(sim.events, f"{stem}-simulated.png", title=f"{wl}, {schedule}, M={m}: simulated")
            begin, end = min(e.start for e in events), max(e.end for e in events)
            cells = {"compute": [], "simulated": [], "waits": [], "rest": []}
            for rank in range(STAGES):
                mine = [e for e in events if e.device == rank]
                compute = sum(e.duration for e in mine if e.action.kind.is_compute or e.action.kind is Kind.STEP)
                waits = sum(e.duration for e in mine if e.action.kind.is_recv)
                simulated = sum(
                    e.duration for e in sim.events
                    if e.device == rank and (e.action.kind.is_compute or e.action.kind is Kind.STEP)
                ) if schedule not in ASYNC_SCHEDULES else sim.busy[rank]
                cells["compute"].append(compute)
                cells["simulated"].append(simulated)
                cells["waits"].append(waits)
                mine.sort(key=lambda e: e.start)
                cells["rest"].append(sum(max(0.0, b.start - a.end) for a, b in zip(mine, mine[1:])))
            row = " | ".join("/".join(f"{x * 1e3:.1f}" for x in values) for values in cells.values())
            print(f"| {wl} | {m} | {schedule} | {(end - begin) * 1e3:.1f} | {row} |")
            print(f"wrote {stem}-measured.png, {stem}-simulated.png", file=sys.stderr)


if __name__ == "__main__":
    main()
