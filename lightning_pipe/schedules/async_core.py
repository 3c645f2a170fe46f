"""The asynchronous 1F1B core (docs/algorithms.md §5; docs/async-semantics.md).

Micro-batches form an endless stream within a segment. Stage ``s`` runs ``F(0..w_s-1)`` and then, for
``n = 0, 1, ...``: ``F(n + w_s)``, ``B(n)``, and STEP after every ``M``-th backward. There is no
flush: each Lightning step (window ``t``) feeds the ``M`` micro-batches of its batch, and a drain
runs the outstanding backwards at the end of the segment. pipedream, pipedream_2bw, pipemare and
xpipe share this order and differ only in which weights F and B see.

A segment's last window may be short (a short last batch: ``m < M`` micro-batches). Its mini-batch
is an ordinary one of ``m`` micro-batches: it steps after its own last backward, in the drain that
must follow it.
"""

from __future__ import annotations

from collections.abc import Iterator

from lightning_pipe.schedules.ir import STEP, Action, B, F


def _backward(n: int, micro_batches: int, last: int | None) -> Iterator[Action]:
    """``B(n)``, and STEP when ``n`` completes a mini-batch (every ``M``-th, or ``last`` of a short one)."""
    yield B(n)
    if n % micro_batches == micro_batches - 1 or n == last:
        yield STEP


def _short_end(window: int, micro_batches: int, size: int) -> int | None:
    """The last micro-batch of a short window ``window`` of ``size``, or ``None`` for a full window."""
    return window * micro_batches + size - 1 if size < micro_batches else None


def async_window(stage: int, stages: int, micro_batches: int, window: int, size: int | None = None) -> Iterator[Action]:
    """Actions of ``stage`` in Lightning step ``window`` of a segment (``size`` micro-batches; fewer
    than ``M`` only in a segment's last window)."""
    size = micro_batches if size is None else size
    warmup, last = stages - 1 - stage, _short_end(window, micro_batches, size)
    for i in range(size):
        g = window * micro_batches + i
        yield F(g)
        if g - warmup >= 0:
            yield from _backward(g - warmup, micro_batches, last)


def async_drain(stage: int, stages: int, micro_batches: int, windows: int, last_size: int | None = None) -> Iterator[Action]:
    """The backwards (and STEPs) still owed by ``stage`` after ``windows`` windows, the last of which
    held ``last_size`` micro-batches (default ``M``)."""
    size = micro_batches if last_size is None else last_size
    total = (windows - 1) * micro_batches + size if windows else 0
    last = _short_end(windows - 1, micro_batches, size) if windows else None
    for n in range(max(0, total - (stages - 1 - stage)), total):
        yield from _backward(n, micro_batches, last)
