"""The pipeline engine: runs schedules on ranks. Usable without Lightning."""

from lightning_pipe.engine.executor import Executor, StageOutputError
from lightning_pipe.engine.p2p import Transport
from lightning_pipe.engine.recorder import ActionRecorder
from lightning_pipe.engine.stage import SequentialStage, batch_size, run_layers, split_micro_batches
from lightning_pipe.engine.watchdog import PeerFailure, PipelineTimeout, Watchdog

__all__ = [
    "ActionRecorder", "Executor", "PeerFailure", "PipelineTimeout", "SequentialStage", "StageOutputError", "Transport",
    "Watchdog", "batch_size", "run_layers", "split_micro_batches",
]
