"""Calls to the loggers made in a step, made again on global rank 0.

Only the last stage runs a step's code after the trunk, and Lightning's loggers write on global rank 0
alone (elsewhere their methods do nothing), so ``self.logger.experiment.add_image(...)`` in a validation
step was silently lost wherever rank 0 is not the last stage. During the micro-batch steps
``trainer.loggers`` are stand-ins that record each call: which logger, the attributes from it to the
method (``experiment.add_image``), the arguments with tensors detached onto the CPU. The last stage's
calls travel with the step's logged values (:mod:`.log_replay`), and global rank 0 makes them on its
real loggers.

A step runs once per micro-batch, so a call made in every micro-batch (``if batch_idx == 0:
add_image(x[0])``) would be made once per micro-batch. The calls of the first micro-batch that made any
are made, which is what one device does in the common cases (the batch's first sample, its first
misclassified example); a warning says when later micro-batches' calls were dropped (docs/faq.md).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_pipe.errors import PipeConfigError

_PLAIN = (str, bytes, int, float, bool, type(None), os.PathLike, tuple, list, dict)
_WARNED: set[str] = set()  # the calls whose later micro-batches' repeats were already reported


@dataclass
class LoggerCall:
    """One call to a logger, or to an object reached from it, as plain data (picklable, on the CPU)."""

    logger: int  #: its index in ``trainer.loggers``
    path: tuple[str, ...]  #: the attributes from the logger to what was called (``("experiment", "add_image")``)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    micro_batch: int  #: the position of the micro-batch, in the order this stage ran them, that made it

    def make(self, loggers: Sequence[Any]) -> None:
        """Make this call on the real ``loggers``."""
        target = loggers[self.logger]
        for name in self.path:
            target = getattr(target, name)
        target(*self.args, **self.kwargs)

    def describe(self) -> str:
        return f"self.loggers[{self.logger}].{'.'.join(self.path)}(...)"


class _Recording:
    """Stands in for a logger, or an object reached from it (its ``experiment``), during a step: a call is
    recorded, not made; an attribute that is plain data (``log_dir``, ``version``) is read from the real one;
    ``isinstance`` sees the real class (``isinstance(self.logger, WandbLogger)``)."""

    def __init__(self, target: Any, recorder: LoggerCalls, logger: int, path: tuple[str, ...]) -> None:
        self._target, self._recorder = target, recorder
        self._where = (logger, path)  # the logger's index and the attributes from it to the target

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance() falls back on it
        return type(self._target)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if isinstance(value, _PLAIN) and not callable(value):
            return value
        logger, path = self._where
        return _Recording(value, self._recorder, logger, (*path, name))

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        logger, path = self._where
        self._recorder.record(logger, path, args, kwargs)

    def __setitem__(self, key: Any, value: Any) -> None:  # a run's summary: experiment.summary["best"] = x
        logger, path = self._where
        self._recorder.record(logger, (*path, "__setitem__"), (key, value), {})


class LoggerCalls:
    """Context manager: within it, ``trainer.loggers`` record the calls made to them (:class:`LoggerCall`).

    Call :meth:`begin_micro_batch` before each micro-batch's step.
    """

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self.calls: list[LoggerCall] = []
        self._micro_batches: dict[int, int] = {}  # id of a micro-batch -> its position
        self._current = 0
        self._trainer: Any = None
        self._loggers: list[Any] = []

    def begin_micro_batch(self, micro_batch: Any) -> None:
        self._current = self._micro_batches.setdefault(id(micro_batch), len(self._micro_batches))

    def __enter__(self) -> LoggerCalls:
        self.calls, self._micro_batches, self._current = [], {}, 0
        try:
            self._trainer = self.module.trainer
        except RuntimeError:  # not attached to a Trainer: no loggers to stand in for
            self._trainer = None
            return self
        self._loggers = list(self._trainer.loggers)
        self._trainer.loggers = [_Recording(logger, self, i, ()) for i, logger in enumerate(self._loggers)]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._trainer is not None:
            self._trainer.loggers = self._loggers
        self._trainer, self._loggers = None, []

    def record(self, logger: int, path: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call = LoggerCall(logger, path, *tree_map(_on_cpu, (args, kwargs)), micro_batch=self._current)
        try:  # it travels to rank 0 with the step's values: say now, and which call, if it cannot
            pickle.dumps((call.args, call.kwargs))
        except Exception as error:
            raise PipeConfigError(
                f"{call.describe()} under a pipeline: the loggers write on global rank 0, so a call made on another "
                f"stage travels there, and its arguments cannot be pickled ({type(error).__name__}: {error}). Pass "
                "tensors, arrays, numbers, strings or figures."
            ) from error
        self.calls.append(call)


def make_calls(calls: Sequence[LoggerCall], loggers: Sequence[Any]) -> None:
    """Make the calls of the first micro-batch that made any on the real ``loggers`` (on global rank 0; elsewhere
    a logger's methods do nothing), with a warning, once per call site, when later micro-batches made some too."""
    if not calls:
        return
    first = calls[0].micro_batch
    kept = [call for call in calls if call.micro_batch == first]
    dropped = {call.describe() for call in calls if call.micro_batch != first} - _WARNED
    if dropped:
        _WARNED.update(dropped)
        rank_zero_warn(
            f"the step called {', '.join(sorted(dropped))} in several micro-batches of one batch; only the first "
            "micro-batch's calls are made, as one device makes them once per batch. Log values that cover the whole "
            "batch with self.log, which combines the micro-batches (docs/faq.md)."
        )
    for call in kept:
        call.make(loggers)


def _on_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value
