"""Forward-only schedule for validation, test and predict: every stage forwards in order.

With several chunks per device, micro-batches go through all chunks in groups of ``stages`` (the
interleaved forward order), so no device waits for a group behind the one it works on. Any number
of micro-batches works: the last group may be partial.
"""

from __future__ import annotations

from collections.abc import Iterator

from lightning_pipe.schedules.ir import Action, F


def forward_only(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> Iterator[Action]:
    """Actions of ``stage``: the forwards of every micro-batch on every chunk, no backward."""
    for start in range(0, micro_batches, stages):
        for chunk in range(chunks):
            yield from (F(mb, chunk) for mb in range(start, min(start + stages, micro_batches)))
