"""``lightning-pipe simulate``: simulate a schedule, print it, draw it.

    lightning-pipe simulate --schedule 1f1b --stages 4 --micro_batches 8 --png 1f1b.png
    lightning-pipe simulate --schedule pipemare --stages 2 --micro_batches 8 --costs_from trace/
"""

from __future__ import annotations

from lightning_pipe.errors import PipeConfigError
from lightning_pipe.registry import DEFAULT, build_schedule, spec
from lightning_pipe.sim import Costs, Simulation, chrome_trace, measured_costs, read_trace, simulate, simulate_async, timeline_png


def simulate_schedule(
    schedule: str = DEFAULT,
    stages: int = 4,
    micro_batches: int = 8,
    chunks: int | None = None,
    forward: float = 1.0,
    backward: float = 2.0,
    transfer: float = 0.0,
    step: float = 0.0,
    windows: int = 4,
    costs_from: str | None = None,
    png: str | None = None,
    trace: str | None = None,
) -> Simulation:
    """Simulate a schedule on uniform costs or on the costs of a measured run, print the result,
    optionally draw it.

    Args:
        schedule: any synchronous or asynchronous schedule name.
        stages: devices ``P``.
        micro_batches: micro-batches per step ``M``.
        chunks: chunks per device (``interleaved_1f1b``; default: the schedule's, 2 for ``interleaved_1f1b``,
            ``zbv`` and ``dualpipev``, else 1).
        forward: forward time of one micro-batch on one virtual stage (milliseconds).
        backward: backward time (milliseconds); zero-bubble schedules split it half and half into ``I``
            and ``W`` (a measured run's ``costs_from`` gives the real shares).
        transfer: one-way time of a boundary message (milliseconds).
        step: time of one optimizer STEP (milliseconds).
        windows: asynchronous schedules: windows simulated before the drain.
        costs_from: the ``trace_dir`` of a measured run (``PipeStrategy(trace_dir=...)``): every
            stage's forward, backward, transfer and STEP times come from its recorded actions
            (:func:`~lightning_pipe.sim.simulate.measured_costs`) instead of ``forward``, ``backward``,
            ``transfer`` and ``step``, so you can ask what another schedule or micro-batch count would
            do with the costs your run showed (same stages, chunks and micro-batch size).
        png: write the timeline picture here.
        trace: write a Chrome-trace JSON here.
    """
    ms = 1e-3
    row = spec(schedule)
    chunks = row.default_chunks if chunks is None else chunks
    for name, count in (("stages", stages), ("micro_batches", micro_batches), ("chunks", chunks)):
        if count < 1:
            raise PipeConfigError(f"--{name} {count} must be at least 1.")
    for name, milliseconds in (("forward", forward), ("backward", backward), ("transfer", transfer), ("step", step)):
        if milliseconds < 0:
            raise PipeConfigError(f"--{name} {milliseconds} must be at least 0 (milliseconds).")
    if row.family == "asynchronous" and windows < 4:
        raise PipeConfigError(f"--windows {windows}: the simulator needs at least 4 windows to reach a steady state.")
    row.check(stages, micro_batches)
    if costs_from is None:
        costs = Costs.uniform(stages * chunks, forward * ms, backward * ms, transfer * ms, step * ms)
    else:
        try:
            events, steps = read_trace(costs_from)
        except FileNotFoundError as error:
            raise SystemExit(str(error)) from None
        if len({e.device for e in events if e.device < stages}) < stages:
            raise SystemExit(f"{costs_from} records fewer than {stages} ranks; give --stages as the traced run had.")
        costs = measured_costs(events, stages, chunks, steps, row.placement)
        print(f"costs from {costs_from} (ms per micro-batch, per virtual stage): forward "
              f"{[round(f / ms, 3) for f in costs.forward]}, backward {[round(b / ms, 3) for b in costs.backward]}, "
              f"transfer {[round(t / ms, 3) for t in costs.transfer]}, step {costs.step / ms:.3f}")
    family = row.family
    if family == "averaging":
        raise SystemExit("avgpipe's round depends on its tuned values; simulate it with `lightning-pipe plan --schedules avgpipe`.")
    if family == "asynchronous":
        sim = simulate_async(schedule, stages, micro_batches, costs, windows)
        title = f"{schedule}: {stages} stages, M={micro_batches}, {windows} windows and the drain"
    else:
        sim = simulate(build_schedule(schedule, stages, micro_batches, chunks), costs)
        title = f"{schedule}: {stages} stages, M={micro_batches}" + (f", {chunks} chunks" if chunks > 1 else "")
    print(f"{title}\n{sim.describe()}")
    if png:
        timeline_png(sim.events, png, title=f"{title} (simulated)")
        print(f"wrote {png}")
    if trace:
        chrome_trace(sim.events, trace)
        print(f"wrote {trace}")
    return sim
