"""lightning_pipe: pipeline-parallel training strategies for PyTorch Lightning.

Importing the package registers every schedule of :mod:`lightning_pipe.registry` as a strategy name
(``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb_h1``, ``zbv``, ``dualpipev``, ``pipedream``,
``pipedream_2bw``, ``pipemare``, ``xpipe``, ``avgpipe``), so ``Trainer(strategy="pipemare", devices=2)``
works after ``import lightning_pipe``.

The engine, schedules, planning and simulation (``lightning_pipe.engine``, ``.schedules``,
``.planning``, ``.sim``) import no Lightning; without Lightning installed they still work, and only
:class:`PipeStrategy` is missing.
"""

import logging
from importlib.util import find_spec

from lightning_pipe.engine.policies import AvgPipeOptions, DoubleBufferOptions, PipeDreamOptions, PipeMareOptions, XPipeOptions
from lightning_pipe.errors import (
    AsyncQualityWarning,
    BalanceError,
    CheckpointFileError,
    CheckpointMismatchError,
    LightningPipeError,
    MessageMismatchError,
    MicroBatchNormWarning,
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

# Everything the package says goes through the standard logger "lightning_pipe" (one child per module), so it can be
# filtered, routed or silenced like any library's. As Lightning does for its own logger: INFO by default, and printed
# to stderr by a handler of its own only when the application has configured no logging at all.
_logger = logging.getLogger(__name__)
if _logger.level == logging.NOTSET:
    _logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers() and not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("lightning_pipe: %(message)s"))
    _logger.addHandler(_handler)
    _logger.propagate = False

if find_spec("lightning") is not None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_pipe.lightning import PipeStrategy, consolidate_checkpoint

    PipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "AsyncQualityWarning", "AutoBalanceOptions", "AvgPipeOptions", "BalanceError", "CheckpointFileError",
    "CheckpointMismatchError", "DoubleBufferOptions",
    "LightningPipeError", "MessageMismatchError", "MicroBatchNormWarning", "PeerFailure",
    "PipeConfigError", "PipeDreamOptions", "PipeMareOptions", "PipeStrategy", "PipelineTimeout", "PlanError", "ScheduleError",
    "SharedParameterError", "StageOutputError", "StartupFailure", "TrunkError", "TrunkUsageError", "XPipeOptions", "__version__",
    "consolidate_checkpoint", "load_stage_weights",
]
