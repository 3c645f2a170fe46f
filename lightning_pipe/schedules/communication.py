"""Insert the point-to-point communication that compute actions imply.

A forward on virtual stage ``vs > 0`` first receives its input from ``vs - 1``; a forward on any but
the last virtual stage sends its output to ``vs + 1``. Backwards mirror this with gradients (the
backward that takes the gradient: ``B``, or ``I`` of a split one; ``W`` talks to nobody).
Receives sit right before the compute that needs them and sends right after the compute that
produced them; the executor posts receives early, so this placement still overlaps transfer with
compute. Neighbouring virtual stages on the same device (the turn of ZBV's V) hand over in memory,
without messages.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_pipe.schedules.ir import Action, Kind, Placement, locate_virtual_stage, virtual_stage_of


def with_communication(
    compute: Iterable[Action], device: int, stages: int, chunks: int, placement: Placement = "loop"
) -> tuple[Action, ...]:
    """Return ``compute`` with RECV/SEND actions inserted for ``device``."""
    last = stages * chunks - 1

    def remote(vs: int) -> bool:
        return 0 <= vs <= last and locate_virtual_stage(vs, stages, placement)[0] != device

    out: list[Action] = []
    for action in compute:
        vs = virtual_stage_of(device, action.chunk, stages, placement)
        mb, chunk, r = action.micro_batch, action.chunk, action.replica
        if action.kind is Kind.FORWARD:
            if remote(vs - 1):
                out.append(Action(Kind.RECV_ACTIVATION, mb, chunk, r))
            out.append(action)
            if remote(vs + 1):
                out.append(Action(Kind.SEND_ACTIVATION, mb, chunk, r))
        elif action.kind.takes_gradient:
            if remote(vs + 1):
                out.append(Action(Kind.RECV_GRADIENT, mb, chunk, r))
            out.append(action)
            if remote(vs - 1):
                out.append(Action(Kind.SEND_GRADIENT, mb, chunk, r))
        else:
            out.append(action)
    return tuple(out)


def peer(kind: Kind, device: int, chunk: int, stages: int, placement: Placement = "loop") -> tuple[int, int]:
    """``(peer_device, peer_chunk)`` that a communication action talks to."""
    vs = virtual_stage_of(device, chunk, stages, placement)
    other = vs - 1 if kind in (Kind.RECV_ACTIVATION, Kind.SEND_GRADIENT) else vs + 1
    return locate_virtual_stage(other, stages, placement)
