"""Start-up bounded by ``startup_timeout``, with errors that say what was awaited and where.

Lightning creates the default process group with the strategy's process-group timeout, the largest of
the three timeouts (one hour by default), and torch creates the job's key-value store with it: a rank
whose rank 0 never comes retried its connection for an hour. Here the store and the process group
are created with ``startup_timeout``, so that the store's creation and connection, the rendezvous
and every collective of the setup (process groups, the shared-memory transport, ``balance="auto"``
trials, avgpipe's tuner) are bounded by it; :func:`end` gives the groups the long timeout once the
pipeline is built.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_pipe.errors import StartupFailure

# Lightning's own line ("Initializing distributed: ..."), through the logger Lightning shows it with
log = logging.getLogger("lightning.fabric.utilities.distributed")
#: Seconds past ``startup_timeout`` the store gets to fail on its own (with torch's more precise reason).
STORE_MARGIN = 2.0
T = TypeVar("T")


def init_process_group(environment: Any, backend: str, rank: int, world_size: int, startup_timeout: float,
                       device: torch.device) -> None:
    """Open (rank 0) or reach (the others) the job's key-value store at ``MASTER_ADDR:MASTER_PORT`` and
    create the default process group, each wait bounded by ``startup_timeout`` seconds.

    Args:
        environment: Lightning's cluster environment (address, port).
        backend: ``"gloo"`` or ``"nccl"``.
        rank: this process's global rank.
        world_size: processes in the job.
        startup_timeout: seconds any wait of the start-up may take.
        device: this rank's device (NCCL binds its group to it).

    Raises:
        StartupFailure: the port is taken, rank 0's store cannot be reached, or a rank did not arrive.
    """
    address, port = environment.main_address, int(environment.main_port)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
    timeout = timedelta(seconds=startup_timeout)
    try:
        store = _within(lambda: dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout,
                                              multi_tenant=True),  # as torch's own: a later fit in this process reuses the port
                        startup_timeout + STORE_MARGIN)
    except TimeoutError:  # torch's handshake with a peer that accepted has no deadline; its connect retries overrun
        reason = (TimeoutError("nothing listens there") if not _listens(address, port) else
                  TimeoutError("something accepts connections there but does not answer as the store"))
        raise StartupFailure(_store_failure(reason, rank, world_size, address, port, startup_timeout)) from None
    except Exception as error:  # torch's DistNetworkError / DistStoreError (its first line is kept; the rest is a C++ stack)
        raise StartupFailure(_store_failure(error, rank, world_size, address, port, startup_timeout)) from None
    device_id = {"device_id": device} if device.type != "cpu" else {}
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **device_id)
    except Exception as error:
        raise StartupFailure(
            f"rank {rank} could not join the job's process group within startup_timeout={startup_timeout:g} s "
            f"(rendezvous through the key-value store at {address}:{port}): {_first_line(error)}. Another rank "
            "failed or is much slower to start; raise PipeStrategy(startup_timeout=...) if ranks start slowly."
        ) from None  # torch's own error is its first line here; the rest is a C++ stack


def _within(create: Callable[[], T], seconds: float) -> T:
    """``create()``, or ``TimeoutError`` when it has not returned after ``seconds`` (it goes on in a daemon
    thread, which does not keep the process alive)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, create()))
        except BaseException as error:  # re-raised in the caller
            box.append((False, error))

    thread = threading.Thread(target=run, daemon=True, name="lightning-pipe-startup")
    thread.start()
    thread.join(seconds)
    if not box:
        raise TimeoutError
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _listens(address: str, port: int) -> bool:
    """Whether something accepts connections at ``address:port`` now."""
    try:
        with socket.create_connection((address, port), timeout=1.0):
            return True
    except OSError:
        return False


def end(topology: Any, process_group_timeout: float) -> None:
    """Start-up is over: collectives from now on wait up to ``process_group_timeout`` (a checkpoint
    save, a slow validation), and so do the key-value store's requests."""
    if not dist.is_initialized():
        return
    topology.set_timeout(process_group_timeout)
    dist.distributed_c10d._get_default_store().set_timeout(timedelta(seconds=process_group_timeout))


def _store_failure(error: BaseException, rank: int, world_size: int, address: str, port: int, seconds: float) -> str:
    text = str(error)
    lowered = text.lower()
    where = f"{address}:{port}"
    if "eaddrinuse" in lowered or "address already in use" in lowered:
        return (f"rank 0 cannot open the job's key-value store at {where}: the port is taken by another process "
                "(another job?). Set MASTER_PORT to a free port, or end the process that holds it.")
    if rank == 0:
        return (f"rank 0 waited startup_timeout={seconds:g} s for the other {world_size - 1} rank(s) to connect to the "
                f"job's key-value store at {where} ({_first_line(error)}). A rank did not start, or was pointed at another "
                "address or port; raise PipeStrategy(startup_timeout=...) if ranks start slowly.")
    # torch reports a refused connection as a timeout once its retries run out: look at the port once more
    seen = "nothing listens there" if not _listens(address, port) else "something accepts connections there"
    return (f"rank {rank} waited startup_timeout={seconds:g} s for rank 0's key-value store at {where} "
            f"({_first_line(error)}; {seen}): rank 0 did not start, failed, listens elsewhere, or the port belongs to "
            "another program. Check MASTER_ADDR and MASTER_PORT, or raise PipeStrategy(startup_timeout=...) if rank 0 "
            "starts slowly.")


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
