"""lightning_pipe: pipeline-parallel training strategies for PyTorch Lightning.

Importing the package registers the strategy names ``gpipe``, ``1f1b`` and ``interleaved_1f1b``,
so ``Trainer(strategy="1f1b", devices=2)`` works after ``import lightning_pipe``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.config import PipeConfigError
from lightning_pipe.engine import PeerFailure, PipelineTimeout
from lightning_pipe.strategy import PipeStrategy

PipeStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = ["PeerFailure", "PipeConfigError", "PipeStrategy", "PipelineTimeout", "__version__"]
