"""lightning_pipe: pipeline-parallel training strategies for PyTorch Lightning.

Importing the package registers every schedule as a strategy name (``gpipe``, ``1f1b``,
``interleaved_1f1b``, ``pipedream``, ``pipedream_2bw``, ``pipemare``, ``xpipe``, ``avgpipe``), so
``Trainer(strategy="pipemare", devices=2)`` works after ``import lightning_pipe``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.config import PipeConfigError
from lightning_pipe.engine import PeerFailure, PipelineTimeout
from lightning_pipe.strategy import PipeStrategy

PipeStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["PeerFailure", "PipeConfigError", "PipeStrategy", "PipelineTimeout", "__version__"]
