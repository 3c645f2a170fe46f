"""1F1B, a.k.a. PipeDream-Flush / DAPPLE (docs/algorithms.md §3).

Stage ``s`` runs ``k_s = min(P - 1 - s, M)`` warm-up forwards, then alternates one forward with one
backward, then drains the remaining backwards. At most ``k_s + 1`` micro-batches are in flight.
"""

from __future__ import annotations

from collections.abc import Iterator

from lightning_pipe.schedules.ir import STEP, Action, B, F


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> Iterator[Action]:
    """Actions of ``stage`` for one flushed 1F1B step."""
    warmup = min(stages - 1 - stage, micro_batches)
    yield from (F(j) for j in range(warmup))
    for j in range(warmup, micro_batches):
        yield F(j)
        yield B(j - warmup)
    yield from (B(j) for j in range(micro_batches - warmup, micro_batches))
    yield STEP
