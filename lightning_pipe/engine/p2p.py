"""Point-to-point transfer of activations and gradients.

An activation message is a fixed-size ``int64`` header followed by one message per tensor, so a
stage may output any tensor or tuple of tensors and shapes and dtypes may change from one
micro-batch to the next (a short last batch, variable sequence length). Gradients need no header:
the receiver already knows the shapes, they are those of the activations it sent.

gloo matches messages by (source, tag), so headers and payloads use different tags and receives can
be posted ahead of time. NCCL ignores tags; there the receiver posts the payload only after reading
the header, everything stays in one order per direction of a pair (the schedule validator proves it),
and each direction has its own process group (``downward_group``) so that NCCL's rendezvous sends
cannot deadlock (:mod:`lightning_pipe.schedules.rendezvous`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

HEADER_SLOTS = 256

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}

ACTIVATION_HEADER_TAG = 0
ACTIVATION_TAG = 1
GRADIENT_TAG = 2
TAGS_PER_REPLICA = 3  # avgpipe: replica r uses tags 3r .. 3r+2, so replicas' messages never match each other


def replica_tag(tag: int, replica: int) -> int:
    """The tag of message kind ``tag`` for pipeline replica ``replica`` (avgpipe; 0 elsewhere)."""
    return tag + TAGS_PER_REPLICA * replica


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether the receiver should track gradients for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class Header:
    """What an activation message carries: its tensors' metadata and whether it was a tuple."""

    metas: tuple[TensorMeta, ...]
    is_tuple: bool

    @classmethod
    def of(cls, value: Tensor | tuple[Tensor, ...]) -> Header:
        tensors = value if isinstance(value, tuple) else (value,)
        metas = tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)
        return cls(metas, isinstance(value, tuple))

    def encode(self, device: torch.device) -> Tensor:
        slots = [int(self.is_tuple), len(self.metas)]
        for meta in self.metas:
            if meta.dtype not in _DTYPE_CODE:
                raise TypeError(f"pipeline activations of dtype {meta.dtype} are not supported.")
            slots += [_DTYPE_CODE[meta.dtype], int(meta.requires_grad), len(meta.shape), *meta.shape]
        if len(slots) > HEADER_SLOTS:
            raise ValueError(
                f"a stage output with {len(self.metas)} tensors does not fit the {HEADER_SLOTS}-slot "
                "message header; return fewer tensors (e.g. stack them) from the stage."
            )
        header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
        header[: len(slots)] = torch.tensor(slots, dtype=torch.int64)
        return header.to(device)

    @classmethod
    def decode(cls, header: Tensor) -> Header:
        slots = header.tolist()
        is_tuple, count = bool(slots[0]), slots[1]
        metas, i = [], 2
        for _ in range(count):
            code, requires_grad, ndim = slots[i : i + 3]
            shape = tuple(slots[i + 3 : i + 3 + ndim])
            metas.append(TensorMeta(shape, _DTYPES[code], bool(requires_grad)))
            i += 3 + ndim
        return cls(tuple(metas), is_tuple)


def is_differentiable(meta: TensorMeta) -> bool:
    """Whether a gradient flows back for this tensor (floating point and tracked)."""
    return meta.requires_grad and (meta.dtype.is_floating_point or meta.dtype.is_complex)


class Transport:
    """Sends and receives of one rank, addressed by global rank.

    Args:
        device: where received tensors are allocated.
        group: the process group (``None``: the default group).
        tagged: whether the backend matches messages by tag (gloo) so receives can be posted early.
        downward_group: a second process group of the same ranks, for messages to a lower rank
            (``None``: ``group`` carries both directions). On NCCL each process group has one
            communicator, and one stream, per pair of ranks, and a send completes only when its
            receive runs: with one group, a send queued in front of a receive from the same peer can
            wait forever for a peer doing the same (1F1B's steady state does). With one group per
            direction, a direction's messages only queue behind each other, in the order both sides
            agree on (proven for every schedule: :mod:`lightning_pipe.schedules.rendezvous`).
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None, tagged: bool = True,
                 downward_group: dist.ProcessGroup | None = None) -> None:
        self.device = device
        self.group = group
        self.tagged = tagged
        self.downward_group = downward_group
        self.rank = dist.get_rank() if downward_group is not None else -1

    def _tag(self, tag: int) -> int:
        return tag if self.tagged else 0

    def _group(self, src: int, dst: int) -> dist.ProcessGroup | None:
        return self.downward_group if self.downward_group is not None and dst < src else self.group

    def isend(self, tensor: Tensor, dst: int, tag: int) -> dist.Work:
        return dist.isend(tensor, dst, group=self._group(self.rank, dst), tag=self._tag(tag))

    def irecv(self, tensor: Tensor, src: int, tag: int) -> dist.Work:
        return dist.irecv(tensor, src, group=self._group(src, self.rank), tag=self._tag(tag))

    def send_activation(
        self, value: Tensor | tuple[Tensor, ...], dst: int, replica: int = 0
    ) -> list[tuple[dist.Work, Tensor]]:
        """Post the header and every tensor of ``value``; return requests with the buffers they use."""
        header = Header.of(value).encode(self.device)
        tensors = value if isinstance(value, tuple) else (value,)
        out = [(self.isend(header, dst, replica_tag(ACTIVATION_HEADER_TAG, replica)), header)]
        for tensor in tensors:
            buffer = tensor.detach().contiguous()
            out.append((self.isend(buffer, dst, replica_tag(ACTIVATION_TAG, replica)), buffer))
        return out

    def send_gradients(self, grads: Sequence[Tensor], dst: int, replica: int = 0) -> list[tuple[dist.Work, Tensor]]:
        out = []
        for grad in grads:
            buffer = grad.detach().contiguous()
            out.append((self.isend(buffer, dst, replica_tag(GRADIENT_TAG, replica)), buffer))
        return out

    def post_header(self, src: int, replica: int = 0) -> tuple[dist.Work, Tensor]:
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        return self.irecv(header, src, replica_tag(ACTIVATION_HEADER_TAG, replica)), header

    def post_payload(self, metas: Sequence[TensorMeta], src: int, tag: int) -> list[tuple[dist.Work, Tensor]]:
        out = []
        for meta in metas:
            buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            out.append((self.irecv(buffer, src, tag), buffer))
        return out
