"""Turning a failed, hung or killed peer into a clear error on every rank, and ending stragglers.

gloo receives block until the peer sends, and ``Work.is_completed()`` stays ``False`` until
``wait()`` is called, so the engine waits with blocking ``wait(timeout)`` (no polling overhead) and
relies on three facts (docs/failures.md):

* a process that dies closes its connections, which fails its peers' pending waits at once;
* every wait for a peer is bounded by ``timeout`` (a hung peer becomes :class:`PipelineTimeout`);
* before a rank dies it writes its error into the job's key-value store, so its peers raise
  :class:`PeerFailure` with the original message instead of "connection closed".

The store lives in global rank 0's process, so it dies with a failing rank 0, at the moment that
rank's connections close and its peers look for its report. Every rank therefore also listens for
reports as they are made (:meth:`Watchdog.listen`: a thread blocked on its own store connection),
and a failing rank 0 waits, briefly and bounded, until its listening peers heard it. Every access
to the store is bounded (a daemon thread with a deadline), so a rank 0 that hangs cannot hang the
ranks that check for its report. A rank that
gives up ends the peers on its host that are still alive after a grace period (:meth:`end_stragglers`):
a hung rank does not outlive the job.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_pipe.errors import LightningPipeError, PeerFailure, PipelineTimeout

_ERROR_KEY = "lightning_pipe/error"
_STOP = b"\0stop"  # what a listener's own rank pushes into its inbox to end it
#: Seconds a failing job gives its ranks to end on their own before the survivors are ended.
FAILURE_GRACE = 5.0
#: Seconds the key-value store may take to answer one request before its host counts as hung.
STORE_PATIENCE = 1.0
#: Seconds a listening rank waits for a report to arrive (a report reaches live listeners in milliseconds).
LISTENER_PATIENCE = 0.5
T = TypeVar("T")


def _bounded(fn: Callable[[], T], seconds: float) -> tuple[bool, T | None]:
    """``(True, fn())`` if ``fn`` returns within ``seconds``, else ``(False, None)`` (it may still be
    running, in a daemon thread that does not keep the process alive)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception:  # a store that is gone counts as no answer
            box.append(None)

    thread = threading.Thread(target=run, daemon=True, name="lightning-pipe-store")
    thread.start()
    thread.join(seconds)
    return (True, box[0]) if box else (False, None)


def describe(error: BaseException) -> str:
    """How a report names ``error``: ``raised ValueError: bad shape``; Ctrl-C (a ``KeyboardInterrupt``, which has no
    message) as ``was interrupted (KeyboardInterrupt)``."""
    if isinstance(error, KeyboardInterrupt):
        return f"was interrupted ({type(error).__name__})"
    return f"raised {type(error).__name__}: {error}" if str(error) else f"raised {type(error).__name__}"


class Watchdog:
    """Waits on requests and explains their failures.

    Args:
        timeout: seconds a single wait for a peer may take.
        store: the job's key-value store (``None``: no cross-rank error reports).
        rank: this process's global rank (used in reports).
        generation: separates the reports of consecutive runs that share one store.
        grace: seconds to wait for a failed peer's report after a connection error (when this rank does
            not listen for reports, :meth:`listen`), and for a peer to
            exit on its own before :meth:`end_stragglers` ends it.
        peers: ``(hostname, pid)`` of every global rank (:meth:`learn_peers`), for ending stragglers.
    """

    def __init__(
        self, timeout: float, store: Any | None = None, rank: int = 0, generation: int = 0, grace: float = 3.0,
    ) -> None:
        self.timeout = timeout
        self.store = store
        self.rank = rank
        self.key = f"{_ERROR_KEY}/{generation}"
        self.grace = grace
        self.peers: list[tuple[str, int]] = []
        self.store_silent = False  # the store did not answer once: rank 0 is hung or gone, do not wait again
        self.heard: str | None = None  # the first report the listener received
        self._listening = False
        self._listener: threading.Thread | None = None
        self.world_size = 1  # known once listening
        self.reported = False
        self.reported_first: str | None = None  # this rank's report, when it is the job's first
        #: the option and seconds that bound a collective now, when not ``timeout``: during start-up the
        #: groups wait ``startup_timeout`` (lightning/startup.py), and a timed-out collective names it
        self.collective_bound: tuple[str, float] | None = None

    @classmethod
    def from_process_group(cls, timeout: float, generation: int = 0) -> Watchdog:
        """A watchdog on the default process group's store."""
        if not dist.is_initialized():
            return cls(timeout)
        return cls(timeout, dist.distributed_c10d._get_default_store(), dist.get_rank(), generation)

    def learn_peers(self) -> None:
        """Collective: learn every rank's host and process id (while every rank is healthy)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            peers: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
            self.peers = peers

    def listen(self, world_size: int) -> None:
        """Start receiving the other ranks' reports as they are made, on a store connection of this
        rank's own (a daemon thread blocked until a report or :meth:`close`), so that a report of
        rank 0 is known here even after rank 0, and the store with it, are gone."""
        if self.store is None or world_size < 2 or self._listening:
            return
        try:
            inbox = self.store.clone()
            inbox.set_timeout(timedelta(days=7))  # it waits for a report that normally never comes
            self.store.add(f"{self.key}/listeners", 1)
        except Exception:  # a store that cannot be cloned: reports are read from the store only
            return
        self._listening, self.world_size = True, world_size
        self._listener = threading.Thread(target=self._receive, args=(inbox,), daemon=True, name="lightning-pipe-reports")
        self._listener.start()

    def _receive(self, inbox: Any) -> None:
        try:
            message = inbox.queue_pop(f"{self.key}/inbox/{self.rank}")
            if message != _STOP:
                self.heard = message.decode()
                inbox.add(f"{self.key}/heard", 1)
        except Exception:  # the store is gone: the job is ending
            pass

    def close(self) -> None:
        """End this rank's listener (at the end of a run; best effort) and wait until it has returned.

        The wait matters: a listener that wakes up inside the store's C++ call while the interpreter
        is already shutting down cannot take the GIL back, and the process aborts ("terminate called
        without an active exception") instead of exiting cleanly."""
        if self._listening:
            self._listening = False
            _bounded(lambda: self.store.queue_push(f"{self.key}/inbox/{self.rank}", _STOP), STORE_PATIENCE)
            if self._listener is not None:
                self._listener.join(STORE_PATIENCE)

    # ------------------------------------------------------------------ the store, bounded
    def report(self, error: BaseException) -> None:
        """Tell every other rank that this one failed (once; best effort, never raises, never hangs):
        in the store, and into every listener's inbox. Rank 0, whose store dies with it, then waits
        until the listeners heard it (milliseconds when they are alive, at most ``LISTENER_PATIENCE``)."""
        if self.store is None or self.store_silent or self.reported or isinstance(error, PeerFailure):
            return
        self.reported = True
        message = f"rank {self.rank} {describe(error)}"

        def tell() -> tuple[int, bool]:
            first = not self.store.check([self.key])
            if first:
                self.store.set(self.key, message)
            for rank in range(self.world_size):
                if rank != self.rank:
                    self.store.queue_push(f"{self.key}/inbox/{rank}", message)
            return int(self.store.add(f"{self.key}/listeners", 0)) - int(self._listening), first

        answered, told = _bounded(tell, self.grace)
        self.store_silent = not answered
        listeners, first = told if told is not None else (0, False)
        if first and self.heard is None:  # no peer's report came before this one: none to wait for later
            self.reported_first = message
        if answered and listeners and self.rank == 0:
            deadline = time.monotonic() + LISTENER_PATIENCE
            while time.monotonic() < deadline:
                if int(self.store.add(f"{self.key}/heard", 0)) >= listeners:  # rank 0's own store: answers at once
                    return
                time.sleep(0.01)

    def peer_error(self, wait: float = 0.0) -> str | None:
        """The first reported error message, waiting up to ``wait`` seconds for one to appear; when
        the store's host (rank 0) does not answer, a sentence that says so."""
        if self.reported_first is not None:  # this rank's own report is the first (a listener never hears it)
            return self.reported_first
        if self._listening:  # a report made before now is here within milliseconds: no need to wait longer
            deadline = time.monotonic() + min(wait, LISTENER_PATIENCE)
            while self.heard is None and time.monotonic() < deadline:
                time.sleep(0.01)
            wait = 0.0
        if self.heard is not None:
            return self.heard
        if self.store is None:
            return None
        silent = "rank 0, which holds the job's key-value store, does not answer (hung, stopped or overloaded)"
        if not self.store_silent:  # one quick look first: a stopped rank 0 answers nothing, ever
            self.store_silent = not _bounded(lambda: self.store.check([self.key]), STORE_PATIENCE)[0]
        if self.store_silent:
            return silent if self.rank != 0 else None

        def look() -> str | None:
            deadline = time.monotonic() + wait
            while True:
                if self.store.check([self.key]):
                    return self.store.get(self.key).decode()
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)

        answered, message = _bounded(look, wait + STORE_PATIENCE)
        if not answered:
            self.store_silent = True
            return silent if self.rank != 0 else None
        return message

    # ------------------------------------------------------------------ waiting
    def wait(self, work: Any, what: str, peer: int | None = None, stream_ordered: bool = False) -> None:
        """Wait for ``work`` at most ``timeout`` seconds; a failure becomes :class:`PeerFailure` or
        :class:`PipelineTimeout`.

        Args:
            work: a ``torch.distributed`` request.
            what: words for error messages, e.g. ``"RECV_ACT3 from rank 1"``.
            peer: the global rank the request waits for, if one.
            stream_ordered: the request is NCCL's (:func:`stream_ordered`): only the current CUDA stream
                waits for it, the host goes on queueing work; its group's timeout bounds it instead.
        """
        try:
            if stream_ordered:  # NCCL: wait() without a timeout makes the current stream wait, not the host
                work.wait()
            else:  # gloo, shared memory: the host blocks, bounded here
                work.wait(timedelta(seconds=self.timeout))
        except LightningPipeError:
            raise  # already says what went wrong (a message of the wrong size)
        except RuntimeError as error:
            raise self.explain(error, what, peer) from error

    @contextmanager
    def guard(self, what: str, peer: int | None = None) -> Iterator[None]:
        """Within the block, a failed collective or transfer becomes :class:`PeerFailure` (a peer
        reported its error, or is gone) or :class:`PipelineTimeout` (it timed out), naming ``what``
        was awaited."""
        try:
            yield
        except RuntimeError as error:
            if isinstance(error, (PeerFailure, PipelineTimeout)):
                raise
            explained = self.explain(error, what, peer)
            if explained is error:
                raise
            raise explained from error

    def explain(self, error: BaseException, what: str, peer: int | None = None) -> BaseException:
        """The error to raise instead of a communication failure while waiting for ``what``."""
        text = str(error).lower()
        message = self.peer_error(wait=self.grace)
        if message is not None:
            return PeerFailure(f"rank {self.rank} stopped waiting for {what}: {message}")
        if "timed out" in text or "timeout" in text:
            who = f"rank {peer}" if peer is not None else "a peer"
            name, seconds = ("timeout", self.timeout)
            if peer is None and self.collective_bound is not None:
                name, seconds = self.collective_bound
            return PipelineTimeout(
                f"rank {self.rank} waited {name}={seconds:g} s for {what}; {who} is hung or much slower. "
                f"Raise PipeStrategy({name}=...) if that is expected."
            )
        if "closed" in text or "reset" in text or "broken pipe" in text or "connection" in text:
            gone = [peer] if peer is not None else self.gone_peers()
            who = " and ".join(f"rank {r}" for r in gone) if gone else "a peer"
            return PeerFailure(f"rank {self.rank} stopped waiting for {what}: {who} closed its connection without "
                               "reporting an error (it was killed, or crashed outside Python).")
        return error

    def gone_peers(self) -> list[int]:
        """The ranks on this host whose processes no longer run (which peer a collective lost)."""
        here = socket.gethostname()
        return [r for r, (host, pid) in enumerate(self.peers) if r != self.rank and host == here and not process_alive(pid)]

    # ------------------------------------------------------------------ no orphans
    def end_stragglers(self, grace: float) -> None:
        """After this rank gave up: a detached reaper process ends (SIGKILL: a process hung in gloo
        ignores SIGTERM) every other rank of the job on this host that is still alive ``grace``
        seconds later. This rank exits meanwhile, which closes its connections so healthy peers fail
        at once with this rank's report; only a hung peer outlives the grace. Ranks on other hosts
        are ended by their own watchdogs (a timeout, then their reapers)."""
        here = socket.gethostname()
        pids = [pid for r, (host, pid) in enumerate(self.peers) if r != self.rank and host == here]
        if not pids:
            return
        subprocess.Popen(  # noqa: S603 - our own interpreter and code
            [sys.executable, "-c", _REAPER, str(grace), *map(str, pids)], start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
        )


def stream_ordered(device: torch.device, tagged: bool) -> bool:
    """Whether a transport's requests are waited for on the CUDA stream rather than on the host.

    NCCL (an untagged backend with CUDA tensors): ``work.wait(timeout)`` makes the host poll until the
    transfer ends, so it cannot queue the next compute ahead; ``work.wait()`` only makes the current
    stream wait for the transfer. A hang is still bounded: the group's timeout (the strategy's
    ``process_group_timeout``, :meth:`~.topology.Topology.set_timeout`) is enforced by NCCL's watchdog
    thread, which aborts the communicator and ends the process (docs/failures.md). gloo and the
    shared-memory transport (CPU tensors) keep the host's bounded wait, which is what turns a hung peer
    into :class:`PipelineTimeout` there."""
    return not tagged and device.type == "cuda"


#: The reaper: wait up to ``grace`` seconds for the given processes to exit, then SIGKILL the survivors.
_REAPER = """
import os, signal, sys, time
grace, pids = float(sys.argv[1]), [int(p) for p in sys.argv[2:]]
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
deadline = time.monotonic() + grace
while pids and time.monotonic() < deadline:
    pids = [p for p in pids if alive(p)]
    time.sleep(0.2)
for pid in pids:
    try:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


def process_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name, the state first (the name may hold
    spaces and parentheses, so it is cut at the last ``)``); ``FileNotFoundError`` when there is no such
    process, another ``OSError`` when there is no ``/proc``."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (an exited child not yet reaped counts as exited)."""
    try:
        return process_stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
