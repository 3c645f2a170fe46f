"""The watchdog's report listener ends with the run: ``close`` returns only once the listener thread
has, so no thread is left inside the store's C++ client when the interpreter shuts down (a listener
woken there aborted finished runs with "terminate called without an active exception")."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from lightning_pipe.engine.watchdog import Watchdog


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_close_returns_after_the_listener_thread_ended():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    for generation in range(5):  # a race: try it several times
        watchdog = Watchdog(timeout=10.0, store=store, rank=0, generation=generation)
        watchdog.listen(world_size=2)
        assert watchdog._listener is not None and watchdog._listener.is_alive()
        watchdog.close()
        assert not watchdog._listener.is_alive()
        assert watchdog.heard is None  # its own stop message is not a report
