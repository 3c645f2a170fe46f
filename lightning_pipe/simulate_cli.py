"""``python -m lightning_pipe.simulate_cli``: simulate a schedule on uniform costs, print it, draw it.

    python -m lightning_pipe.simulate_cli --schedule 1f1b --stages 4 --micro_batches 8 --png 1f1b.png
"""

from __future__ import annotations

from lightning_pipe.plot import chrome_trace, timeline_png
from lightning_pipe.schedules import ASYNC_SCHEDULES, build_schedule
from lightning_pipe.simulate import Costs, Simulation, simulate, simulate_async


def main(
    schedule: str = "1f1b",
    stages: int = 4,
    micro_batches: int = 8,
    chunks: int = 1,
    forward: float = 1.0,
    backward: float = 2.0,
    transfer: float = 0.0,
    step: float = 0.0,
    windows: int = 4,
    png: str | None = None,
    trace: str | None = None,
) -> Simulation:
    """Simulate a schedule on uniform costs, print the result, optionally draw it.

    Args:
        schedule: any synchronous or asynchronous schedule name.
        stages: devices ``P``.
        micro_batches: micro-batches per step ``M``.
        chunks: chunks per device (``interleaved_1f1b``).
        forward: forward time of one micro-batch on one virtual stage (milliseconds).
        backward: backward time (milliseconds).
        transfer: one-way time of a boundary message (milliseconds).
        step: time of one optimizer STEP (milliseconds).
        windows: asynchronous schedules: windows simulated before the drain.
        png: write the timeline picture here.
        trace: write a Chrome-trace JSON here.
    """
    ms = 1e-3
    costs = Costs.uniform(stages * chunks, forward * ms, backward * ms, transfer * ms, step * ms)
    if schedule in ASYNC_SCHEDULES:
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


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
