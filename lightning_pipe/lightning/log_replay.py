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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

from lightning_pipe.lightning import _compat

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_TORCH_REDUCTIONS = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


@dataclass
class LoggedValue:
    """One ``self.log`` call reduced to plain data (picklable, device-free).

    For a torchmetrics ``Metric``, ``value`` is ``None`` and ``options["metric_attribute"]`` names
    the metric; its accumulated state travels in ``metric_state`` so every rank's copy of the
    metric equals the last stage's.
    """

    name: str
    value: float | Tensor | None  #: a 0-d tensor while captured (no host sync per micro-batch), a float once combined
    batch_size: int
    options: dict[str, Any] = field(default_factory=dict)
    metric_state: dict[str, Any] | None = None


def _reduction(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str) and reduce_fx.lower() in _REDUCTIONS:
        return _REDUCTIONS[reduce_fx.lower()]
    if reduce_fx in _TORCH_REDUCTIONS:
        return _TORCH_REDUCTIONS[reduce_fx]
    raise ValueError(f"self.log(reduce_fx={reduce_fx!r}) cannot be combined over micro-batches; use 'mean', 'sum', 'max' or 'min'.")


@contextmanager
def silenced(module: LightningModule) -> Iterator[None]:
    """Within the block ``module.log`` does nothing (a recompute of a step already recorded: grad_cosine's)."""
    outer = module.__dict__.get("log")
    module.__dict__["log"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        if outer is None:
            module.__dict__.pop("log", None)
        else:
            module.__dict__["log"] = outer


class LogCapture:
    """Context manager that records ``module.log`` calls instead of performing them.

    Set :attr:`batch_size` to the current micro-batch size before each micro-batch step.
    """

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self.records: list[LoggedValue] = []
        self.batch_size = 1
        self._outer: Any = None

    def __enter__(self) -> LogCapture:
        self.records = []
        self._outer = self.module.__dict__.get("log")  # captures nest: an inner one restores the outer
        self.module.__dict__["log"] = self._record
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._outer is None:
            self.module.__dict__.pop("log", None)
        else:
            self.module.__dict__["log"] = self._outer

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(self.module, name, value, *args, **kwargs)
        options = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
        batch_size = options.pop("batch_size", None) or self.batch_size
        if isinstance(value, Metric):
            if options.get("metric_attribute") is None:
                names = {id(m): n for n, m in self.module.named_modules() if isinstance(m, Metric)}
                if id(value) not in names:
                    raise ValueError(f"self.log({name!r}, metric) needs the metric to be an attribute of the module.")
                options["metric_attribute"] = names[id(value)]
            self.records.append(LoggedValue(name, None, int(batch_size), options))
            return
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) needs a scalar, got a tensor of shape {tuple(value.shape)}.")
            value = value.detach().reshape(())  # stays on its device until the step's values are combined
        elif isinstance(value, (int, float, bool)):
            value = float(value)
        else:
            raise TypeError(f"self.log({name!r}, {type(value).__name__}) needs a tensor, a number or a torchmetrics Metric.")
        self.records.append(LoggedValue(name, value, int(batch_size), options))


def combine(records: list[LoggedValue], module: LightningModule, read_back: bool = True) -> list[LoggedValue]:
    """Reduce the micro-batch records of each name to one record, as one full-batch call would log.

    Values logged as tensors are reduced on their device. With ``read_back`` they are then read back
    together (:func:`read_back_values`: one host synchronisation instead of one per ``self.log`` call and
    micro-batch); without it they stay device tensors, for a caller in the process that replays them.
    Metric records carry a snapshot of the metric's state after the last micro-batch.
    """
    by_name: dict[str, list[LoggedValue]] = {}
    for record in records:
        by_name.setdefault(record.name, []).append(record)
    combined = []
    for name, group in by_name.items():
        total = sum(r.batch_size for r in group)
        options = group[0].options
        if group[0].value is None:
            metric = module.get_submodule(options["metric_attribute"])
            combined.append(LoggedValue(name, None, total, options, _metric_state(metric)))
            continue
        how = _reduction(options.get("reduce_fx", "mean"))
        # float64, as the Python floats these values used to be combined in
        values = torch.stack([torch.as_tensor(r.value, dtype=torch.float64) for r in group])
        if how == "mean":  # sizes as Python scalars: a size tensor would be a host-to-device copy, which waits for the device
            value = torch.stack([v * float(r.batch_size) for v, r in zip(values, group)]).sum() / total
        else:
            value = {"sum": values.sum, "max": values.max, "min": values.min}[how]()
        combined.append(LoggedValue(name, value, total, options))
    if read_back:
        read_back_values(combined)
    return combined


def read_back_values(records: list[LoggedValue], *extra: Tensor) -> list[float]:
    """Turn the records' tensor values into floats, and return ``extra`` scalars' as floats, with one
    transfer per device."""
    holders = [record for record in records if isinstance(record.value, Tensor)]
    tensors: list[Tensor] = [record.value for record in holders] + list(extra)  # type: ignore[misc]
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(index)
    floats = [0.0] * len(tensors)
    for indices in by_device.values():
        for index, value in zip(indices, torch.stack([tensors[i] for i in indices]).tolist()):
            floats[index] = float(value)
    for record, value in zip(holders, floats):
        record.value = value
    return floats[len(holders):]


def replay(module: LightningModule, records: list[LoggedValue], owner: bool, one_pipeline: bool = False) -> None:
    """Log ``records`` through the real ``LightningModule.log`` of ``module``.

    Args:
        owner: this rank produced the records (its metrics already hold the state).
        one_pipeline: the job is one pipeline, so every rank logs the same value and reducing it across
            the data-parallel replicas is the identity: tensors are logged with ``sync_dist=True``
            (:meth:`PipeStrategy.reduce` returns them as they are), which is what Lightning advises for
            epoch-level values in a distributed run, so it has nothing to warn about. With several
            pipelines the user's choice stands.
    """
    for record in records:
        if record.value is None:
            metric = module.get_submodule(record.options["metric_attribute"])
            if not owner:
                _load_metric_state(metric, record.metric_state)
            module.log(record.name, metric, batch_size=record.batch_size, **record.options)
            continue
        value = record.value
        if isinstance(value, Tensor) and value.device == module.device:  # combined in this process
            value = value.to(logged_dtype())
        else:  # a fill, not a copy from host memory, which would wait for the device's queue
            value = torch.full((), float(value), dtype=logged_dtype(), device=module.device)
        options = {**record.options, "sync_dist": True} if one_pipeline else record.options
        module.log(record.name, value, batch_size=record.batch_size, **options)


def logged_dtype() -> torch.dtype:
    """The dtype a value logged in a step has on one device: the default dtype of the step's precision context
    (float64 under "64-true"), no lower than float32, as Lightning keeps it."""
    dtype = torch.get_default_dtype()
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def _metric_state(metric: Metric) -> dict[str, Any]:
    state = {name: _to_cpu(value) for name, value in metric.metric_state.items()}
    state.update({name: _to_cpu(value) for name, value in _compat.metric_bookkeeping(metric).items()})
    return state


def _load_metric_state(metric: Metric, state: dict[str, Any]) -> None:
    device = metric.device
    for name, value in state.items():
        if isinstance(value, Tensor):
            value = value.to(device)
        elif isinstance(value, list):
            value = [v.to(device) if isinstance(v, Tensor) else v for v in value]
        setattr(metric, name, value)
    _compat.forget_computed(metric)
