"""The shared-memory transport between two real processes: 10^5 messages of random sizes and dtypes
arrive byte for byte, and a kill of either end mid-message leaves no file in /dev/shm (the memory-
ordering argument is in lightning_pipe/engine/shm.py's docstring)."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import random
import secrets
import signal
import time

import pytest
import torch

from lightning_pipe.engine import shm

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(shm.available() is not None, reason=f"no shared memory here: {shm.available()}")]

MESSAGES = 100_000
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8,
          torch.bool)
TAGS = 3  # messages interleave over three channels, as a link's header, activation and gradient tags do


def draw(rng: random.Random) -> tuple[torch.dtype, int]:
    """A message's dtype and element count: mostly small, some of a few pages, a few of a megabyte."""
    roll = rng.random()
    numel = rng.randint(0, 64) if roll < 0.7 else rng.randint(65, 4096) if roll < 0.97 else rng.randint(4097, 1 << 18)
    return rng.choice(DTYPES), numel


POOL = torch.randint(0, 256, (1 << 21,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def content(index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Message ``index``'s bytes, the same in both processes: a slice of a random pool at an offset of its own."""
    size = numel * torch.empty((), dtype=dtype).element_size()
    start = (index * 7919) % (POOL.numel() - size) // 8 * 8  # aligned, so the bytes view as any dtype
    raw = POOL[start:start + size]
    return (raw & 1).bool() if dtype is torch.bool else raw.view(dtype)


def endpoint(rank: int, token: str, peer_pid, count: int, seed: int, progress) -> None:
    """Rank 0 sends ``count`` messages, rank 1 receives and checks them; a mismatch exits with code 3."""
    torch.set_num_threads(1)
    while peer_pid.value == 0:
        time.sleep(0.01)
    transport = shm.SharedMemoryTransport(torch.device("cpu"), rank, {1 - rank: peer_pid.value}, token)
    rng = random.Random(seed)
    pending = []
    for index in range(count):
        dtype, numel = draw(rng)
        tag = index % TAGS
        if rank == 0:
            pending.append(transport.isend(content(index, dtype, numel), 1, tag))
            if len(pending) >= 64:  # as the executor does at a window's end: sends complete once received
                for work in pending:
                    work.wait()
                pending.clear()
        else:
            buffer = torch.empty(numel, dtype=dtype)
            transport.irecv(buffer, 0, tag).wait()
            if not torch.equal(buffer.view(torch.uint8), content(index, dtype, numel).view(torch.uint8)):
                print(f"message {index} ({numel} × {dtype}, tag {tag}) differs", flush=True)
                os._exit(3)
        progress.value = index + 1
    for work in pending:
        work.wait()


def leftovers(token: str) -> list[str]:
    return glob.glob(os.path.join(shm.SHM_DIR, f"lightning-pipe-{token}*"))


def start_pair(count: int, seed: int = 0):
    ctx = mp.get_context("fork")  # no second import of torch: DataLoader workers start the same way
    token = f"stress-{secrets.token_hex(4)}"
    pids = [ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False)]  # one writer each: no lock to share
    progress = [ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False)]
    processes = [ctx.Process(target=endpoint, args=(rank, token, pids[rank], count, seed, progress[rank]))
                 for rank in range(2)]
    for process in processes:
        process.start()
    pids[0].value, pids[1].value = processes[1].pid, processes[0].pid  # each end learns its peer's process
    return token, processes, progress


def test_a_hundred_thousand_random_messages_arrive_byte_for_byte():
    token, processes, _ = start_pair(MESSAGES)
    for process in processes:
        process.join(600)
    try:
        assert [p.exitcode for p in processes] == [0, 0]
        assert leftovers(token) == []
    finally:
        for process in processes:
            process.kill()


@pytest.mark.parametrize("victim", [0, 1], ids=["sender killed", "receiver killed"])
def test_a_kill_mid_message_leaves_no_file(victim):
    """Large messages (the 3 % of ``draw`` up to a megabyte) keep both ends copying most of the time, so a
    SIGKILL after a few hundred messages lands in the middle of one; the survivor notices within its
    liveness period, raises, and at exit nothing of the job is left in /dev/shm."""
    token, processes, progress = start_pair(MESSAGES, seed=victim + 1)
    deadline = time.monotonic() + 120
    while progress[1].value < 300 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert progress[1].value >= 300, "the pair did not start"
    os.kill(processes[victim].pid, signal.SIGKILL)
    survivor = processes[1 - victim]
    survivor.join(60)
    try:
        assert survivor.exitcode == 1  # the "peer has exited" error, not a hang or a mismatch
        assert leftovers(token) == []
    finally:
        for process in processes:
            process.kill()
