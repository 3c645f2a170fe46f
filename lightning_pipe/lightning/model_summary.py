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

from lightning_pipe.lightning import _compat


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
        return cls(_compat.summary_data(summary), summary.total_parameters, summary.trainable_parameters,
                   summary.model_size, dict(summary.total_training_modes), getattr(summary, "total_flops", 0))


def freeze_model_summaries(trainer: Trainer, module: LightningModule, is_global_zero: bool) -> None:
    """Before the trunk is cut: make every ModelSummary callback report the whole ``module``.

    The summary is computed on global rank 0 only (the only rank that prints it); the other ranks'
    callbacks report an empty one.
    """
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary) and _compat.summary_depth(callback):
            frozen = FrozenSummary.of(module, _compat.summary_depth(callback)) if is_global_zero else FrozenSummary()
            _compat.replace_summary(callback, _returning(frozen))


def _returning(summary: FrozenSummary) -> Any:
    return lambda trainer, pl_module: summary
