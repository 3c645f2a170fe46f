"""The Lightning side of lightning_pipe: the only package that imports Lightning.

:class:`PipeStrategy` maps Lightning's hooks onto the engine; the modules beside it each do one part
of that (options, checks, the cut pipeline, the runtimes, checkpoints, log replay, setup-time choices).
"""

from lightning_pipe.lightning.sharded import consolidate_checkpoint
from lightning_pipe.lightning.strategy import PipeStrategy

__all__ = ["PipeStrategy", "consolidate_checkpoint"]
