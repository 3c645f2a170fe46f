"""The engine's two interfaces are ``typing.Protocol``s their implementations meet structurally:
:class:`MessageTransport` (the process group's, shared memory's and the in-process queues' transports) and
:class:`ScheduleRunner` (one device's executor, and the one-process pipeline)."""

from __future__ import annotations

import inspect
from collections import deque

import pytest
import torch

from lightning_pipe.engine import Executor, MessageTransport, ScheduleRunner, Transport, shm
from lightning_pipe.engine.local import LocalPipeline, LocalTransport

CPU = torch.device("cpu")


def _transports() -> list[object]:
    found: list[object] = [Transport(CPU), LocalTransport(0, {}, {})]
    if shm.available() is None:
        found.append(shm.SharedMemoryTransport(CPU, rank=0, peers={}, token="protocol-test"))
    return found


def _members(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


def _same_signature(implementation: object, protocol: type, name: str) -> None:
    want = inspect.signature(getattr(protocol, name))
    have = inspect.signature(getattr(type(implementation), name))
    assert [(p.name, p.default) for p in have.parameters.values()] == [(p.name, p.default) for p in want.parameters.values()], (
        f"{type(implementation).__name__}.{name}{have} differs from {protocol.__name__}.{name}{want}")


@pytest.mark.parametrize("transport", _transports(), ids=lambda t: type(t).__name__)
def test_transports_meet_the_protocol(transport: object) -> None:
    assert isinstance(transport, MessageTransport)
    for name in _members(MessageTransport):
        _same_signature(transport, MessageTransport, name)
    assert isinstance(transport.tagged, bool) and isinstance(transport.receives_ahead, bool)  # type: ignore[attr-defined]


@pytest.mark.parametrize("runner", [Executor(0, [0], [lambda x, g: x]), LocalPipeline(2)], ids=lambda r: type(r).__name__)
def test_runners_meet_the_protocol(runner: object) -> None:
    assert isinstance(runner, ScheduleRunner)
    _same_signature(runner, ScheduleRunner, "run")
    for name in ("current_weights", "finish", "abort"):
        assert list(inspect.signature(getattr(type(runner), name)).parameters) == ["self"]


def test_the_protocols_are_not_base_classes() -> None:
    assert MessageTransport not in type(LocalTransport(0, {}, deque())).__mro__
    assert ScheduleRunner not in LocalPipeline.__mro__
    assert not isinstance(object(), MessageTransport) and not isinstance(object(), ScheduleRunner)
