"""The pipeline engine: runs schedules on ranks. Imports no Lightning; tests and benchmarks drive it directly.

* :class:`Executor` runs one device's action list (:class:`RunOptions`: what a run needs beyond the
  schedule and its micro-batches); :class:`Transport` moves activations and
  gradients; :class:`Watchdog` turns a failed or hung peer into a clear error. Their interfaces are the
  ``typing.Protocol``s :class:`ScheduleRunner` and :class:`MessageTransport`.
* :class:`~lightning_pipe.engine.local.LocalPipeline` runs every device of a pipeline in one process.
* :mod:`.policies`: which weights each forward and backward sees (asynchronous schedules, avgpipe).
* :class:`AsyncSegments` and :class:`AvgPipeRounds` run those schedules across training steps;
  :mod:`.emulated` and :mod:`.emulated_avgpipe` run every stage of them in one process.
"""

from lightning_pipe.engine.async_segments import AsyncSegments
from lightning_pipe.engine.avgpipe_rounds import AvgPipeRounds, keeps_one_fifo_order
from lightning_pipe.engine.executor import Executor, RunOptions, ScheduleRunner
from lightning_pipe.engine.p2p import MessageTransport, Transport
from lightning_pipe.engine.recorder import ActionRecorder
from lightning_pipe.engine.stage import SequentialStage, batch_size, run_layers, split_micro_batches
from lightning_pipe.engine.topology import Topology
from lightning_pipe.engine.watchdog import Watchdog
from lightning_pipe.errors import PeerFailure, PipelineTimeout, StageOutputError

__all__ = [
    "ActionRecorder", "AsyncSegments", "AvgPipeRounds", "Executor", "MessageTransport", "PeerFailure", "PipelineTimeout", "RunOptions",
    "ScheduleRunner", "SequentialStage", "StageOutputError", "Topology", "Transport", "Watchdog", "batch_size",
    "keeps_one_fifo_order", "run_layers", "split_micro_batches",
]
