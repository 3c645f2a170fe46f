"""Interleaved 1F1B (Megatron-LM; docs/algorithms.md §4).

Each device holds ``v`` chunks; device ``d`` owns virtual stages ``d, d + P, ..., d + (v - 1) P``.
Forwards walk the chunks in groups of ``P`` micro-batches, backwards walk them in reverse chunk
order, which shrinks the bubble to ``(P - 1) / (v M)`` of a step. Requires ``M % P == 0``.
"""

from __future__ import annotations

from collections.abc import Iterator

from lightning_pipe.schedules.ir import STEP, Action, B, F


def _chunk_and_micro_batch(k: int, stages: int, chunks: int) -> tuple[int, int]:
    """The chunk and micro-batch of a device's ``k``-th forward (in forward chunk order)."""
    group, within = divmod(k, stages * chunks)
    return within // stages, group * stages + k % stages


def interleaved_1f1b(stage: int, stages: int, micro_batches: int, chunks: int) -> Iterator[Action]:
    """Actions of device ``stage`` for one flushed interleaved-1F1B step."""
    if micro_batches % stages:
        raise ValueError(
            f"interleaved_1f1b needs micro_batches to be a multiple of stages; got {micro_batches} "
            f"micro-batches for {stages} stages (try micro_batches={stages * max(1, micro_batches // stages)})."
        )
    total = micro_batches * chunks

    def forward(k: int) -> Action:
        chunk, mb = _chunk_and_micro_batch(k, stages, chunks)
        return F(mb, chunk)

    def backward(k: int) -> Action:
        chunk, mb = _chunk_and_micro_batch(k, stages, chunks)
        return B(mb, chunks - 1 - chunk)

    if micro_batches == stages:
        warmup = total  # Megatron: with M == P all forwards run first
    else:
        warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    yield from (forward(k) for k in range(warmup))
    for i in range(total - warmup):
        yield forward(warmup + i)
        yield backward(i)
    yield from (backward(k) for k in range(total - warmup, total))
    yield STEP
