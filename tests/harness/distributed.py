"""Run a function on several gloo processes with a hard timeout (a hung gloo rank ignores SIGTERM)."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def job_environment(**extra: str) -> dict[str, str]:
    """This process's environment for a new multi-process job, with a port of its own.

    An in-process Lightning run earlier in this interpreter (a one-device PipeStrategy) leaves its
    rendezvous variables behind; a job inheriting them would join that finished run's rendezvous.
    """
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS and not k.startswith("PL_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **extra)
    return env


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, never the same twice in this process (jobs start side by side)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as error:  # report everything, the parent decides
        result = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)  # skip gloo teardown, which can block on a failed peer


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, fresh: bool = False
) -> list[tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return ``[(status, value)]`` per rank.

    ``fn`` must be importable (defined at module level). Ranks still running after ``timeout``
    seconds are killed and reported as ``("timeout", None)``, ranks whose process died as
    ``("crashed", exit_code)``, ranks that raised as ``("error", message)``.

    By default the ranks are this session's pool workers (tests/harness/pool.py; Lightning and the test
    module are imported there once); ``fresh=True``, or a world size no pool serves, spawns new
    processes as before.
    """
    from tests.harness.pool import POOL_WORLD_SIZES, get_pool

    if fresh or world_size not in POOL_WORLD_SIZES:
        return run_fresh_workers(fn, world_size, *args, timeout=timeout)
    return call_on_pool(get_pool(world_size), fn, *args, timeout=timeout)


def call_on_pool(pool: Any, fn: Callable[..., Any], *args: Any, timeout: float) -> list[tuple[str, Any]]:
    """:func:`run_workers` on the workers of ``pool`` (a :class:`tests.harness.pool.Pool`)."""
    replies = pool.request("call", pickle.dumps((fn, args)), timeout=timeout)
    for rank, reply in enumerate(replies):
        if reply.output:  # pytest captures it, shown with a failure as a fresh worker's output would be
            sys.stdout.write(f"--- rank {rank} output\n{reply.output}")
    return [(r.status, r.value) for r in replies]


def run_fresh_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[tuple[str, Any]]:
    """:func:`run_workers` on newly spawned processes."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, out_dir, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        import time

        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        results = []
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                results.append(("timeout", None))
                continue
            path = os.path.join(out_dir, f"{rank}.pkl")
            if not os.path.exists(path):
                results.append(("crashed", p.exitcode))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results


def values(results: list[tuple[str, Any]]) -> list[Any]:
    """The values of every rank, failing with the ranks' errors if any rank did not succeed."""
    bad = [(rank, status, value) for rank, (status, value) in enumerate(results) if status != "ok"]
    if bad:
        raise AssertionError("\n".join(f"rank {rank}: {status}: {value}" for rank, status, value in bad))
    return [value for _, value in results]
