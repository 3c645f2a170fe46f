"""Weight policies: which weights each forward and backward of a stage sees, and its STEP.

One class per rule (docs/algorithms.md §6-§10); :mod:`lightning_pipe.registry` says which schedule
uses which. Synchronous schedules need none: the executor runs them on the module's own weights.
"""

from lightning_pipe.engine.policies.averaging import ElasticAveraging
from lightning_pipe.engine.policies.base import Binding, Clip, WeightPolicy, make_clip, merge_states
from lightning_pipe.engine.policies.live import PipeMarePolicy, XPipePolicy
from lightning_pipe.engine.policies.options import (
    AsyncOptions,
    AvgPipeOptions,
    DoubleBufferOptions,
    PipeDreamOptions,
    PipeMareOptions,
    XPipeOptions,
)
from lightning_pipe.engine.policies.stash import DoubleBufferPolicy, StashPolicy

__all__ = [
    "AsyncOptions", "AvgPipeOptions", "Binding", "Clip", "DoubleBufferOptions", "DoubleBufferPolicy", "ElasticAveraging",
    "PipeDreamOptions", "PipeMareOptions", "PipeMarePolicy", "StashPolicy", "WeightPolicy", "XPipeOptions", "XPipePolicy",
    "make_clip", "merge_states",
]
