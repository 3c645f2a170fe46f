"""lightning_pipe: pipeline-parallel training strategies for PyTorch Lightning.

Importing the package registers every schedule of :mod:`lightning_pipe.registry` as a strategy name
(``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb_h1``, ``zbv``, ``dualpipev``, ``pipedream``,
``pipedream_2bw``, ``pipemare``, ``xpipe``, ``avgpipe``), so ``Trainer(strategy="pipemare", devices=2)``
works after ``import lightning_pipe``.

The engine, schedules, planning and simulation (``lightning_pipe.engine``, ``.schedules``,
``.planning``, ``.sim``) import no Lightning; without Lightning installed they still work, and only
:class:`PipeStrategy` is missing.
"""

from importlib.util import find_spec

from lightning_pipe.engine.policies import AvgPipeOptions, DoubleBufferOptions, PipeDreamOptions, PipeMareOptions, XPipeOptions
from lightning_pipe.errors import (
    AsyncQualityWarning,
    BalanceError,
    CheckpointFileError,
    CheckpointMismatchError,
    LightningPipeError,
    MessageMismatchError,
    PeerFailure,
    PipeConfigError,
    PipelineTimeout,
    PlanError,
    ScheduleError,
    SharedParameterError,
    StageOutputError,
    StartupFailure,
    TrunkError,
    TrunkUsageError,
)
from lightning_pipe.planning.auto_balance import AutoBalanceOptions
from lightning_pipe.weights import load_stage_weights

__version__ = "0.2.0"

if find_spec("lightning") is not None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_pipe.lightning import PipeStrategy, consolidate_checkpoint

    PipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "AsyncQualityWarning", "AutoBalanceOptions", "AvgPipeOptions", "BalanceError", "CheckpointFileError",
    "CheckpointMismatchError", "DoubleBufferOptions",
    "LightningPipeError", "MessageMismatchError", "PeerFailure",
    "PipeConfigError", "PipeDreamOptions", "PipeMareOptions", "PipeStrategy", "PipelineTimeout", "PlanError", "ScheduleError",
    "SharedParameterError", "StageOutputError", "StartupFailure", "TrunkError", "TrunkUsageError", "XPipeOptions", "__version__",
    "consolidate_checkpoint", "load_stage_weights",
]
