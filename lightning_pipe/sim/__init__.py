"""Predict and picture schedules: the discrete-event simulator, timeline pictures, traces of real runs.

Reads the same action lists the executor runs; imports no Lightning.
"""

from lightning_pipe.sim.plot import chrome_trace, timeline_png
from lightning_pipe.sim.simulate import Costs, Simulation, measured_costs, simulate, simulate_async
from lightning_pipe.sim.tracing import RunTracer, read_trace

__all__ = ["Costs", "RunTracer", "Simulation", "chrome_trace", "measured_costs", "read_trace", "simulate", "simulate_async",
           "timeline_png"]
