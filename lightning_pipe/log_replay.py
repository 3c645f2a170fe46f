"""Make every rank log what the last stage logged.

Only the last stage computes the loss, but Lightning's loggers live on rank 0 and ModelCheckpoint,
EarlyStopping and the progress bar read ``trainer.callback_metrics`` on every rank (a rank that
lacks a monitored value hangs in a collective). So during the micro-batch steps ``self.log`` is
captured, the last stage combines the calls of all micro-batches into what one full-batch call
would have logged, the result is broadcast in the pipeline, and every rank replays it through the
real ``LightningModule.log``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_TORCH_REDUCTIONS = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


@dataclass
class LoggedValue:
    """One ``self.log`` call reduced to plain data (picklable, device-free)."""

    name: str
    value: float
    batch_size: int
    options: dict[str, Any] = field(default_factory=dict)


def _reduction(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str) and reduce_fx.lower() in _REDUCTIONS:
        return _REDUCTIONS[reduce_fx.lower()]
    if reduce_fx in _TORCH_REDUCTIONS:
        return _TORCH_REDUCTIONS[reduce_fx]
    raise ValueError(f"self.log(reduce_fx={reduce_fx!r}) cannot be combined over micro-batches; use 'mean', 'sum', 'max' or 'min'.")


class LogCapture:
    """Context manager that records ``module.log`` calls instead of performing them.

    Set :attr:`batch_size` to the current micro-batch size before each micro-batch step.
    """

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self.records: list[LoggedValue] = []
        self.batch_size = 1

    def __enter__(self) -> LogCapture:
        self.records = []
        self.module.__dict__["log"] = self._record
        return self

    def __exit__(self, *exc: Any) -> None:
        self.module.__dict__.pop("log", None)

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(self.module, name, value, *args, **kwargs)
        options = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
        batch_size = options.pop("batch_size", None) or self.batch_size
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) needs a scalar, got a tensor of shape {tuple(value.shape)}.")
            value = value.detach().float().item()
        elif not isinstance(value, (int, float, bool)):
            raise TypeError(
                f"self.log({name!r}, {type(value).__name__}) is not supported inside a pipelined training_step; "
                "log a tensor or a number (for torchmetrics, log metric.compute() at epoch end)."
            )
        self.records.append(LoggedValue(name, float(value), int(batch_size), options))


def combine(records: list[LoggedValue]) -> list[LoggedValue]:
    """Reduce the micro-batch records of each name to one record, as one full-batch call would log."""
    by_name: dict[str, list[LoggedValue]] = {}
    for record in records:
        by_name.setdefault(record.name, []).append(record)
    combined = []
    for name, group in by_name.items():
        how = _reduction(group[0].options.get("reduce_fx", "mean"))
        values = [r.value for r in group]
        total = sum(r.batch_size for r in group)
        if how == "mean":
            value = sum(r.value * r.batch_size for r in group) / total
        else:
            value = {"sum": sum, "max": max, "min": min}[how](values)
        combined.append(LoggedValue(name, value, total, group[0].options))
    return combined


def replay(module: LightningModule, records: list[LoggedValue]) -> None:
    """Log ``records`` through the real ``LightningModule.log`` of ``module``."""
    for record in records:
        value = torch.tensor(record.value, dtype=torch.float32, device=module.device)
        module.log(record.name, value, batch_size=record.batch_size, **record.options)
