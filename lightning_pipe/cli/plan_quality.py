"""``lightning-pipe plan``'s quality block: the language-model benchmark's cost of each asynchronous schedule
planned, at the planned stage count, under the module's own optimizer family (lightning_pipe.quality)."""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import LightningModule

from lightning_pipe.lightning._compat import module_optimizers
from lightning_pipe.quality import Family, optimizer_family, plan_notes


def module_family(model: LightningModule) -> Family | None:
    """The optimizer family of ``model.configure_optimizers()``, or ``None`` when it cannot be built outside a
    Trainer or has no family (then the block lists AdamW, Muon and SGD)."""
    try:
        optimizers = module_optimizers(model)
    except Exception:  # configure_optimizers may need a Trainer: show every family instead
        return None
    return optimizer_family(optimizers[0]) if optimizers else None


def quality_text(model: LightningModule, schedules: Sequence[str], stages: int) -> str:
    """The block appended to the plan's report (empty when no asynchronous or averaging schedule was planned)."""
    return "\n".join(plan_notes(list(schedules), stages, module_family(model)))


__all__ = ["module_family", "quality_text"]
