"""The asynchronous 1F1B core (docs/algorithms.md §5; docs/async-semantics.md).

Micro-batches form an endless stream within a segment. Stage ``s`` runs ``F(0..w_s-1)`` and then, for
``n = 0, 1, ...``: ``F(n + w_s)``, ``B(n)``, and STEP after every ``M``-th backward. There is no
flush: each Lightning step (window ``t``) feeds the ``M`` micro-batches of its batch, and a drain
runs the outstanding backwards at the end of the segment. pipedream, pipedream_2bw, pipemare and
xpipe share this order and differ only in which weights F and B see.
"""

from __future__ import annotations

from collections.abc import Iterator

from lightning_pipe.schedules.ir import STEP, Action, B, F


def _backward(n: int, micro_batches: int) -> Iterator[Action]:
    yield B(n)
    if n % micro_batches == micro_batches - 1:
        yield STEP


def async_window(stage: int, stages: int, micro_batches: int, window: int) -> Iterator[Action]:
    """Actions of ``stage`` in Lightning step ``window`` of a segment."""
    warmup = stages - 1 - stage
    for i in range(micro_batches):
        g = window * micro_batches + i
        yield F(g)
        if g - warmup >= 0:
            yield from _backward(g - warmup, micro_batches)


def async_drain(stage: int, stages: int, micro_batches: int, windows: int) -> Iterator[Action]:
    """The backwards (and STEPs) still owed by ``stage`` after ``windows`` windows."""
    total = windows * micro_batches
    for n in range(max(0, total - (stages - 1 - stage)), total):
        yield from _backward(n, micro_batches)
