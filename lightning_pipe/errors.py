"""Every error lightning_pipe raises on purpose, under one base class.

``except LightningPipeError`` catches them all. Each also derives from the built-in exception a
caller would expect (``ValueError`` for a bad option, ``TimeoutError`` for a hung peer, ...), so
code written against those keeps working. Messages are one sentence that says what to change.
"""

from __future__ import annotations


class LightningPipeError(Exception):
    """Base of every error lightning_pipe raises on purpose."""


# ---------------------------------------------------------------------------- configuration
class PipeConfigError(LightningPipeError, ValueError):
    """An option does not fit the Trainer, the module or the data; raised before training starts."""


class TrunkError(PipeConfigError):
    """The module has no usable trunk, or several candidates and no ``module=`` to choose."""


class BalanceError(PipeConfigError):
    """The requested split does not fit the trunk."""


class PlanError(PipeConfigError):
    """No split, schedule and micro-batch count satisfies the limits (``balance="auto"``, the planner)."""


class SharedParameterError(PipeConfigError):
    """A parameter outside the trunk is used by several stages of a schedule that steps them apart, or trunk layers
    that share a parameter are split onto different stages."""


# ---------------------------------------------------------------------------- schedules and stages
class ScheduleError(LightningPipeError, ValueError):
    """A schedule's action lists break one of the IR's rules (the validator's dry run found it)."""


class StageOutputError(LightningPipeError, TypeError):
    """A stage returned something that cannot cross a pipeline boundary."""


class TrunkUsageError(LightningPipeError, RuntimeError):
    """The partitioned trunk was called outside a pipelined step, or the step uses it in a way stages cannot split
    (a second loop, one block or a partial slice, a residual around the blocks)."""


class MessageMismatchError(LightningPipeError, RuntimeError):
    """What arrived from a neighbouring stage is not what this stage's schedule expects (its size, or the
    micro-batch it belongs to): the ranks disagree on the micro-batches or on the schedule."""


class CheckpointMismatchError(LightningPipeError, KeyError):
    """A checkpoint does not belong to this model."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class CheckpointFileError(LightningPipeError, OSError):
    """A checkpoint file cannot be read (truncated, corrupted, or not a checkpoint); the message names
    the file and the cause."""

    def __str__(self) -> str:  # OSError would prefix an errno
        return str(self.args[0])


# ---------------------------------------------------------------------------- failures at run time
class PeerFailure(LightningPipeError, RuntimeError):
    """Another rank of the job raised; its rank and error message are included."""


class PipelineTimeout(LightningPipeError, TimeoutError):
    """A peer neither answered nor failed within the configured timeout."""


class StartupFailure(LightningPipeError, RuntimeError):
    """The ranks could not meet: the job's key-value store could not be opened or reached, or a rank
    did not arrive within ``startup_timeout``; the message names what was awaited and where."""


# ---------------------------------------------------------------------------- warnings
class AsyncQualityWarning(UserWarning):
    """A schedule with stale gradients runs with an optimizer that loses quality under them (Adam and
    its kin): the measured cost and the recipe that keeps quality (lightning_pipe.quality). Silence it
    with ``PipeStrategy(quality_warning=False)`` or ``warnings.filterwarnings("ignore", category=AsyncQualityWarning)``."""


class MicroBatchNormWarning(UserWarning):
    """The module has BatchNorm layers, which normalise each micro-batch on its own: the pipeline then trains as one
    device with ``accumulate_grad_batches=micro_batches`` on micro-batch-sized batches, not as one device on the whole
    batch. Silence it with ``warnings.filterwarnings("ignore", category=MicroBatchNormWarning)``."""


__all__ = [
    "AsyncQualityWarning", "BalanceError", "CheckpointFileError", "CheckpointMismatchError", "LightningPipeError",
    "MessageMismatchError", "MicroBatchNormWarning", "PeerFailure", "PipeConfigError", "PipelineTimeout", "PlanError", "ScheduleError",
    "SharedParameterError", "StageOutputError", "StartupFailure", "TrunkError", "TrunkUsageError",
]
