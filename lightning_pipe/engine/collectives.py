"""All-reducing lists of tensors: flattened into few messages.

:func:`all_reduce_flat` (one message per dtype) serves parameters that several
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


def plan_buckets(params: Sequence[Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indexes of ``params`` in buckets of one dtype and about ``bucket_bytes``, in launch order.

    Made from the parameters alone (their order, dtypes and sizes), never from which of them have a
    gradient, so every replica of a stage makes the same buckets. Reverse order: a backward usually
    finishes the last parameters first, so the first bucket fills first."""
    buckets: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for index in reversed(range(len(params))):
        p = params[index]
        bucket, size = open_.get(p.dtype, ([], 0))
        bucket.append(index)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            open_.pop(p.dtype, None)
            buckets.append(bucket)
        else:
            open_[p.dtype] = (bucket, size)
    buckets.extend(bucket for bucket, _ in open_.values())
    return buckets


class GradientReducer:
    """Averages gradients over ``group`` while the backward that finishes them still runs.

    Inside :meth:`armed` (the last backward of a step on this rank: every gradient it touches is final
    once accumulated) each parameter's hook marks it ready; a bucket whose parameters are all ready is
    flattened and its all-reduce started at once, so communication overlaps the rest of the backward
    and of the step. :meth:`finish` reduces the buckets not launched yet, waits for everything and
    writes the averages into the parameters' gradients, wherever those have moved meanwhile (the
    strategy keeps them from Lightning's ``zero_grad``: the write goes to ``p.grad`` at :meth:`finish`
    time).

    Every replica reduces the same tensors in the same order (issue 30, hazard 8): with data-dependent
    unused parameters (MoE routing) the replicas' gradients differ in which exist, and all-reduces of
    different sizes or orders would hang or mix unrelated tensors. So the buckets are fixed from the
    parameters (:func:`plan_buckets`) and launched in their order; a parameter without a gradient
    here contributes zeros, and every bucket carries one "used" flag per parameter. After the
    reduction, a parameter some replica used gets the average (its missing share counted as zero, as
    one device over the whole batch would count it); one no replica used keeps ``grad=None``, as on
    one device (an optimizer skips it).

    Args:
        params: the parameters to reduce (the same list, in the same order, on every member).
        group: the data-parallel group (the same stage of every pipeline).
        members: its size (the average divides by it).
        bucket_bytes: flatten and launch once a bucket holds this many bytes (DDP's default: 25 MiB).
    """

    def __init__(self, params: Sequence[Tensor], group: Any, members: int, bucket_bytes: int = 25 * 2**20) -> None:
        self.params = list(params)
        self.group = group
        self.members = members
        self.bucket_bytes = bucket_bytes
        self.buckets = plan_buckets(self.params, bucket_bytes)
        self._bucket_of = {id(self.params[i]): b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._reset()

    def _reset(self) -> None:
        self._waiting = [len(bucket) for bucket in self.buckets]  # parameters not ready yet, per bucket
        self._next = 0  # the next bucket to launch: buckets launch in order, the same on every member
        self._launched: list[tuple[Any, Tensor, int, bool]] = []  # (work, flat buffer, bucket, all had a gradient)
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
        self._waiting[self._bucket_of[id(param)]] -= 1
        while self._next < len(self.buckets) and self._waiting[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        bucket = [self.params[i] for i in self.buckets[index]]
        first = bucket[0]
        one = torch.ones(1, dtype=first.dtype, device=first.device)
        zero = torch.zeros(1, dtype=first.dtype, device=first.device)
        # a copy: the gradients may move meanwhile; zeros stand in for a gradient this replica lacks
        parts = [p.grad.reshape(-1) if p.grad is not None else zero.expand(p.numel()) for p in bucket]
        flags = [one if p.grad is not None else zero for p in bucket]  # how many replicas used each parameter
        flat = torch.cat(parts + flags)
        complete = all(p.grad is not None for p in bucket)
        self._launched.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, index, complete))

    def finish(self) -> None:
        """Reduce what is left, wait, and write every average into ``p.grad``."""
        for index in range(self._next, len(self.buckets)):
            self._launch(index)
        for work, flat, index, complete in self._launched:
            work.wait()
            bucket = [self.params[i] for i in self.buckets[index]]
            flat.div_(self.members)
            *averages, flags = flat.split([p.numel() for p in bucket] + [len(bucket)])
            # the flags are read on the host only where this replica lacked a gradient (a synchronisation
            # on a GPU): where it had every one, every parameter was used
            used = [True] * len(bucket) if complete else [bool(f) for f in flags.tolist()]
            for p, average, was_used in zip(bucket, averages, used):
                if not was_used:
                    p.grad = None
                elif p.grad is None:
                    p.grad = average.view_as(p).clone()
                else:
                    p.grad.copy_(average.view_as(p.grad))
        self._reset()
