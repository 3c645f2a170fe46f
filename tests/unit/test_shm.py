"""The shared-memory transport, both ends in this process: order, exact bytes, growth, sends held
beyond the ring, and the errors a dead, failed or hung peer gives (the multi-process exactness
tests are in tests/distributed/test_engine.py)."""

from __future__ import annotations

import glob
import os
import secrets
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from lightning_pipe.engine import shm
from lightning_pipe.engine.p2p import Transport
from lightning_pipe.engine.shm import SharedMemoryTransport
from lightning_pipe.engine.watchdog import Watchdog
from lightning_pipe.errors import MessageMismatchError, PeerFailure, PipelineTimeout

pytestmark = pytest.mark.skipif(shm.available() is not None, reason=f"no shared memory here: {shm.available()}")
CPU = torch.device("cpu")


def pair(name: str, rank0_pid: int | None = None, **kwargs) -> tuple[SharedMemoryTransport, SharedMemoryTransport]:
    """Rank 0's and rank 1's transports, both in this process; rank 1 believes rank 0 runs as
    ``rank0_pid`` (default: this process)."""
    token = f"test-{name}-{secrets.token_hex(4)}"
    return (SharedMemoryTransport(CPU, 0, {1: os.getpid()}, token, **kwargs),
            SharedMemoryTransport(CPU, 1, {0: rank0_pid or os.getpid()}, token, **kwargs))


def exited_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_messages_arrive_in_order_with_their_exact_bytes_and_slots_grow():
    sender, receiver = pair("order")
    sent = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(64, 300), torch.ones(2, dtype=torch.bool),
            torch.randn(1000, 100, dtype=torch.float64)]  # 800 KB after small ones: a slot's next generation
    works = [sender.isend(t, 1, tag=1) for t in sent]
    gradient = torch.randn(4, 4)
    sender_gets = receiver.isend(gradient, 0, tag=2)  # the other direction meanwhile
    buffers = [torch.empty_like(t) for t in sent]
    receives = [receiver.irecv(b, 0, tag=1) for b in buffers]
    receives[-1].wait(timedelta(seconds=5))  # completes the earlier ones of the channel first
    assert all(r.is_completed() for r in receives) and all(w.is_completed() for w in works)  # read: like gloo's
    for expected, got in zip(sent, buffers):
        assert torch.equal(expected, got)
    back = torch.empty(4, 4)
    sender.irecv(back, 1, tag=2).wait()
    sender_gets.wait()
    assert torch.equal(back, gradient)
    # every file is gone once both ends opened it
    assert not glob.glob(os.path.join(shm.SHM_DIR, f"lightning-pipe-{sender.token}-*"))


def test_sends_beyond_the_ring_are_held_and_written_as_the_receiver_reads(monkeypatch):
    monkeypatch.setattr(shm, "RING", 4)
    sender, receiver = pair("ring")
    sent = [torch.full((8,), float(i)) for i in range(10)]
    works = [sender.isend(t, 1, tag=0) for t in sent]
    assert [w.tensor is None for w in works] == [True] * 4 + [False] * 6  # written or held: the sender never blocks
    for i, expected in enumerate(sent):
        got = torch.empty(8)
        receiver.irecv(got, 0, tag=0).wait(timedelta(seconds=5))  # the wait also writes this process's held sends
        assert torch.equal(got, expected), i
    assert all(w.is_completed() for w in works)


def test_a_message_of_the_wrong_size_names_the_disagreement():
    sender, receiver = pair("size")
    sender.isend(torch.zeros(6), 1, tag=0)
    with pytest.raises(MessageMismatchError, match=r"rank 0 sent 24 bytes where 5 elements of torch.float32 \(20 bytes\)"):
        receiver.irecv(torch.empty(5), 0, tag=0).wait()


def test_a_peer_that_exited_ends_the_wait_as_a_closed_connection_does():
    _, receiver = pair("dead", rank0_pid=exited_pid())
    work = receiver.irecv(torch.empty(3), 0, tag=0)  # rank 1 waits for "rank 0", which has exited
    with pytest.raises(PeerFailure, match="rank 0 closed its connection"):
        Watchdog(timeout=30.0, rank=1, grace=0.0).wait(work, "RECV_ACT0 from rank 0", peer=0)


def test_a_reported_failure_and_a_hung_peer_end_the_wait():
    report = "rank 0 raised ValueError: boom"
    _, receiver = pair("told", peer_failed=lambda: report)
    with pytest.raises(RuntimeError, match="boom"):
        receiver.irecv(torch.empty(3), 0, tag=0).wait(timedelta(seconds=30))
    _, receiver = pair("hung")
    with pytest.raises(PipelineTimeout, match="waited timeout=0.2 s for RECV_GRAD1 from rank 0"):
        Watchdog(timeout=0.2, rank=1, grace=0.0).wait(receiver.irecv(torch.empty(3), 0, tag=2), "RECV_GRAD1 from rank 0", 0)


def test_cuda_tensors_and_unreachable_peers_take_the_process_group(monkeypatch):
    posted = []  # what reached torch.distributed (Transport.isend), by device and destination
    monkeypatch.setattr(Transport, "isend", lambda self, tensor, dst, tag: posted.append((tensor.device.type, dst)))
    sender, receiver = pair("route")
    sent, got = torch.arange(4.0), torch.empty(4)
    sender.isend(sent, 1, tag=0)
    receiver.irecv(got, 0, tag=0).wait(timedelta(seconds=5))
    assert posted == [] and torch.equal(got, sent)  # a CPU tensor to a reachable peer: shared memory only
    assert not glob.glob(os.path.join(shm.SHM_DIR, f"lightning-pipe-{sender.token}-*"))
    if torch.cuda.is_available():
        sender.isend(torch.zeros(1, device="cuda"), 1, tag=0)
        assert posted == [("cuda", 1)]
        posted.clear()
    del sender.peers[1]  # another host, or a container with a /dev/shm of its own (reachable_peers)
    sender.isend(torch.zeros(1), 1, tag=0)
    assert posted == [("cpu", 1)]


def test_a_full_dev_shm_names_the_fix_instead_of_a_bus_error(monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    sender, _ = pair("full")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RuntimeError, match=r"MiB free, too little .* --shm-size\) or use PipeStrategy\(transport='process_group'\)"):
        sender.isend(torch.zeros(10), 1, tag=0)
    assert not glob.glob(os.path.join(shm.SHM_DIR, f"lightning-pipe-{sender.token}-*"))


def test_the_files_of_a_job_killed_outright_are_removed_by_the_next_one(tmp_path, monkeypatch):
    """Every rank SIGKILLed leaves the messages in flight in /dev/shm; the next job removes the files of jobs whose
    ranks are all gone, and leaves those of a live job, of ranks in another process namespace, and unknown files."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    dead_pid, here = exited_pid(), shm._pid_namespace()
    alive = f"{os.getpid()} {shm._start_time(os.getpid())} {here}"
    jobs = {
        "dead": [f"{dead_pid} 12345 {here}", f"{os.getpid()} 1 {here}"],  # a gone process; a reused process id
        "live": [f"{dead_pid} 12345 {here}", alive],  # one rank still runs
        "elsewhere": [f"{dead_pid} 12345 pid:[1]"],  # a process this namespace cannot see
    }
    tokens = {job: secrets.token_hex(8) for job in jobs}
    for job, hellos in jobs.items():
        for rank, hello in enumerate(hellos):
            (tmp_path / f"lightning-pipe-{tokens[job]}-hello-{rank}").write_text(hello)
        (tmp_path / f"lightning-pipe-{tokens[job]}-0-1-7-slot0-gen0").write_bytes(b"\0" * 64)
    (tmp_path / "lightning-pipe-0123456789abcdef-0-1-7").write_bytes(b"")  # no hello file: not known to be dead
    (tmp_path / "someone-else").write_bytes(b"")

    assert shm.remove_dead_jobs_files() == 3
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not any(tokens["dead"] in name for name in left)
    assert sum(tokens["live"] in name for name in left) == 3 and sum(tokens["elsewhere"] in name for name in left) == 2
    assert "someone-else" in left and "lightning-pipe-0123456789abcdef-0-1-7" in left
