"""What the asynchronous schedules cost in quality, as measured, and which recipe keeps it.

One small table, :data:`COST`, copied from the goals summary of docs/lm-quality.md (the language-model
benchmark: a character-level transformer, 400 steps, 3 seeds, mean final validation loss against
synchronous ``1f1b`` with the same optimizer). It feeds the setup warning
(:func:`quality_warning`, :class:`~lightning_pipe.errors.AsyncQualityWarning`) and the quality
column of ``lightning-pipe plan`` (:func:`plan_notes`). No Lightning here: the planner and the
strategy both read it.

The optimizer decides most of the cost (docs/lm-quality.md, "Where AdamW's loss under a delay comes
from"): Adam-like updates lose 7-21 % under a one-step delay, Muon, SGD with momentum and
:class:`~lightning_pipe.optim.BasisRotationAdam` lose far less. Only the Adam family is warned about.
"""

from __future__ import annotations

from typing import Literal

import torch

from lightning_pipe import registry
from lightning_pipe.optim import BasisRotationAdam

Family = Literal["adamw", "nadam", "muon", "sgd", "basis_rotation"]

#: The schedules whose gradients are stale (avgpipe's family, "averaging", is not stale).
STALE = registry.names("asynchronous")

#: Stage counts the benchmark ran.
MEASURED_STAGES = (2, 4, 8)

#: ``(schedule, stages, family) -> %`` more final validation loss than synchronous ``1f1b``, M = 4,
#: each schedule with its defaults. Source: docs/lm-quality.md, "Where the issue's goals stand"
#: (AdamW, SGD-momentum, Muon, avgpipe), "The Nesterov recipe" (nadam: NAdam with betas (0.99, 0.999)
#: and decoupled weight decay, against synchronous *AdamW*, the run a user replaces) and "The basis
#: rotation" (against synchronous BasisRotationAdam). Update it when that page's summary changes.
COST: dict[tuple[str, int, Family], float] = {
    ("pipedream", 2, "adamw"): 10.3, ("pipedream", 4, "adamw"): 7.3, ("pipedream", 8, "adamw"): 11.1,
    ("pipedream_2bw", 2, "adamw"): 16.4, ("pipedream_2bw", 4, "adamw"): 9.1, ("pipedream_2bw", 8, "adamw"): 10.5,
    ("pipemare", 2, "adamw"): 7.1, ("pipemare", 4, "adamw"): 8.6, ("pipemare", 8, "adamw"): 15.2,
    ("xpipe", 2, "adamw"): 12.7, ("xpipe", 4, "adamw"): 7.2, ("xpipe", 8, "adamw"): 17.3,
    ("avgpipe", 2, "adamw"): 1.0, ("avgpipe", 4, "adamw"): -5.8, ("avgpipe", 8, "adamw"): -0.9,
    ("pipedream", 2, "sgd"): 0.9, ("pipedream", 4, "sgd"): 3.0, ("pipedream", 8, "sgd"): 9.6,
    ("pipedream_2bw", 2, "sgd"): 6.9, ("pipedream_2bw", 4, "sgd"): 8.2, ("pipedream_2bw", 8, "sgd"): 12.8,
    ("pipemare", 2, "sgd"): 1.1, ("pipemare", 4, "sgd"): 4.7, ("pipemare", 8, "sgd"): 7.4,
    ("xpipe", 2, "sgd"): 1.2, ("xpipe", 4, "sgd"): 6.9, ("xpipe", 8, "sgd"): 4.4,
    ("avgpipe", 2, "sgd"): 0.4, ("avgpipe", 4, "sgd"): 0.4,
    ("pipedream", 2, "muon"): 0.4, ("pipedream", 4, "muon"): 2.5, ("pipedream", 8, "muon"): 7.6,
    ("pipedream_2bw", 2, "muon"): 2.3, ("pipedream_2bw", 4, "muon"): 2.2, ("pipedream_2bw", 8, "muon"): 1.8,
    ("pipemare", 2, "muon"): 0.5, ("pipemare", 4, "muon"): 2.6, ("pipemare", 8, "muon"): 11.8,
    ("xpipe", 2, "muon"): 1.0, ("xpipe", 4, "muon"): 2.7, ("xpipe", 8, "muon"): 10.1,
    ("avgpipe", 2, "muon"): 1.4, ("avgpipe", 4, "muon"): 1.8,
    ("pipedream", 2, "nadam"): 0.9, ("pipedream", 4, "nadam"): 0.4, ("pipedream", 8, "nadam"): 14.4,
    ("pipedream_2bw", 2, "nadam"): 25.0, ("pipedream_2bw", 4, "nadam"): 20.0,
    ("pipemare", 2, "nadam"): 2.6, ("pipemare", 4, "nadam"): 12.0,
    ("xpipe", 2, "nadam"): 11.0, ("xpipe", 4, "nadam"): 23.0,
    ("pipedream", 2, "basis_rotation"): 0.9, ("pipedream", 4, "basis_rotation"): 3.0,
    ("pipedream_2bw", 2, "basis_rotation"): 5.1,
}

#: The issue-12 goals the benchmark holds a schedule to: within this many % at that stage count.
GOAL = {2: 1.0, 4: 1.5, 8: 3.0}

#: What keeps an Adam user's quality at each measured stage count (docs/lm-quality.md, "Which option
#: comes closest"; the numbers are in :data:`COST`).
RECIPE = {
    2: "schedule='pipedream' with torch.optim.NAdam(betas=(0.99, 0.999), decoupled_weight_decay=True) (+0.9 %), "
       "torch.optim.Muon for the matrices (pipedream +0.4 %) or schedule='avgpipe' (+1.0 %)",
    4: "schedule='pipedream' with torch.optim.NAdam(betas=(0.99, 0.999), decoupled_weight_decay=True) (+0.4 %) "
       "or schedule='avgpipe' (-5.8 %)",
    8: "schedule='avgpipe' (-0.9 %) or schedule='pipedream_2bw' with torch.optim.Muon for the matrices (+1.8 %)",
}

PAGE = "docs/async-semantics.md#choosing-an-asynchronous-configuration"

_NAMES: dict[Family, str] = {"adamw": "Adam/AdamW", "nadam": "NAdam", "muon": "Muon", "sgd": "SGD",
                             "basis_rotation": "BasisRotationAdam"}
_ADAM = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RAdam, torch.optim.Adamax)


def optimizer_family(optimizer: torch.optim.Optimizer) -> Family | None:
    """The benchmark's optimizer family of ``optimizer`` (by class), or ``None`` when it has none.

    A :class:`~lightning_pipe.optim.CombinedOptimizer` takes the family of the optimizer of its matrices:
    Muon or BasisRotationAdam when one of its members is (the AdamW beside them, for embeddings, norms
    and head, is how the benchmark ran them), else the first member with a family.
    """
    members = getattr(optimizer, "optimizers", None)
    if members is not None:
        families = [optimizer_family(member) for member in members]
        for preferred in ("muon", "basis_rotation"):
            if preferred in families:
                return preferred  # type: ignore[return-value]
        return next((f for f in families if f is not None), None)
    if isinstance(optimizer, torch.optim.Muon):
        return "muon"
    if isinstance(optimizer, BasisRotationAdam):
        return "basis_rotation"
    if isinstance(optimizer, torch.optim.NAdam):
        return "nadam"
    if isinstance(optimizer, _ADAM):
        return "adamw"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return None


def nearest_stages(stages: int) -> int:
    """The measured stage count closest to ``stages`` (a tie goes to the deeper, costlier one)."""
    return min(MEASURED_STAGES, key=lambda measured: (abs(measured - stages), -measured))


def measured_cost(schedule: str, stages: int, family: Family) -> tuple[int, float] | None:
    """``(stage count measured, % cost)`` nearest to ``stages`` for ``schedule`` under ``family``, or ``None``."""
    for measured in sorted(MEASURED_STAGES, key=lambda m: (abs(m - stages), -m)):
        cost = COST.get((schedule, measured, family))
        if cost is not None:
            return measured, cost
    return None


def quality_warning(schedule: str, stages: int, optimizer: torch.optim.Optimizer) -> str | None:
    """The one-sentence warning for ``schedule`` on ``stages`` stages with ``optimizer``, or ``None``.

    It fires for the stale schedules (:data:`STALE`) under the Adam family (Adam, AdamW, RAdam,
    Adamax, and NAdam where the benchmark measured it above the goal), never for Muon, SGD,
    BasisRotationAdam, avgpipe or the synchronous schedules.
    """
    if schedule not in STALE or stages < 2:
        return None
    family = optimizer_family(optimizer)
    if family not in ("adamw", "nadam"):
        return None
    found = measured_cost(schedule, stages, family)
    if found is None:
        return None
    measured, cost = found
    if cost <= GOAL[measured]:  # the NAdam recipe under pipedream at P <= 4 keeps quality
        return None
    where = f"{stages} stages" if measured == stages else f"{measured} stages (the nearest measured to {stages})"
    return (f"lightning_pipe: schedule={schedule!r} with {type(optimizer).__name__} ended {cost:+.1f} % above synchronous "
            f"training's validation loss on the language-model benchmark at {where}, because Adam-like updates lose "
            f"quality under stale gradients; to keep quality there use {RECIPE[measured]} (see {PAGE}; silence this "
            "with PipeStrategy(quality_warning=False) or a warnings filter on AsyncQualityWarning).")


def plan_notes(schedules: list[str], stages: int, family: Family | None) -> list[str]:
    """``lightning-pipe plan``'s quality lines: the measured cost of each asynchronous or averaging
    schedule among ``schedules`` at ``stages`` under ``family`` (all measured families when unknown)."""
    listed = [s for s in schedules if s in STALE or registry.SCHEDULES[s].family == "averaging"]
    if not listed:
        return []
    families: list[Family] = [family] if family is not None else ["adamw", "muon", "sgd"]
    lines = ["", "quality: final validation loss vs synchronous 1f1b on the language-model benchmark "
             f"(docs/lm-quality.md; recipes: {PAGE})"]
    for schedule in listed:
        cells = []
        for fam in families:
            found = measured_cost(schedule, stages, fam)
            if found is None:
                cells.append(f"{_NAMES[fam]} not measured")
                continue
            measured, cost = found
            at = "" if measured == stages else f" (measured at {measured} stages)"
            cells.append(f"{_NAMES[fam]} {cost:+.1f} %{at}")
        lines.append(f"  {schedule}: " + ", ".join(cells))
    return lines


__all__ = ["COST", "Family", "measured_cost", "optimizer_family", "plan_notes", "quality_warning"]
