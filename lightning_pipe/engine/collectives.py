"""All-reducing lists of tensors: flattened into few messages.

:func:`all_reduce_flat` (one message per dtype) serves avgpipe's replicas and parameters that several
stages of one pipeline share (a tied embedding). :class:`GradientReducer` averages a synchronous
schedule's gradients across data-parallel pipelines while the step's last backward still runs,
bucket by bucket, as PyTorch's DDP reducer does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _by_dtype(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """``tensors`` grouped by dtype (one flat message each), in first-seen order."""
    groups: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


def _unflatten_into(flat: Tensor, targets: Sequence[Tensor]) -> None:
    """Copy consecutive parts of ``flat`` into ``targets`` (the inverse of their ``torch.cat``)."""
    for target, part in zip(targets, flat.split([t.numel() for t in targets])):
        target.copy_(part.view_as(target))


def all_reduce_flat(tensors: Sequence[Tensor], group: Any, scale: float | None = None) -> None:
    """Sum ``tensors`` in place over ``group`` (one flattened message per dtype), then multiply by
    ``scale`` if given (``1 / members`` makes it a mean)."""
    for same in _by_dtype(tensors):
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        if scale is not None:
            flat.mul_(scale)
        _unflatten_into(flat, same)


class GradientReducer:
    """Averages gradients over ``group`` while the backward that finishes them still runs.

    Inside :meth:`armed` (the last backward of a step on this rank: every gradient it touches is final
    once accumulated) each parameter's hook files its gradient into a bucket; a full bucket is
    flattened and its all-reduce started at once, so communication overlaps the rest of the backward
    and of the step. :meth:`finish` reduces what no hook filed (parameters the last backward did not
    reach) in one more bucket, waits for everything and writes the averages into the parameters'
    gradients, wherever those have moved meanwhile (the strategy keeps them from Lightning's
    ``zero_grad``: the write goes to ``p.grad`` at :meth:`finish` time).

    Args:
        params: the parameters to reduce (those with a gradient at :meth:`finish`).
        group: the data-parallel group (the same stage of every pipeline).
        members: its size (the average divides by it).
        bucket_bytes: flatten and launch once a bucket holds this many bytes (DDP's default: 25 MiB).
    """

    def __init__(self, params: Sequence[Tensor], group: Any, members: int, bucket_bytes: int = 25 * 2**20) -> None:
        self.params = list(params)
        self.group = group
        self.members = members
        self.bucket_bytes = bucket_bytes
        self._filling: dict[torch.dtype, tuple[list[Tensor], int]] = {}  # parameters and their gradients' bytes
        self._launched: list[tuple[Any, Tensor, list[Tensor]]] = []  # (work, flat buffer, its parameters)
        self._filed: set[int] = set()

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Within the block, every gradient accumulated is final: file it."""
        handles = [p.register_post_accumulate_grad_hook(self._file) for p in self.params]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _file(self, param: Tensor) -> None:
        if id(param) in self._filed or param.grad is None:
            return
        self._filed.add(id(param))
        bucket, size = self._filling.get(param.dtype, ([], 0))
        bucket.append(param)
        size += param.grad.numel() * param.grad.element_size()
        if size >= self.bucket_bytes:
            self._filling.pop(param.dtype, None)
            self._launch(bucket)
        else:
            self._filling[param.dtype] = (bucket, size)

    def _launch(self, bucket: list[Tensor]) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # a copy: the gradients may move meanwhile
        self._launched.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket))

    def finish(self) -> None:
        """Reduce what is left, wait, and write every average into ``p.grad``."""
        for bucket, _ in self._filling.values():
            self._launch(bucket)
        self._filling = {}
        for bucket in _by_dtype([p for p in self.params if id(p) not in self._filed and p.grad is not None]):
            self._launch(bucket)
        for work, flat, bucket in self._launched:
            work.wait()
            _unflatten_into(flat.div_(self.members), [p.grad for p in bucket])
        self._launched, self._filed = [], set()
