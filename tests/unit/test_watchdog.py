"""The watchdog's report listener ends with the run: ``close`` returns only once the listener thread
has, so no thread is left inside the store's C++ client when the interpreter shuts down (a listener
woken there aborted finished runs with "terminate called without an active exception")."""

from __future__ import annotations

import socket
import threading
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
        before = set(threading.enumerate())
        watchdog.listen(world_size=2)
        started = [t for t in threading.enumerate() if t not in before]  # what listen started: the listener
        assert len(started) == 1 and started[0].is_alive()
        watchdog.close()
        assert not started[0].is_alive()  # joined, not merely told to stop
        assert watchdog.heard is None  # its own stop message is not a report


class _GoneStore:
    """A store whose host has gone: every request fails."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection closed by peer")
        return fail


def test_a_rank_whose_report_is_the_first_knows_it_without_asking_the_store():
    """The failing rank itself does not wait for a peer's report (its listener never hears its own),
    nor look in a store that may be going down with it: it knows its report is the job's first."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    failing = Watchdog(timeout=10.0, store=store, rank=0, generation=0)
    failing.listen(world_size=2)
    failing.report(ZeroDivisionError("boom"))
    failing.close()
    failing.store = _GoneStore()
    assert failing.peer_error(wait=3.0) == "rank 0 raised ZeroDivisionError: boom"


def test_a_rank_reporting_after_a_peer_does_not_claim_the_first_report():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    Watchdog(timeout=10.0, store=store, rank=1, generation=0).report(ValueError("first"))
    later = Watchdog(timeout=10.0, store=store, rank=0, generation=0)
    later.report(ZeroDivisionError("second"))
    assert later.reported_first is None
    assert later.peer_error(wait=0.0) == "rank 1 raised ValueError: first"


def test_a_report_names_ctrl_c_as_an_interruption_not_an_empty_error():
    """Ctrl-C on a 2-process run printed ``rank 1 failed (KeyboardInterrupt: ) after rank 0 raised KeyboardInterrupt: ``,
    as if one rank's failure had brought the other down; the strategy no longer prints that line for Ctrl-C (which
    reaches every rank of a terminal), and a peer on another node reads that rank 0 was interrupted."""
    from lightning_pipe.engine.watchdog import describe

    assert describe(KeyboardInterrupt()) == "was interrupted (KeyboardInterrupt)"
    assert describe(RuntimeError()) == "raised RuntimeError"
    assert describe(ValueError("bad shape")) == "raised ValueError: bad shape"
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    Watchdog(timeout=10.0, store=store, rank=0, generation=0).report(KeyboardInterrupt())
    peer = Watchdog(timeout=10.0, store=store, rank=1, generation=0)
    assert peer.peer_error(wait=0.0) == "rank 0 was interrupted (KeyboardInterrupt)"
