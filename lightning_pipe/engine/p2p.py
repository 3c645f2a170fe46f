"""Point-to-point transfer of activations and gradients.

An activation message is a fixed-size ``int64`` header followed by one message per tensor, so a
stage may output any tensor or tuple of tensors and shapes and dtypes may change from one
micro-batch to the next (a short last batch, variable sequence length). The header is left out when
the receiver knows the shapes already (:class:`ShapeCache`). Gradients need no header: the receiver
already knows the shapes, they are those of the activations it sent.

gloo matches messages by (source, tag), so headers and payloads use different tags and receives can
be posted ahead of time. NCCL ignores tags; there the receiver posts the payload only after reading
the header, everything stays in one order per channel (the schedule validator proves it), and each
channel, a direction of a pair and a message kind, has its own two-rank process group (:class:`ChannelGroups`)
so that NCCL's rendezvous sends cannot deadlock (:mod:`lightning_pipe.schedules.rendezvous`).

gloo puts a shorter message into a longer receive buffer without a word, so on gloo every
activation and gradient ends with a two-slot trailer, ``[micro-batch, bytes sent]``, copied onto the
end of its last tensor (one message, as before: a message of its own cost 10-30 % of a small step)
and checked by the receiver (:class:`MessageMismatchError` names both sides' view). A longer message
than the buffer aborts gloo's receiving process; the trailer cannot prevent that, only the schedule's
and the shape cache's agreement does. On NCCL a mismatched receive hangs or corrupts before any check
could run (the watchdog turns the hang into a timeout), so there is none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_leaves

from lightning_pipe.engine.watchdog import stream_ordered
from lightning_pipe.errors import MessageMismatchError, StageOutputError

HEADER_SLOTS = 256

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}

ACTIVATION_HEADER_TAG = 0
ACTIVATION_TAG = 1
GRADIENT_TAG = 2
TAGS_PER_LANE = 3  # lane l uses tags 3l .. 3l+2


#: the slots of the trailer that follows an activation's or gradient's tensors on gloo
TRAILER_SLOTS = 2


def lane_tag(tag: int, lane: int) -> int:
    """The tag of message kind ``tag`` on ``lane``.

    A lane is one link of the pipeline: a replica (avgpipe) and the virtual stage that sends. On a
    tagged transport each lane is its own queue, so the messages of two links between the same two
    ranks (interleaved 1F1B, the V placement, avgpipe's replicas) never take each other's receive
    buffers, even when a payload is posted late because its shape header was read late.
    """
    return tag + TAGS_PER_LANE * lane


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether the receiver should track gradients for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


#: Codes of :func:`flatten_activation`'s structure: a tensor, a ``None``, an ``nn.utils.rnn.PackedSequence`` (its four
#: fields follow); a count ``n >= 0`` is a tuple of ``n`` entries.
TENSOR, NONE, PACKED = -1, -2, -3


def flatten_activation(value: Any) -> tuple[tuple[Tensor, ...], tuple[int, ...]] | None:
    """The tensors of a stage output in order, and its structure in prefix order (:data:`TENSOR`,
    :data:`NONE`, or a tuple's length before its entries), or ``None`` if ``value`` holds anything else.
    Tuples and lists nest to any depth, so ``nn.LSTM``'s ``(output, (h, c))`` or a block's
    ``(hidden, None)`` crosses a stage boundary as it is; a list arrives as a tuple. A ``PackedSequence`` (an RNN's
    packed output) arrives as one, rebuilt from its fields."""
    tensors: list[Tensor] = []
    structure: list[int] = []

    def visit(item: Any) -> bool:
        if isinstance(item, Tensor):
            tensors.append(item)
            structure.append(TENSOR)
        elif item is None:
            structure.append(NONE)
        elif isinstance(item, PackedSequence):  # data, batch_sizes, sorted_indices, unsorted_indices
            structure.append(PACKED)
            return all(visit(entry) for entry in item)
        elif isinstance(item, (tuple, list)) and not hasattr(item, "_fields"):  # a namedtuple would lose its type
            structure.append(len(item))
            return all(visit(entry) for entry in item)
        else:
            return False
        return True

    return (tuple(tensors), tuple(structure)) if visit(value) and tensors else None


def rebuild_activation(tensors: Sequence[Tensor], structure: Sequence[int]) -> Any:
    """The inverse of :func:`flatten_activation`: ``tensors`` placed back into ``structure``."""
    remaining, codes = iter(tensors), iter(structure)

    def build() -> Any:
        code = next(codes)
        if code == TENSOR:
            return next(remaining)
        if code == NONE:
            return None
        if code == PACKED:
            data, batch_sizes, sorted_indices, unsorted_indices = (build() for _ in range(4))
            # an RNN reads batch_sizes on the host (pack_padded_sequence keeps it there)
            return PackedSequence(data, batch_sizes.cpu(), sorted_indices, unsorted_indices)
        return tuple(build() for _ in range(code))

    return build()


@dataclass(frozen=True)
class Header:
    """What an activation message carries: its tensors' metadata and the structure they came in
    (:func:`flatten_activation`)."""

    metas: tuple[TensorMeta, ...]
    structure: tuple[int, ...] = (TENSOR,)

    @classmethod
    def of(cls, value: Any) -> Header:
        flat = flatten_activation(value)
        if flat is None:
            raise TypeError(f"a stage output must be tensors in tuples or lists (or None), not {type(value).__name__}")
        return cls.of_flat(*flat)

    @classmethod
    def of_flat(cls, tensors: Sequence[Tensor], structure: tuple[int, ...]) -> Header:
        """The header of an output :func:`flatten_activation` already took apart."""
        return cls(tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors), structure)

    def rebuild(self, tensors: Sequence[Tensor]) -> Any:
        """The received ``tensors`` in the sender's structure."""
        return rebuild_activation(tensors, self.structure)

    def encode(self, device: torch.device) -> Tensor:
        slots = [len(self.structure), *self.structure, len(self.metas)]
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
        return host_to_device(header, device)

    @classmethod
    def decode(cls, header: Tensor) -> Header:
        slots = header.tolist()
        length = slots[0]
        structure = tuple(slots[1 : 1 + length])
        count, i = slots[1 + length], 2 + length
        metas = []
        for _ in range(count):
            code, requires_grad, ndim = slots[i : i + 3]
            shape = tuple(slots[i + 3 : i + 3 + ndim])
            metas.append(TensorMeta(shape, _DTYPES[code], bool(requires_grad)))
            i += 3 + ndim
        return cls(tuple(metas), structure)


def signature(micro_batch: Any) -> tuple[Any, ...]:
    """What a micro-batch's activations' shapes are assumed to depend on: every tensor's shape and
    dtype, and the value of every other plain leaf (an int sequence length, a flag)."""
    out: list[Any] = []
    for leaf in tree_leaves(micro_batch):
        if isinstance(leaf, Tensor):
            out.append((tuple(leaf.shape), leaf.dtype))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            out.append(leaf)
        else:
            out.append(type(leaf).__name__)
    return tuple(out)


class ShapeCache:
    """Which activations need a shape header, decided alike by sender and receiver with no message.

    A channel (one pair of neighbouring virtual stages of one replica) carries a header with its first
    activation after :meth:`reset` and whenever the micro-batch's :func:`signature` differs from that
    of the channel's previous activation: sender and receiver both hold every micro-batch and decide
    in the channel's order, so they agree. A short last batch or a new sequence length changes the
    signature; a stage whose output shapes change although its inputs' did not (data-dependent
    shapes) is caught on the sender (:meth:`check`), which asks for ``shape_headers="always"``.

    Args:
        always: every activation carries its header (``PipeStrategy(shape_headers="always")``).
    """

    def __init__(self, always: bool = False) -> None:
        self.always = always
        self._signatures: dict[Any, tuple[Any, ...]] = {}
        self._headers: dict[Any, Header] = {}  # the last header read (receiver) or sent (sender)
        self._unread: dict[Any, int] = {}  # headers announced on the channel and not read yet

    def reset(self) -> None:
        """Forget every channel (where sender and receiver both are between messages: a flush)."""
        self._signatures.clear()
        self._headers.clear()
        self._unread.clear()

    def needs_header(self, channel: Any, micro_batch: Any) -> bool:
        """Decide for the channel's next activation (call once per message, in the channel's order)."""
        key = signature(micro_batch)
        needed = self.always or self._signatures.get(channel) != key
        self._signatures[channel] = key
        if needed:
            self._unread[channel] = self._unread.get(channel, 0) + 1
        return needed

    def header(self, channel: Any) -> Header | None:
        """The shapes the channel's activations without a header have (``None``: not read yet).

        While a header announced on the channel is unread, an earlier one that is read meanwhile
        does not describe the messages after the unread one: receives post ahead of the reads, so
        two headers can be in flight on one channel (micro-batches of 6, 5 and 5 samples).
        """
        return None if self._unread.get(channel, 0) else self._headers.get(channel)

    def remember(self, channel: Any, header: Header) -> None:
        """After a header was sent or read on ``channel`` (headers are read in the channel's order)."""
        self._unread[channel] -= 1
        self._headers[channel] = header

    @staticmethod
    def check(known: Header | None, actual: Header, where: str) -> None:
        """The sender's check that the shapes it does not announce are those the receiver assumes."""
        if known != actual:
            before = [m.shape for m in known.metas] if known is not None else "unknown shapes"
            why = ("It returns a PackedSequence, whose data's length depends on the sequences' lengths: use"
                   if PACKED in actual.structure else "If its output shapes depend on the data, use")
            raise StageOutputError(
                f"{where} returned shapes {[m.shape for m in actual.metas]} after {before} for micro-batches "
                f"whose inputs have the same shapes, so its next stage would assume the old ones. {why} "
                "PipeStrategy(shape_headers=\"always\")."
            )


def host_to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` (a small CPU tensor, e.g. a header) on ``device``, without blocking the host on a CUDA device.

    From pageable memory, ``.to(cuda)`` synchronises: the driver stages the bytes and the host waits.
    From pinned memory with ``non_blocking=True`` the copy is queued on the current stream and the host
    goes on. The pinned buffer is new for every call and comes from torch's caching host allocator,
    which records an event on the copy's stream and hands the block out again only once that event has
    passed: the buffer is not reused (or written) before the copy ends, although this function drops
    its last reference at once. The copy is ordered before any later work of the stream (the send
    that carries the header), so the device tensor is complete when it is read."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def is_differentiable(meta: TensorMeta) -> bool:
    """Whether a gradient flows back for this tensor (floating point and tracked)."""
    return meta.requires_grad and (meta.dtype.is_floating_point or meta.dtype.is_complex)


@dataclass(frozen=True)
class ChannelGroups:
    """One two-rank process group per channel, a direction of a pair of neighbours and a message kind,
    for untagged backends (NCCL).

    A send on NCCL completes only when its receive runs, and the operations a rank issues on one
    communicator run in issue order on one stream. A process group is one communicator, whose stream a
    rank shares among all its peers in that group (Lightning passes ``device_id``, so groups initialise
    eagerly); with one group for every message, a send queued in front of a receive from the same peer
    can wait forever for a peer doing the same (1F1B's steady state does), and with one group per
    direction and kind over all ranks, a receive from the previous stage queued in front of a send to
    the next one can still wait for a stage that waits in turn (avgpipe's rounds do: the proof in
    :mod:`lightning_pipe.schedules.rendezvous` with ``communicators="group"`` finds it). A group of two
    ranks per channel leaves each channel's messages one order of their own, which both sides agree
    on, and the proof (``streams="channel"``) holds for every schedule. No point-to-point message shares
    the default group with collectives (the per-step broadcast, the stage-metrics gather, Lightning's
    barriers), which run on communicators of their own.

    Neighbours are those of a ring (stage ``s`` and ``s + 1``, and the last stage and the first, which an
    interleaved schedule's loop joins), in every pipeline.
    """

    groups: dict[tuple[int, int, str], Any] = field(default_factory=dict)  # (src, dst, kind): this rank's groups

    @classmethod
    def create(cls, timeout: timedelta | None = None, stages: int | None = None, pipelines: int = 1) -> ChannelGroups:
        """The groups of every channel of ``pipelines`` pipelines of ``stages`` ranks each (default: one
        pipeline of every rank); every rank must call this, in the same order. ``timeout``: the strategy's
        (``None``: the backend's default, 10 minutes on NCCL, whose watchdog then kills a longer wait
        without a :class:`~lightning_pipe.errors.PeerFailure` report)."""
        stages = dist.get_world_size() // pipelines if stages is None else stages
        me, groups = dist.get_rank(), {}
        for p in range(pipelines):
            for a, b in ring_pairs(stages):
                low, high = p * stages + a, p * stages + b
                for src, dst in ((low, high), (high, low)):
                    for kind in ("activation", "gradient"):
                        group = dist.new_group([low, high], timeout=timeout)  # every rank calls it: torch's rule
                        if me in (low, high):
                            groups[(src, dst, kind)] = group
        return cls(groups)

    def pick(self, src: int, dst: int, gradient: bool) -> Any:
        """The group of a message from ``src`` to ``dst``, of gradients or activations."""
        try:
            return self.groups[(src, dst, "gradient" if gradient else "activation")]
        except KeyError:
            raise ValueError(f"no point-to-point channel from rank {src} to rank {dst}: only ring neighbours of "
                             "one pipeline exchange messages") from None


def ring_pairs(stages: int) -> list[tuple[int, int]]:
    """The neighbouring stages of a pipeline, ``(lower, higher)``, once each: a ring's edges."""
    pairs = {(min(s, (s + 1) % stages), max(s, (s + 1) % stages)) for s in range(stages)} if stages > 1 else set()
    return sorted(pairs)


@runtime_checkable
class MessageTransport(Protocol):
    """What an :class:`~.executor.Executor` needs to exchange activations and gradients with its peers.

    :class:`Transport` (``torch.distributed``), :class:`~.shm.SharedMemoryTransport` and
    :class:`~.local.LocalTransport` (in-process queues) conform structurally; none needs to subclass this.
    Every returned request has ``wait()``; peers are addressed by global rank (by device index in one process).
    """

    #: whether the backend matches messages by tag, so receives of different kinds may be posted in any order
    tagged: bool
    #: whether receives may be posted before the compute action that needs them
    receives_ahead: bool

    def send_activation(self, value: Tensor | tuple[Tensor, ...], dst: int, lane: int = 0, header: bool = True,
                        micro_batch: int = -1) -> list[tuple[Any, Tensor]]:
        """Send ``value`` (with its shape header unless ``header=False``); requests with the buffers they use."""
        ...

    def send_gradients(self, grads: Sequence[Tensor], dst: int, lane: int = 0, micro_batch: int = -1,
                       ) -> list[tuple[Any, Tensor]]:
        """Send the gradients of a received activation back to ``dst``."""
        ...

    def post_header(self, src: int, lane: int = 0) -> tuple[Any, Tensor]:
        """Post the receive of an activation's shape header."""
        ...

    def post_payload(self, metas: Sequence[TensorMeta], src: int, tag: int, micro_batch: int = -1,
                     ) -> list[tuple[Any, Tensor]]:
        """Post a receive per tensor of ``metas``; requests with the buffers the tensors arrive in."""
        ...


class Transport:
    """Sends and receives of one rank, addressed by global rank, through ``torch.distributed``
    (a :class:`MessageTransport`).

    Args:
        device: where received tensors are allocated.
        group: the process group (``None``: the default group).
        tagged: whether the backend matches messages by tag (gloo) so receives can be posted early.
        channels: a process group per channel (:class:`ChannelGroups`; untagged backends, i.e. NCCL);
            ``None``: ``group`` carries every message.
    """

    receives_ahead = True  # receives may be posted before the compute that needs them

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None, tagged: bool = True,
                 channels: ChannelGroups | None = None) -> None:
        self.device = device
        self.group = group
        self.tagged = tagged
        self.channels = channels
        self.rank = dist.get_rank() if channels is not None else -1
        #: NCCL: waits make the CUDA stream wait, not the host (:func:`~.watchdog.stream_ordered`)
        self.stream_ordered = stream_ordered(device, tagged)

    def _tag(self, tag: int) -> int:
        return tag if self.tagged else 0

    def _group(self, src: int, dst: int, tag: int) -> dist.ProcessGroup | None:
        if self.channels is None:
            return self.group
        return self.channels.pick(src, dst, gradient=tag % TAGS_PER_LANE == GRADIENT_TAG)

    def isend(self, tensor: Tensor, dst: int, tag: int) -> dist.Work:
        return dist.isend(tensor, dst, group=self._group(self.rank, dst, tag), tag=self._tag(tag))

    def irecv(self, tensor: Tensor, src: int, tag: int) -> dist.Work:
        return dist.irecv(tensor, src, group=self._group(src, self.rank, tag), tag=self._tag(tag))

    def checks_sizes(self, peer: int, tensor: Tensor) -> bool:
        """Whether messages to or from ``peer`` like ``tensor`` carry a size trailer (gloo: CPU tensors on
        a tagged backend; a transport that checks sizes itself says ``False``)."""
        return self.tagged and tensor.device.type == "cpu"

    def _send_tensors(self, tensors: Sequence[Tensor], dst: int, tag: int, micro_batch: int) -> list[tuple[dist.Work, Tensor]]:
        buffers = [tensor.detach().contiguous() for tensor in tensors]
        if buffers and self.checks_sizes(dst, buffers[-1]):  # the trailer rides on the last tensor: no extra message
            sent = sum(b.numel() * b.element_size() for b in buffers)
            trailer = torch.tensor([micro_batch, sent], dtype=torch.int64)
            buffers[-1] = torch.cat([_bytes_of(buffers[-1]), _bytes_of(trailer)])
        return [(self.isend(buffer, dst, tag), buffer) for buffer in buffers]

    def send_activation(
        self, value: Any, dst: int, lane: int = 0, header: bool = True, micro_batch: int = -1,
    ) -> list[tuple[dist.Work, Tensor]]:
        """Post the header (unless the receiver knows the shapes: ``header=False``) and every tensor of
        ``value`` (of ``micro_batch``, which a size trailer names) on ``lane`` (:func:`lane_tag`); return
        requests with the buffers they use."""
        flat = flatten_activation(value)
        assert flat is not None, "stage outputs are checked before they are sent"
        tensors = flat[0]
        out = []
        if header:
            encoded = Header.of_flat(*flat).encode(self.device)
            out.append((self.isend(encoded, dst, lane_tag(ACTIVATION_HEADER_TAG, lane)), encoded))
        return out + self._send_tensors(tensors, dst, lane_tag(ACTIVATION_TAG, lane), micro_batch)

    def send_gradients(self, grads: Sequence[Tensor], dst: int, lane: int = 0, micro_batch: int = -1,
                       ) -> list[tuple[dist.Work, Tensor]]:
        return self._send_tensors(grads, dst, lane_tag(GRADIENT_TAG, lane), micro_batch)

    def post_header(self, src: int, lane: int = 0) -> tuple[dist.Work, Tensor]:
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        return self.irecv(header, src, lane_tag(ACTIVATION_HEADER_TAG, lane)), header

    def post_payload(self, metas: Sequence[TensorMeta], src: int, tag: int, micro_batch: int = -1,
                     ) -> list[tuple[Any, Tensor]]:
        """Post a receive per tensor of ``metas`` (of ``micro_batch``); with a size trailer, waiting for
        the last one checks that the sender sent that micro-batch and that many bytes."""
        out: list[tuple[Any, Tensor]] = []
        for meta in metas[:-1]:
            buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            out.append((self.irecv(buffer, src, tag), buffer))
        if not metas:
            return out
        last = metas[-1]
        buffer = torch.empty(last.shape, dtype=last.dtype, device=self.device)
        if not self.checks_sizes(src, buffer):
            return out + [(self.irecv(buffer, src, tag), buffer)]
        size = buffer.numel() * buffer.element_size()
        raw = torch.empty(size + 8 * TRAILER_SLOTS, dtype=torch.uint8)
        trailer = raw[size:].view(torch.int64)
        trailer.fill_(-1)  # what a shorter message leaves here
        expected = (micro_batch, sum(b.numel() * b.element_size() for _, b in out) + size)
        work = _CheckedReceive(self.irecv(raw, src, tag), trailer, expected, src)
        out.append((work, raw[:size].view(last.dtype).view(last.shape)))
        return out


def _bytes_of(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class _CheckedReceive:
    """The last tensor's receive, with the trailer at its end: waiting for it checks what the sender sent."""

    work: Any
    trailer: Tensor
    expected: tuple[int, int]  # (micro-batch, bytes)
    src: int

    def wait(self, *timeout: Any) -> bool:
        self.work.wait(*timeout)
        micro_batch, sent = (int(v) for v in self.trailer)
        if (micro_batch, sent) == (-1, -1):
            raise MessageMismatchError(f"rank {self.src} sent fewer than the {self.expected[1]} bytes of micro-batch "
                                       f"{self.expected[0]} that were expected")
        if (micro_batch, sent) != self.expected:
            raise MessageMismatchError(
                f"rank {self.src} sent {sent} bytes of micro-batch {micro_batch} where {self.expected[1]} bytes of "
                f"micro-batch {self.expected[0]} were expected"
            )
        return True
