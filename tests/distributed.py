"""Run a function on several gloo processes with a hard timeout (a hung gloo rank ignores SIGTERM)."""

from __future__ import annotations

import os
import pickle
import socket
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


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return ``[(status, value)]`` per rank.

    ``fn`` must be importable (defined at module level). Processes still alive after ``timeout``
    seconds are killed and reported as ``("timeout", None)``.
    """
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
