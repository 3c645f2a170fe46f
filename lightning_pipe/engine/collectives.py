"""One way to all-reduce a list of tensors: flattened into a single message.

Used for gradients across data-parallel pipelines (synchronous schedules and avgpipe replicas) and
for parameters that several stages of one pipeline share (a tied embedding). One message instead
of one per tensor keeps the number of collectives independent of the model's depth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def all_reduce_flat(tensors: Sequence[Tensor], group: Any, scale: float | None = None) -> None:
    """Sum ``tensors`` in place over ``group`` (one flattened message per dtype), then multiply by
    ``scale`` if given (``1 / members`` makes it a mean)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        if scale is not None:
            flat.mul_(scale)
        for tensor, part in zip(same, flat.split([t.numel() for t in same])):
            tensor.copy_(part.view_as(tensor))
