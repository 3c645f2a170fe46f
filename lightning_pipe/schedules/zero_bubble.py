"""Zero-bubble schedules (Qi et al., 2023; docs/algorithms.md §4a): the backward split into ``I``
(the input's gradient, which the previous stage waits for) and ``W`` (the weights' gradients, which
only the STEP waits for), so ``W`` can fill the idle time 1F1B leaves.

* ``zb_h1``: 1F1B's order with ``I`` for ``B``, and stage ``s`` holding back its first ``s`` W's to
  run them in the cool-down, where 1F1B idles while the last gradients travel back. Every stage
  keeps at most ``P`` micro-batches in flight (forward done, ``W`` not): 1F1B's peak, now on every
  stage instead of stage 0 only.
* ``zbv``: two chunks per device placed as a V (``Schedule.placement == "v"``: device ``d`` holds
  virtual stages ``d`` and ``2P - 1 - d``), so device 0 both starts and ends the pipeline, and the
  ZB-V order of the paper (its handcrafted schedule, as torch.distributed.pipelining's
  ``ScheduleZBVZeroBubble`` writes it): a warm-up that fills both chunks, a steady state of
  ``F I W`` on each chunk, and a cool-down that puts ``I`` first and the remaining ``W`` last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from lightning_pipe.schedules.ir import STEP, Action, B, F, I, W


def zb_h1(stage: int, stages: int, micro_batches: int) -> Iterator[Action]:
    """Actions of ``stage`` for one flushed ZB-H1 step."""
    warmup = min(stages - 1 - stage, micro_batches)
    held_back = stage  # W's this stage defers into the cool-down
    yield from (F(j) for j in range(warmup))
    waiting: deque[int] = deque()
    for k in range(micro_batches):  # the k-th I, with the forward 1F1B pairs it with
        if warmup + k < micro_batches:
            yield F(warmup + k)
        yield I(k)
        waiting.append(k)
        if k >= held_back:
            yield W(waiting.popleft())
    yield from (W(j) for j in waiting)
    yield STEP


def zbv(stage: int, stages: int, micro_batches: int, chunks: int = 2) -> Iterator[Action]:
    """Actions of device ``stage`` for one flushed ZBV step (chunk 0 on the way down, chunk 1 back up)."""
    if chunks != 2:
        raise ValueError(f"zbv places exactly two chunks per device (a V); got chunks={chunks}.")
    # the order is written for at least 2P - 1 micro-batches; with fewer, the extra ones are dropped
    rounded = max(2 * stages - 1, micro_batches)
    yield from (a for a in _zbv_order(stage, stages, rounded) if a.micro_batch is None or a.micro_batch < micro_batches)


def _zbv_order(stage: int, stages: int, micro_batches: int) -> Iterator[Action]:
    count = {("F", 0): 0, ("F", 1): 0, ("I", 0): 0, ("I", 1): 0, ("W", 0): 0, ("W", 1): 0}
    make = {"F": F, "I": I, "W": W}

    def next_(kind: str, chunk: int) -> Action:
        index = count[(kind, chunk)]
        count[(kind, chunk)] += 1
        return make[kind](index, chunk)

    for _ in range(2 * (stages - stage) - 1):  # warm-up: chunk 0 only
        yield next_("F", 0)
    for _ in range(stage):  # the first activations come back up: alternate chunks
        yield next_("F", 1)
        yield next_("F", 0)
    for _ in range(stages - stage):  # chunk 1 runs F I W while chunk 0 waits for its first gradient
        yield from (next_("F", 1), next_("I", 1), next_("W", 1))
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < micro_batches:  # steady state
        if count[("F", 0)] < micro_batches:
            yield next_("F", 0)
        yield from (next_("I", 0), next_("W", 0))
        yield from (next_("F", 1), next_("I", 1), next_("W", 1))
    for _ in range(stage):  # cool-down: input gradients first, they are on the critical path
        yield next_("I", 0)
        yield next_("I", 1)
    for _ in range(stages - stage):
        yield next_("I", 0)
        yield next_("W", 0)
    while count[("W", 1)] < count[("I", 1)]:
        yield next_("W", 1)
    while count[("W", 0)] < count[("I", 0)]:
        yield next_("W", 0)
    yield STEP


def dualpipev(stage: int, stages: int, micro_batches: int, chunks: int = 2) -> Iterator[Action]:
    """Actions of device ``stage`` for one flushed DualPipeV step (DeepSeek-V3's DualPipe folded into a V,
    as torch.distributed.pipelining's ``ScheduleDualPipeV`` orders it). Same placement as :func:`zbv`; the
    steady state pairs a forward of one chunk with a *whole* backward ``B`` of the other, and only the
    warm-up and cool-down split backwards into ``I`` and ``W``, so most micro-batches skip the split's
    extra autograd passes. Needs ``micro_batches >= 2 * stages``."""
    if chunks != 2:
        raise ValueError(f"dualpipev places exactly two chunks per device (a V); got chunks={chunks}.")
    if micro_batches < 2 * stages:
        raise ValueError(f"dualpipev needs micro_batches >= 2 * stages; got {micro_batches} for {stages} stages "
                         f"(use micro_batches={2 * stages}).")
    forwards, backwards = [0, 0], [0, 0]  # next micro-batch per chunk
    weights: deque[tuple[int, int]] = deque()  # (chunk, micro-batch) of I's whose W is pending

    def forward(chunk: int) -> Action:
        forwards[chunk] += 1
        return F(forwards[chunk] - 1, chunk)

    def backward(chunk: int, split: bool) -> Action:
        backwards[chunk] += 1
        mb = backwards[chunk] - 1
        if split:
            weights.append((chunk, mb))
            return I(mb, chunk)
        return B(mb, chunk)

    def pending_weight() -> Iterator[Action]:
        if weights:
            chunk, mb = weights.popleft()
            yield W(mb, chunk)

    last = stages - 1
    for _ in range(2 * (last - stage)):  # warm-up: chunk 0 only
        yield forward(0)
    for _ in range(stage + 1):
        yield forward(0)
        yield forward(1)
    for _ in range(last - stage):
        yield backward(1, split=True)
        yield from pending_weight()
        yield forward(1)
    for _ in range(micro_batches - 2 * stages + stage + 1):  # steady state: F of one chunk, B of the other
        yield forward(0)
        yield backward(1, split=False)
        yield forward(1)
        yield backward(0, split=False)
    for _ in range(last - stage):
        yield backward(1, split=False)
        yield forward(1)
        yield backward(0, split=False)
    split = False
    for i in range(stage + 1):  # cool-down: input gradients first, from the middle on
        split = split or (i == (stage + 1) // 2 and stage % 2 == 1)
        yield backward(1, split)
        split = split or (i == (stage + 1) // 2 and stage % 2 == 0)
        yield backward(0, split)
    for _ in range(last - stage):
        yield from pending_weight()
        yield backward(0, split)
    for _ in range(stage + 1):
        yield from pending_weight()
    yield STEP
