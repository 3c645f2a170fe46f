"""Refuse a layer's forward inside a backward whose forward weights are gone.

Activation checkpointing inside the model (``torch.utils.checkpoint`` in a block, Hugging Face's
``gradient_checkpointing_enable()``) runs the checkpointed layers' forwards again inside the backward.
Under a weight policy that keeps no copy of the weights a forward ran on (pipemare, xpipe:
``WeightPolicy.keeps_forward_weights`` is false) the parameters hold the backward's weights by then, so
the recomputed activations are not the forward's and the stage trains something else without a word
(docs/async-semantics.md). ``PipeStrategy(checkpoint_activations=True)`` is refused at construction for the
same reason; this catches the model's own checkpointing at the first backward.

No module runs its forward inside a backward except to recompute, so a process-wide forward pre-hook
registered only for the duration of each backward sees exactly the recomputations, and costs nothing
outside the backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from lightning_pipe.errors import PipeConfigError


@contextmanager
def refuse_recomputation(stage: str, policy: str) -> Iterator[None]:
    """Within the block (one backward of ``stage``), any module's forward raises :class:`PipeConfigError`
    naming ``policy``, the weight policy that keeps no forward weights."""

    def refuse(module: nn.Module, args: Any) -> None:
        raise PipeConfigError(
            f"a {type(module).__name__} ran its forward again inside {stage}'s backward: the model checkpoints "
            "activations itself (torch.utils.checkpoint, or Hugging Face's gradient_checkpointing_enable()), and "
            f"this schedule's weight policy ({policy}) keeps no copy of the weights a forward ran on, so the "
            "recomputation would read the backward's weights and train something else. Turn the model's "
            "activation checkpointing off, or use schedule='pipedream' or 'pipedream_2bw', which recompute on "
            "their stashed weights."
        )

    handle = register_module_forward_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()
