"""Random numbers that every stage of a pipeline draws alike.

Every stage runs the step's code before the trunk (the first stage, and the last, which runs the step again to reach
the code after the trunk; every stage of a looped trunk). A step that draws random numbers there must draw the same
ones on each of them: mixup's mixing weight and permutation mix the inputs on the first stage and the labels on the
last, and a random mask of the tokens is applied on one stage and scored on another. The processes' generators drift
apart within the first step (each stage's dropout draws masks for its own layers only), so each micro-batch's step runs
with the generators seeded alike on every stage: by :func:`derive_seed` of a base the stages agree on at setup, the
step's count and the micro-batch's index. Afterwards the generators start again from a seed of the step, the same on
every stage whichever micro-batch ran last there, so what runs between steps (a dataset's random augmentation in the
main process) draws alike on every stage too. Saving and restoring the generators instead would cost NumPy's state
copy, about 0.15 ms per micro-batch and stage.

Once the stage's own layers start, they draw from a seed of their own (the same derivation with the virtual stage), so
two stages whose layers are alike do not repeat each other's dropout masks. A micro-batch's masks then depend only on
the seeds, not on the order in which a schedule runs the micro-batches.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy
import torch


def derive_seed(*parts: int) -> int:
    """A seed for torch (below 2**63) that depends on every one of ``parts`` and looks unrelated to its neighbours'."""
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reseed(seed: int) -> None:
    """Seed torch's CPU generator, the current CUDA device's, NumPy's and Python's global generators with ``seed``."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)  # the current device only: other devices' generators are not this rank's
    numpy.random.seed(seed % 2**32)
    random.seed(seed)


def layers_seed(seed: int | None, virtual_stage: int) -> int | None:
    """The seed ``virtual_stage``'s own layers draw from, for a micro-batch whose step draws from ``seed``."""
    return None if seed is None else derive_seed(seed, virtual_stage)


@dataclass(frozen=True)
class StepSeeds:
    """The seeds of one step's micro-batches, alike on every stage of the pipeline.

    Attributes:
        step: the step's seed (:func:`derive_seed` of the agreed base and the step's count).
        micro_batches: the step's micro-batches, to find a micro-batch's index by identity.
    """

    step: int
    micro_batches: Sequence[Any]

    def of(self, micro_batch: Any) -> int | None:
        """The seed the step's code draws from for ``micro_batch`` (``None`` for one not of this step)."""
        index = next((i for i, each in enumerate(self.micro_batches) if each is micro_batch), None)
        return None if index is None else derive_seed(self.step, index)

    @contextmanager
    def running(self, seed: int | None) -> Iterator[None]:
        """Within the block the global generators start from ``seed`` (:func:`reseed`); after it from the step's own
        seed. ``None`` (a micro-batch of no step) leaves them alone."""
        if seed is None:
            yield
            return
        reseed(seed)
        try:
            yield
        finally:
            reseed(derive_seed(self.step, -1))
