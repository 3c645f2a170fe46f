"""``grad_cosine``: how well a stage's stale gradient points where the gradient at the weights its STEP
updates points (docs/metrics.md).

On a measured step the executor keeps, for the first forward the stage runs, what that forward saw (its
input, its micro-batch, the RNG state); at that micro-batch's backward it takes the stale gradient on the
same graph before the regular backward runs, then recomputes the forward at the weights the STEP updates
(the policy's *applied* weights) and takes the gradient of the same output gradient there. Both are
stage-local: the recompute starts from the same input activation, so the cosine says how much this
stage's own weight staleness turned its gradient, not what the stale activations of earlier stages did.

Nothing of it reaches training: the stale gradient is taken with :func:`torch.autograd.grad` (which does not
accumulate into ``.grad`` or run the gradient reducer's post-accumulate hooks) on a retained graph that the
regular backward then uses unchanged; the recompute runs in a forked RNG stream, and buffers it changes in
place (BatchNorm's running statistics) are put back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

RngState = tuple[Tensor, "Tensor | None"]


@dataclass
class GradientProbe:
    """What the measured micro-batch's forward leaves for its backward.

    Attributes:
        inputs: the stage's input activation as the chunk received it, detached (``None`` on the first stage).
        micro_batch: the micro-batch the chunk was called with (a later window may no longer hold it).
        rng: the RNG state the forward started from (CPU, and the stage's CUDA device if any).
        stale: the stale gradient of each of the policy's parameters (``None``: unused), set at the backward.
    """

    inputs: Any
    micro_batch: Any
    rng: RngState
    stale: Sequence[Tensor | None] | None = None


def detached(value: Any) -> Any:
    """``value`` (a tensor, a tuple of them, or ``None``) with every tensor detached."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(detached(v) for v in value)
    return value


def rng_state(device: torch.device) -> RngState:
    """The RNG state a forward on ``device`` starts from (reading it does not advance the streams)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def replayed_rng(state: RngState, device: torch.device) -> Iterator[None]:
    """Within the block the RNG streams start from ``state``; after it they are where they were before it,
    so a recompute draws the dropout masks its original forward drew and training's stream is untouched."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


@contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Buffers the block changes in place (BatchNorm's running statistics) get their values back.

    Only a changed buffer (its version counter moved) is written back: writing one that a graph still in
    flight saved for its backward would make that backward fail its in-place check."""
    saved = [(b, b._version, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, version, value in saved:
                if buffer._version != version:
                    buffer.copy_(value)


def cosine(a: Sequence[Tensor | None], b: Sequence[Tensor | None]) -> Tensor | None:
    """The cosine between two gradients given per parameter (``None``: zero), as a 0-d float32 tensor on their
    device (no host synchronisation); ``None`` when neither has any entry."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None or y is not None]
    if not pairs:
        return None
    dots = [(x.float() * y.float()).sum() for x, y in pairs if x is not None and y is not None]
    device = next(t for pair in pairs for t in pair if t is not None).device
    dot = torch.stack(dots).sum() if dots else torch.zeros((), device=device)
    tiny = torch.finfo(torch.float32).tiny
    return dot / (_norm([x for x, _ in pairs]) * _norm([y for _, y in pairs])).clamp_min(tiny)


def _norm(tensors: Sequence[Tensor | None]) -> Tensor:
    """The 2-norm of the concatenation of ``tensors`` (``None``: zero), in float32.

    Not :func:`~lightning_pipe.engine.policies.base.norm_of`: that one takes each tensor's norm in its own
    dtype, and a bf16 norm's three digits would swamp a cosine read near 0.99."""
    present = [t.detach().float() for t in tensors if t is not None]
    if not present:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in present]))
