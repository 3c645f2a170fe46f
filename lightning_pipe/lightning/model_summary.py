"""Lightning's ModelSummary of the whole module, although each process keeps only its stage.

Lightning's ``ModelSummary`` callback (and ``RichModelSummary``) summarises the module at fit start,
after the strategy's setup, when each process of a pipeline holds only its own trunk layers: rank 0
would report its stage's parameters as the model's. :func:`freeze_model_summaries` takes each such
callback's summary while the module is still whole and has the callback report that summary.
Only plain values are kept (no references to layers, which other ranks' stages would otherwise keep
alive on rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import summarize


@dataclass(frozen=True)
class FrozenSummary:
    """What ``ModelSummary.on_fit_start`` reads from a summary, as plain values."""

    data: list[tuple[str, list[str]]] = field(default_factory=list)
    total_parameters: int = 0
    trainable_parameters: int = 0
    model_size: float = 0.0
    total_training_modes: dict[str, int] = field(default_factory=dict)
    total_flops: int = 0

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return self.data

    @classmethod
    def of(cls, module: LightningModule, max_depth: int) -> FrozenSummary:
        summary = summarize(module, max_depth=max_depth)
        return cls(summary._get_summary_data(), summary.total_parameters, summary.trainable_parameters,
                   summary.model_size, dict(summary.total_training_modes), getattr(summary, "total_flops", 0))


def freeze_model_summaries(trainer: Trainer, module: LightningModule, is_global_zero: bool) -> None:
    """Before the trunk is cut: make every ModelSummary callback report the whole ``module``.

    The summary is computed on global rank 0 only (the only rank that prints it); the other ranks'
    callbacks report an empty one.
    """
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary) and callback._max_depth:
            frozen = FrozenSummary.of(module, callback._max_depth) if is_global_zero else FrozenSummary()
            callback._summary = _returning(frozen)  # instance attribute: shadows ModelSummary._summary


def _returning(summary: FrozenSummary) -> Any:
    return lambda trainer, pl_module: summary
