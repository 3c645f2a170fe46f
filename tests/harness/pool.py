"""Long-lived worker processes for multi-process tests: Lightning is imported once per session.

A fresh multi-process job spends almost all of its time importing Python packages (``import
lightning`` alone takes about 7 CPU-seconds, and Lightning's launcher starts rank 1 only after rank 0 has
imported). A :class:`Pool` forks ``world_size`` workers (``tests/harness/worker.py::serve``) from a fork
server that imported Lightning, the package and ``tests.harness.lightning_run`` once for the session
(``multiprocessing``'s ``forkserver``: it forks from a process that never ran a step, so no thread
or lock of a used torch is copied), each
with the environment under which Lightning treats processes as created externally, and sends them
requests: train a ``tests/harness/lightning_run.py`` config (what :func:`tests.harness.launch.launch` runs) or call
a function on a gloo process group (what :func:`tests.harness.distributed.run_workers` runs). Each request
creates and destroys its own process group and sees a reset process state (tests/harness/worker.py).

Robustness: a request has a deadline. When it passes, when any rank reports an error, when a worker
dies or a rank could not tear its process group down cleanly, every worker's process group is killed
with SIGKILL (a hung gloo rank ignores SIGTERM; shortly before the deadline each worker wrote its
threads' stacks into the request's output), and new workers are forked at once.

:func:`get_pool` keeps one pool per world size for the session; :func:`shutdown_all` ends them
(tests/conftest.py at the end of the session, ``atexit`` as a fallback).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from tests.harness.distributed import job_environment
from tests.harness.worker import serve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: world sizes a pool serves; the tests' jobs use 2 and 4 processes
POOL_WORLD_SIZES = (2, 4)

#: seconds the pool waits for all workers to start (the fork server's one import included)
STARTUP_TIMEOUT = 180.0

#: what the fork server imports once; every worker is forked from it with these imported
FORK_SERVER_PRELOAD = ["tests.harness.lightning_run", "tests.harness.worker"]

_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(FORK_SERVER_PRELOAD)

#: after one rank failed, seconds the others get to report their own errors before the pool is killed
FAILURE_GRACE = 15.0


class PoolStartupError(RuntimeError):
    """The workers did not start (their log is in the message)."""


@dataclass
class Reply:
    """What one rank answered to a request."""

    status: str  # "ok", "error", "timeout" (no answer before the deadline), "crashed" (the worker died)
    value: Any = None
    clean: bool = False  # the rank destroyed its process group after the request
    output: str = ""


@dataclass
class _Worker:
    rank: int
    proc: BaseProcess
    log_path: str
    conn: Connection | None = None


@dataclass
class Pool:
    """``world_size`` long-lived worker processes that run requests together."""

    world_size: int
    _dir: str | None = None
    _workers: list[_Worker] = field(default_factory=list)
    _server: socket.socket | None = None
    _requests: int = 0
    starts: int = 0  # how many sets of workers were started (1 + restarts)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Fork the workers without waiting for them to say hello (the first start also starts the fork server)."""
        self.close()
        self._dir = tempfile.mkdtemp(prefix=f"lp-pool{self.world_size}-")
        path = os.path.join(self._dir, "pool.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(self.world_size)
        self.starts += 1
        for rank in range(self.world_size):
            log_path = os.path.join(self._dir, f"worker{rank}.log")
            env = self._environment(rank, job_environment())
            proc = _FORKS.Process(target=serve, args=(path, rank, self.world_size, env, log_path, ROOT),
                                  name=f"pool{self.world_size}-rank{rank}")
            proc.start()
            self._workers.append(_Worker(rank, proc, log_path))

    def _environment(self, rank: int, base: dict[str, str]) -> dict[str, str]:
        """``base`` plus what makes Lightning see an externally created job of ``world_size`` ranks."""
        env = dict(base)
        path = env.get("PYTHONPATH")
        env.update(
            LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE=str(self.world_size),
            OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([ROOT, path] if path else [ROOT]),
        )
        return env

    def _connect(self) -> None:
        """Wait until every worker has imported and said hello."""
        if not self._workers:
            self.start()
        if all(w.conn is not None for w in self._workers):
            return
        assert self._server is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT
        self._server.settimeout(0.2)
        while any(w.conn is None for w in self._workers):
            for w in self._workers:
                if w.proc.exitcode is not None:
                    raise PoolStartupError(self._startup_failure(f"worker {w.rank} exited with {w.proc.exitcode}"))
            if time.monotonic() > deadline:
                raise PoolStartupError(self._startup_failure(f"workers not ready after {STARTUP_TIMEOUT:.0f} s"))
            try:
                sock, _ = self._server.accept()
            except socket.timeout:
                continue
            sock.setblocking(True)
            conn = Connection(sock.detach())
            if not conn.poll(30):
                conn.close()
                continue
            kind, rank, _pid = pickle.loads(conn.recv_bytes())
            assert kind == "hello" and self._workers[rank].conn is None, (kind, rank)
            self._workers[rank].conn = conn

    def _startup_failure(self, what: str) -> str:
        logs = "".join(f"--- worker {w.rank}\n{_read(w.log_path)}" for w in self._workers)
        self.close()
        return f"{what}\n{logs}"

    def close(self, grace: float = 0.0) -> None:
        """End every worker: ask them to exit (``grace`` seconds), then SIGKILL each process group."""
        if grace > 0:
            for w in self._workers:
                if w.conn is not None:
                    try:
                        w.conn.send_bytes(pickle.dumps(("exit",)))
                    except OSError:
                        pass
            deadline = time.monotonic() + grace
            for w in self._workers:
                w.proc.join(max(0.0, deadline - time.monotonic()))
        for w in self._workers:
            _kill_group(w.proc)
        for w in self._workers:
            w.proc.join()
            if w.conn is not None:
                w.conn.close()
        self._workers = []
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def restart(self) -> None:
        """Kill every worker and start new ones (they import while the caller goes on)."""
        self.close()
        self.start()

    # ------------------------------------------------------------------ requests
    def request(self, kind: str, *payload: Any, timeout: float) -> list[Reply]:
        """Send ``(kind, request, *payload)`` to every rank and collect the replies until ``timeout`` seconds.

        After anything but a clean success of every rank, the workers are replaced.
        """
        if any(w.proc.exitcode is not None for w in self._workers):
            self.restart()  # a worker died while idle: this request gets a whole new set
        self._connect()
        self._requests += 1
        out_dir = tempfile.mkdtemp(prefix=f"lp-request{self._requests}-")
        try:
            return self._request(kind, payload, timeout, out_dir)
        except BaseException:  # e.g. pytest-timeout or Ctrl-C in the middle: the workers are still busy
            self.restart()
            raise
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    def _request(self, kind: str, payload: tuple, timeout: float, out_dir: str) -> list[Reply]:
        outputs = [os.path.join(out_dir, f"output-rank{rank}.txt") for rank in range(self.world_size)]
        base = job_environment()  # this process's environment now, a port of its own for the rendezvous
        replies = [Reply("timeout") for _ in range(self.world_size)]
        pending: dict[Connection, int] = {}
        for w in self._workers:
            request = {"env": self._environment(w.rank, base), "cwd": os.getcwd(), "output": outputs[w.rank],
                       "timeout": timeout}
            assert w.conn is not None
            try:
                w.conn.send_bytes(pickle.dumps((kind, request, *payload)))
                pending[w.conn] = w.rank
            except OSError:  # died while idle: reported as crashed below
                replies[w.rank] = Reply("crashed")
        self._collect(pending, replies, time.monotonic() + timeout)
        for w in self._workers:
            if replies[w.rank].status == "crashed":
                w.proc.join(5)
                replies[w.rank].value = w.proc.exitcode  # as run_workers reports it (None: still dying)
        if not all(r.status == "ok" and r.clean for r in replies):
            self.restart()
        for rank, reply in enumerate(replies):
            reply.output = _read(outputs[rank])
        return replies

    def _collect(self, pending: dict[Connection, int], replies: list[Reply], deadline: float) -> None:
        waiting_result = set(pending)
        while pending:
            failed = any(r.status not in ("ok", "timeout") for r in replies)
            if failed:  # the job failed: the others get a short while to tell their part
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
                if not waiting_result:
                    return  # nobody's teardown matters any more
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for conn in wait(list(pending), remaining):
                rank = pending[conn]
                try:
                    message = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    del pending[conn]
                    waiting_result.discard(conn)
                    if replies[rank].status == "timeout":
                        replies[rank] = Reply("crashed")
                    continue
                if message[0] == "result":
                    replies[rank] = Reply(message[1], message[2])
                    waiting_result.discard(conn)
                elif message[0] == "clean":
                    replies[rank].clean = bool(message[1])
                    del pending[conn]


def _kill_group(proc: BaseProcess) -> None:
    if proc.pid is None:
        return
    kills = (os.killpg, os.kill) if proc.exitcode is None else (os.killpg,)
    for kill in kills:  # the worker's session (itself and anything it started); itself, if killed before its setsid
        try:
            kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


_POOLS: dict[int, Pool] = {}


def get_pool(world_size: int) -> Pool:
    """This session's pool of ``world_size`` workers (started on first use)."""
    if world_size not in POOL_WORLD_SIZES:
        raise ValueError(f"no pool serves world size {world_size}; pools: {POOL_WORLD_SIZES}")
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = Pool(world_size)
        pool.start()
    return pool


def shutdown_all() -> None:
    """End every pool of this session (idempotent)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close(grace=5.0)


atexit.register(shutdown_all)
