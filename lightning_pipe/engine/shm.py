"""Point-to-point through shared memory between CPU processes of one host.

gloo moves a CPU tensor through a loopback TCP socket: two copies through the kernel per message, a
rendezvous that waits for the receive to be posted, and an I/O thread per process that needs a core
exactly when both stages compute. On a 2-core machine this cost up to a third of a small pipeline's
step (docs/benchmarks.md, "Shared-memory transport"). Processes of one host can instead
hand tensors over in memory: the sender copies a message into a file in ``/dev/shm`` and bumps a
counter; the receiver, when its compute needs the message, waits for the counter and copies it out.

A :class:`_Channel` carries the messages of one (sender, receiver, tag) in order, which is what gloo
matches on, so schedules, the validator's gloo rules and the executor's early receives work
unchanged. Sends never block: a send that finds its channel's ring full is kept and written by this
process's next call into a transport (every wait loop makes progress on them).

Memory ordering. Each channel has one writer per counter: the sender alone stores ``written`` (and
the descriptors), the receiver alone stores ``read``; both are aligned 8-byte slots of a shared page,
stored and loaded whole (a ``memoryview`` cast to ``q``: one 8-byte move, which x86-64 makes atomic
when aligned). The protocol needs two orders, and x86-64's total store order gives both:

1. *The payload before the counter* (sender): the payload and descriptor stores must be visible before
   ``written = n + 1``. Ordinary stores become visible in program order. A large ``memcpy`` may use
   non-temporal stores, which are weakly ordered; a locked instruction (acquiring a ``threading.Lock``
   is an atomic read-modify-write) drains them, so it sits between the copy and the counter store.
2. *The counter before the payload* (receiver): after it loads ``written > n`` it loads the descriptor
   and copies the payload out, then stores ``read = n + 1``. x86-64 never reorders a load with an older
   load, nor a store with an older load, so it sees the payload the sender wrote, and the sender, once
   it loads ``read > n``, may reuse the slot: the receiver's copy is done. The compilers cannot reorder
   either: each access is a separate call from the interpreter.

On a weaker memory model (Arm, POWER) both orders need fences that Python does not offer, so
:func:`available` refuses anything but x86-64. tests/distributed/test_shm_stress.py sends 10^5
messages of random sizes and dtypes between two processes and compares them byte for byte.

Limits: Linux (``/dev/shm``) on x86-64. A peer that dies is noticed from ``/proc`` within
:data:`LIVENESS_PERIOD` seconds; a hung one by the wait's timeout, as with gloo. Files are unlinked as
soon as both ends have mapped them, and what a killed rank leaves is removed by the surviving end at
exit. A job killed outright (every rank SIGKILLed: no exit handler runs) leaves its messages in flight;
each rank's hello file (its process id, start time and process namespace) stays while its transport
lives, so the next job on the host finds the files of jobs none of whose ranks is alive and removes them
(:func:`remove_dead_jobs_files`).
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import platform
import re
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.engine.p2p import ChannelGroups, Transport
from lightning_pipe.engine.watchdog import process_alive, process_stat
from lightning_pipe.errors import MessageMismatchError

SHM_DIR = "/dev/shm"
#: Messages a channel holds before its sends are kept back (far more than a schedule has in flight).
RING = 256
#: Seconds between checks that the peer is alive while waiting for it.
LIVENESS_PERIOD = 0.05
_WRITTEN, _READ, _DESCRIPTORS = 0, 8, 16  # int64 slots; the two counters on separate cache lines
_SPIN, _YIELD_SECONDS, _SLEEP = 64, 2e-3, 1e-4
_FENCE = threading.Lock()
_LIVE: weakref.WeakSet[SharedMemoryTransport] = weakref.WeakSet()  # every wait writes the held sends of all


def available() -> str | None:
    """``None`` if this host can use shared memory between processes, else why not."""
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist (shared memory between processes needs Linux)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}: only x86-64 keeps stores in program order without a fence"
    return None


log = logging.getLogger(__name__)
_HELLO = re.compile(r"lightning-pipe-(?P<token>[0-9a-f]+)-hello-\d+")


def hello_path(token: str, rank: int) -> str:
    """The file in which ``rank`` of the job ``token`` names its process (:func:`reachable_peers`)."""
    return os.path.join(SHM_DIR, f"lightning-pipe-{token}-hello-{rank}")


def reachable_peers(token: str) -> dict[int, int]:
    """Collective over the default process group: the ranks whose messages can go through shared
    memory, with their process ids. Each rank leaves a file in ``/dev/shm`` naming its process (id,
    start time, process namespace) and looks for the others': a peer counts when its file is there (the
    same host, not a container with a ``/dev/shm`` of its own) and this rank sees that very process (one
    process table, so a wait can tell when the peer is gone). The file stays for the transport's life
    (:func:`remove_dead_jobs_files` reads it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(hello_path(token, rank), "w") as hello:
        hello.write(f"{os.getpid()} {_start_time(os.getpid())} {_pid_namespace()}")
    try:
        dist.barrier()
        peers = {}
        for peer in range(world):
            try:
                pid, start, _ = _read_hello(hello_path(token, peer))
            except FileNotFoundError:
                continue
            if peer != rank and _start_time(pid) == start:
                peers[peer] = pid
        dist.barrier()
    except BaseException:
        _unlink(hello_path(token, rank))
        raise
    return peers


def remove_dead_jobs_files() -> int:
    """Remove the files of jobs that were killed outright: every ``lightning-pipe-<token>-*`` file whose job's
    hello files all name processes of this process namespace that are gone. A job with a live rank, or a rank
    in another namespace (a container sharing ``/dev/shm`` whose processes this one cannot see), is left alone,
    as are files with no hello file. Returns how many files were removed."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    ranks: dict[str, list[str]] = {}
    for name in names:
        match = _HELLO.fullmatch(name)
        if match is not None:
            ranks.setdefault(match["token"], []).append(name)
    namespace, removed = _pid_namespace(), 0
    for token, hellos in ranks.items():
        if any(_may_be_alive(os.path.join(SHM_DIR, hello), namespace) for hello in hellos):
            continue
        prefix = f"lightning-pipe-{token}-"
        for name in names:
            if name.startswith(prefix):
                _unlink(os.path.join(SHM_DIR, name))
                removed += 1
    if removed:
        log.info(f"removed {removed} file(s) that killed jobs left in {SHM_DIR}")
    return removed


def _may_be_alive(hello: str, namespace: str) -> bool:
    """Whether the process a hello file names may still run (or cannot be told apart from one that does)."""
    try:
        pid, start, where = _read_hello(hello)
    except FileNotFoundError:
        return False  # its job is ending right now
    except (OSError, ValueError):  # being written, or not ours to read
        return True
    return where != namespace or _start_time(pid) == start


def _read_hello(path: str) -> tuple[int, str, str]:
    """A hello file's process id, start time and process namespace (:func:`reachable_peers` writes it)."""
    with open(path) as file:
        pid, start, namespace = file.read().split()
    return int(pid), start, namespace


def _pid_namespace() -> str:
    """This process's PID namespace (process ids name the same processes only within one)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (``None``: no such process here)."""
    try:
        return process_stat(pid)[19]
    except OSError:
        return None


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    """Map ``path`` (created with ``size`` zero bytes if ``create``)."""
    fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
    try:
        if create:
            try:  # reserve the pages now: a full /dev/shm then fails here, not as SIGBUS at the first write
                os.posix_fallocate(fd, 0, size)
            except OSError as error:
                os.close(fd)
                fd = -1
                _unlink(path)
                space = os.statvfs(SHM_DIR)
                free = space.f_bavail * space.f_frsize
                raise RuntimeError(
                    f"{SHM_DIR} has {free / 2**20:.0f} MiB free, too little for a {size / 2**20:.1f} MiB pipeline message "
                    f"({error.strerror}). Give it more (a container's --shm-size) or use "
                    "PipeStrategy(transport='process_group')."
                ) from error
        return mmap.mmap(fd, size)
    finally:
        if fd >= 0:
            os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove(paths: set[str]) -> None:
    for path in paths:
        _unlink(path)


def _bytes_of(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class _Slot:
    """A shared file holding one message at a time; replaced by a bigger generation when too small."""

    memory: mmap.mmap
    data: Tensor
    generation: int

    @property
    def capacity(self) -> int:
        return self.data.numel()


@dataclass
class _SendWork:
    """A send: complete once the peer has copied it out (as a gloo send completes when received), so a
    sender that waits for its sends never exits before its peer has opened their files."""

    transport: SharedMemoryTransport
    channel: _Channel
    sequence: int
    tensor: Tensor | None = None  # held until written

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.transport._wait_until(self.is_completed, self.channel.peer, timeout)
        return True

    def is_completed(self) -> bool:
        return self.tensor is None and self.channel.control[_READ] > self.sequence


@dataclass
class _RecvWork:
    """A receive into ``buffer``: complete once the message is copied out of shared memory."""

    transport: SharedMemoryTransport
    channel: _Channel
    sequence: int
    buffer: Tensor
    done: bool = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        channel = self.channel
        while not self.done:  # messages leave a channel in order: complete the earlier receives first
            earliest = channel.posted[0]
            self.transport._wait_until(lambda: channel.arrived(earliest.sequence), channel.peer, timeout)
            channel.take(channel.posted.popleft())
        return True

    def is_completed(self) -> bool:
        return self.done


@dataclass
class _Channel:
    """The messages from one rank to another with one tag, in order: a control file (two counters and
    a ring of descriptors) and a pool of slot files, each created by the sender and opened, then
    unlinked, by the receiver."""

    path: str
    peer: int
    control: memoryview  # int64 slots (format "q") over ``memory``
    memory: mmap.mmap
    created: set[str]  # files this end made that may still exist (its transport's, removed at exit)
    next_sequence: int = 0
    slots: list[_Slot] = field(default_factory=list)
    in_use: deque[tuple[int, int]] = field(default_factory=deque)  # sender: (sequence, slot) not yet read
    held: deque[_SendWork] = field(default_factory=deque)  # sender: sends waiting for room in the ring
    posted: deque[_RecvWork] = field(default_factory=deque)  # receiver: receives not yet complete
    mapped: dict[int, _Slot] = field(default_factory=dict)  # receiver: slot -> its current generation

    @classmethod
    def open(cls, path: str, peer: int, created: set[str]) -> _Channel:
        size = 8 * (_DESCRIPTORS + 3 * RING)
        try:
            memory = _map(path, size, create=False)
            _unlink(path)  # the peer made it: both ends hold it now, so it can go
        except FileNotFoundError:
            draft = f"{path}.{os.getpid()}"  # made whole under another name, so the peer never maps a short file
            memory = _map(draft, size, create=True)
            try:
                os.link(draft, path)
                created.add(path)
            except FileExistsError:  # the peer published its own meanwhile: use that one
                memory = _map(path, size, create=False)
                _unlink(path)
            finally:
                _unlink(draft)
        return cls(path, peer, memoryview(memory).cast("q"), memory, created)

    # ------------------------------------------------------------------ sender
    def send(self, work: _SendWork) -> None:
        if self.held or not self._room():
            self.held.append(work)
        else:
            self._write(work)

    def flush(self) -> None:
        """Write held sends that now have room."""
        while self.held and self._room():
            self._write(self.held.popleft())

    def _room(self) -> bool:
        return self.control[_WRITTEN] - self.control[_READ] < RING

    def _write(self, work: _SendWork) -> None:
        read = self.control[_READ]
        while self.in_use and self.in_use[0][0] < read:
            self.in_use.popleft()
        busy = {slot for _, slot in self.in_use}
        source = _bytes_of(work.tensor)
        size = source.numel()
        free = [i for i in range(len(self.slots)) if i not in busy]
        index = next((i for i in free if self.slots[i].capacity >= size), free[0] if free else len(self.slots))
        if index == len(self.slots) or self.slots[index].capacity < size:
            self._replace(index, size)
        slot = self.slots[index]
        slot.data[:size].copy_(source)
        at = _DESCRIPTORS + 3 * (work.sequence % RING)
        self.control[at], self.control[at + 1], self.control[at + 2] = index, slot.generation, size
        with _FENCE:  # a locked instruction: large copies may use non-temporal stores, which x86 orders only here
            pass
        self.control[_WRITTEN] = work.sequence + 1
        self.in_use.append((work.sequence, index))
        work.tensor = None

    def _replace(self, index: int, size: int) -> None:
        generation = 0
        if index < len(self.slots):
            old = self.slots[index]
            generation = old.generation + 1
            size = max(size, 2 * old.capacity)
        capacity = max(size, 4096)
        path = self.slot_path(index, generation)
        memory = _map(path, capacity, create=True)
        self.created.add(path)
        slot = _Slot(memory, torch.frombuffer(memory, dtype=torch.uint8), generation)
        if index < len(self.slots):
            self.slots[index] = slot
        else:
            self.slots.append(slot)

    def slot_path(self, index: int, generation: int) -> str:
        return f"{self.path}-slot{index}-gen{generation}"

    # ------------------------------------------------------------------ receiver
    def arrived(self, sequence: int) -> bool:
        return self.control[_WRITTEN] > sequence

    def take(self, work: _RecvWork) -> None:
        at = _DESCRIPTORS + 3 * (work.sequence % RING)
        index, generation, size = self.control[at], self.control[at + 1], self.control[at + 2]
        slot = self.mapped.get(index)
        if slot is None or slot.generation != generation:  # the old mapping goes with its last reference
            path = self.slot_path(index, generation)
            memory = _map(path, os.stat(path).st_size, create=False)
            _unlink(path)  # both ends hold it now
            slot = self.mapped[index] = _Slot(memory, torch.frombuffer(memory, dtype=torch.uint8), generation)
        if size != work.buffer.numel() * work.buffer.element_size():
            raise MessageMismatchError(
                f"rank {self.peer} sent {size} bytes where {work.buffer.numel()} elements of {work.buffer.dtype} "
                f"({work.buffer.numel() * work.buffer.element_size()} bytes) were expected"
            )
        _bytes_of(work.buffer).copy_(slot.data[:size])
        self.control[_READ] = work.sequence + 1
        work.done = True


class SharedMemoryTransport(Transport):
    """A :class:`~.p2p.Transport` whose CPU messages to the ``peers`` go through shared memory; other
    messages (CUDA tensors, ranks on other hosts or in other containers) go through
    ``torch.distributed`` as before.

    Args:
        device, group, tagged, channels: as for :class:`~.p2p.Transport`.
        rank: this process's global rank.
        peers: process id of every rank that shares this one's ``/dev/shm`` and process table
            (:func:`reachable_peers`), by global rank.
        token: a name every rank of the job agrees on and no other job uses (e.g. broadcast from rank 0).
        peer_failed: returns a peer's reported failure, if one (e.g. the watchdog's ``heard``), so a
            wait ends at once instead of at its timeout.
    """

    def __init__(
        self, device: torch.device, rank: int, peers: Mapping[int, int], token: str,
        group: Any = None, tagged: bool = True, channels: ChannelGroups | None = None,
        peer_failed: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__(device, group, tagged, channels)
        reason = available()
        if reason is not None:
            raise RuntimeError(f"shared-memory transport unavailable: {reason}. Use PipeStrategy(transport='process_group').")
        self.rank = rank
        self.peers = dict(peers)
        self.token = token
        self.peer_failed = peer_failed or (lambda: None)
        self._channels: dict[tuple[int, int, int], _Channel] = {}
        # a file normally goes once the peer has opened it; what a failed job leaves goes at exit
        self._created: set[str] = set()
        weakref.finalize(self, _remove, self._created)
        _LIVE.add(self)

    @classmethod
    def create(cls, device: torch.device, **kwargs: Any) -> SharedMemoryTransport:
        """Collective over the default process group: agree on a token, find the ranks that share
        memory with this one, and return this rank's transport (``kwargs`` as for the constructor)."""
        remove_dead_jobs_files()
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=0)
        transport = cls(device, dist.get_rank(), reachable_peers(token[0]), token[0], **kwargs)
        transport._created.add(hello_path(token[0], dist.get_rank()))  # removed with the transport's files at exit
        return transport

    def _shares_memory(self, peer: int, tensor: Tensor) -> bool:
        return tensor.device.type == "cpu" and peer in self.peers

    def _channel(self, src: int, dst: int, tag: int) -> _Channel:
        key = (src, dst, tag)
        channel = self._channels.get(key)
        if channel is None:
            path = os.path.join(SHM_DIR, f"lightning-pipe-{self.token}-{src}-{dst}-{tag}")
            channel = self._channels[key] = _Channel.open(path, dst if src == self.rank else src, self._created)
        return channel

    def checks_sizes(self, peer: int, tensor: Tensor) -> bool:
        return not self._shares_memory(peer, tensor) and super().checks_sizes(peer, tensor)  # shm checks each message

    def isend(self, tensor: Tensor, dst: int, tag: int) -> Any:
        if not self._shares_memory(dst, tensor):
            return super().isend(tensor, dst, tag)
        self._progress()
        channel = self._channel(self.rank, dst, tag)
        work = _SendWork(self, channel, channel.next_sequence, tensor)
        channel.next_sequence += 1
        channel.send(work)
        return work

    def irecv(self, tensor: Tensor, src: int, tag: int) -> Any:
        if not self._shares_memory(src, tensor):
            return super().irecv(tensor, src, tag)
        self._progress()
        channel = self._channel(src, self.rank, tag)
        work = _RecvWork(self, channel, channel.next_sequence, tensor)
        channel.next_sequence += 1
        channel.posted.append(work)
        return work

    def _progress(self) -> None:
        """Write the held sends that have room now, of every transport of this process (a process may
        hold several, e.g. a benchmark's variants)."""
        for transport in _LIVE:
            for channel in transport._channels.values():
                if channel.held:
                    channel.flush()

    def _wait_until(self, ready: Callable[[], bool], peer: int, timeout: timedelta | None) -> None:
        """Spin briefly, then yield the core, then sleep in short naps until ``ready()``; raise the
        errors gloo would (a closed connection, a timeout) so the watchdog explains them alike."""
        spins = 0
        start = check = time.monotonic()
        limit = timeout.total_seconds() if timeout is not None else None
        while not ready():
            spins += 1
            if spins < _SPIN:
                continue
            self._progress()
            now = time.monotonic()
            if now - check > LIVENESS_PERIOD:
                check = now
                self._check_peer(peer)
                if limit is not None and now - start > limit:
                    raise RuntimeError(f"shared-memory wait for rank {peer} timed out after {limit:.0f} s")
            if now - start < _YIELD_SECONDS:
                os.sched_yield()
            else:
                time.sleep(_SLEEP)

    def _check_peer(self, peer: int) -> None:
        report = self.peer_failed()
        if report is not None:
            raise RuntimeError(f"Connection closed by peer: rank {peer}'s job reported a failure ({report})")
        pid = self.peers[peer]
        if not process_alive(pid):
            self._remove_files_of(peer)
            raise RuntimeError(f"Connection closed by peer: rank {peer} (pid {pid}) has exited")

    def _remove_files_of(self, peer: int) -> None:
        """Remove what a dead ``peer`` made for its channels with this rank and can no longer remove: a
        slot it created for a message it never finished, a control file this rank never opened, its hello file."""
        _unlink(hello_path(self.token, peer))
        prefix = os.path.join(SHM_DIR, f"lightning-pipe-{self.token}")
        for pattern in (f"{prefix}-{peer}-{self.rank}-*", f"{prefix}-{self.rank}-{peer}-*"):
            for path in glob.glob(pattern):
                _unlink(path)
