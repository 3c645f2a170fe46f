"""GPipe (docs/algorithms.md §2): all forwards, then all backwards in reverse, then STEP."""

from __future__ import annotations

from collections.abc import Iterator

from lightning_pipe.schedules.ir import STEP, Action, B, F


def gpipe(stage: int, stages: int, micro_batches: int) -> Iterator[Action]:
    """Actions of ``stage``: ``F(0) .. F(M-1), B(M-1) .. B(0), STEP``."""
    yield from (F(j) for j in range(micro_batches))
    yield from (B(j) for j in reversed(range(micro_batches)))
    yield STEP
