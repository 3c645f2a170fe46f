"""Combine what a step returned for each micro-batch into what it would return for the batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def merge_outputs(outputs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """Concatenate batched tensors, average scalar tensors by micro-batch size, recurse into
    dicts, lists and tuples; anything else comes back as the list of per-micro-batch values."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.dim() == 0:
            total = sum(sizes)
            return sum(o.float() * (s / total) for o, s in zip(outputs, sizes)).to(first.dtype)
        return torch.cat(list(outputs))
    if isinstance(first, Mapping):
        return type(first)({k: merge_outputs([o[k] for o in outputs], sizes) for k in first})
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        return type(first)(merge_outputs(parts, sizes) for parts in zip(*outputs))
    return list(outputs)


def detach_to_cpu(value: Any) -> Any:
    """A copy of ``value`` safe to broadcast: tensors detached and on the CPU."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return type(value)({k: detach_to_cpu(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(detach_to_cpu(v) for v in value)
    return value
