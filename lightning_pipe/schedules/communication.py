"""Insert the point-to-point communication that compute actions imply.

A forward on virtual stage ``vs > 0`` first receives its input from ``vs - 1``; a forward on any but
the last virtual stage sends its output to ``vs + 1``. Backwards mirror this with gradients.
Receives sit right before the compute that needs them and sends right after the compute that
produced them; the executor posts receives early, so this placement still overlaps transfer with
compute.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_pipe.schedules.ir import Action, Kind


def with_communication(
    compute: Iterable[Action], device: int, stages: int, chunks: int
) -> tuple[Action, ...]:
    """Return ``compute`` with RECV/SEND actions inserted for ``device``."""
    last = stages * chunks - 1
    out: list[Action] = []
    for action in compute:
        vs = action.chunk * stages + device
        mb, chunk, r = action.micro_batch, action.chunk, action.replica
        if action.kind is Kind.FORWARD:
            if vs > 0:
                out.append(Action(Kind.RECV_ACTIVATION, mb, chunk, r))
            out.append(action)
            if vs < last:
                out.append(Action(Kind.SEND_ACTIVATION, mb, chunk, r))
        elif action.kind is Kind.BACKWARD:
            if vs < last:
                out.append(Action(Kind.RECV_GRADIENT, mb, chunk, r))
            out.append(action)
            if vs > 0:
                out.append(Action(Kind.SEND_GRADIENT, mb, chunk, r))
        else:
            out.append(action)
    return tuple(out)


def peer(kind: Kind, device: int, chunk: int, stages: int) -> tuple[int, int]:
    """``(peer_device, peer_chunk)`` that a communication action talks to."""
    vs = chunk * stages + device
    other = vs - 1 if kind in (Kind.RECV_ACTIVATION, Kind.SEND_GRADIENT) else vs + 1
    return other % stages, other // stages
