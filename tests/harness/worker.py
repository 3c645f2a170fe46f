"""One long-lived rank of a worker pool (tests/harness/pool.py): :func:`serve`, in a process forked from the pool's fork server.

The fork server imported Lightning, the package and ``tests.harness.lightning_run`` once for the session, so a
new worker costs a ``fork`` rather than seconds of imports. Each worker gets the environment under which Lightning
treats processes as created externally (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ...), so a
``Trainer(devices=WORLD_SIZE)`` in each of them forms one job without Lightning's launcher starting
children; each request then costs what the work costs.

Requests (pickled, over a Unix socket to the pool):

* ``("train", request, config, out_dir)``: ``tests/harness/lightning_run.py::train(config)``, the record
  saved to ``out_dir/rank{r}.pt`` like the script saves it;
* ``("call", request, payload)``: ``fn(rank, world_size, *args)`` with ``payload = pickle.dumps((fn,
  args))``, on a gloo process group this worker creates, like ``tests/harness/distributed.py::run_workers``;
* ``("exit",)``.

``request`` carries what a fresh process would have got from its parent: the environment (with a
port of its own for this request's rendezvous), the working directory and the file that receives
this rank's stdout and stderr (file descriptors 1 and 2 are redirected, so Lightning's and the
package's output, warnings and tracebacks land there), and the request's timeout (shortly before
it, every thread's stack is written there: what a hung rank was waiting for).

Every request gets a process group of its own (created by Lightning, or here for ``call``) and
destroys it at the end, so nothing of one request's key-value store (e.g. the watchdog's error key)
is seen by the next, and the strategy's ``timeout`` option applies as in a fresh job. State a fresh
process would not carry over is reset before each request: the environment (Lightning deletes
``WORLD_SIZE`` at teardown, ``seed_everything`` sets ``PL_GLOBAL_SEED``), the working directory, the
warning filters and "warn once" registries, torch's thread count, default dtype, grad mode and
deterministic flag. Replies: ``("result", status, value)`` then ``("clean", ok)`` once the process
group is gone. After a failed request the worker exits at once (``os._exit``: no gloo teardown,
which can block on a failed peer); its peers then fail fast on closed connections, and the pool
starts new workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RANK = -1  # set by serve()
WORLD_SIZE = -1

_FILTERS = list(warnings.filters)  # set again by serve(), after whatever the fork server imported
_THREADS = 1
_DTYPE = torch.get_default_dtype()
_DETERMINISTIC = torch.are_deterministic_algorithms_enabled()


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message))


def reset_state(request: dict[str, Any]) -> None:
    """What a fresh process started for this request would see."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    warnings.filters[:] = _FILTERS
    warnings._filters_mutated()  # every module's __warningregistry__ is stale from now on
    warnings.onceregistry.clear()
    for module in list(sys.modules.values()):  # Lightning's WarningCache: each message once per process
        for value in list(getattr(module, "__dict__", {}).values()):
            if type(value).__name__ == "WarningCache" and isinstance(value, set):
                value.clear()
    torch.set_num_threads(_THREADS)
    torch.set_default_dtype(_DTYPE)
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(_DETERMINISTIC)


def _write_fds_1_and_2_to(path: str) -> None:
    """Point file descriptors 1 and 2 at ``path`` (appending), so anything written there, by Python or C, lands in it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


@contextlib.contextmanager
def output_to(path: str):
    """File descriptors 1 and 2 (so Python's sys.stdout/sys.stderr and any C library) write to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    _write_fds_1_and_2_to(path)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def run(message: tuple) -> tuple[str, Any]:
    kind = message[0]
    if kind == "train":
        config, out_dir = message[2], message[3]
        from tests.harness.lightning_run import train

        record = train(config)
        torch.save(record, os.path.join(out_dir, f"rank{record['rank']}.pt"))
        return "ok", None
    if kind == "call":
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=RANK, world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
        fn, args = pickle.loads(message[2])
        return "ok", fn(RANK, WORLD_SIZE, *args)
    raise ValueError(f"unknown request {kind!r}")


def dump_stacks(timeout: float) -> None:
    """Shortly before the pool kills a request that outlives its timeout: every thread's stack, into
    the request's output (what a hung rank waits for).

    A Python thread reading ``sys._current_frames()`` under the GIL: faulthandler's signal handlers
    do not survive Lightning's Trainer (it resets every signal's handler when it ends), and its
    ``dump_traceback_later`` thread reads the frames of running threads without the GIL, which can
    crash a rank that is busy rather than hung (seen: a segfault, turning the timeout into a crash).
    A gloo wait releases the GIL, so a hung rank's stack is read while it stands still.
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    parts = [f"[tests.harness.worker] rank {RANK}: still running shortly before the {timeout:g} s timeout; stacks:\n"]
    for ident, frame in sys._current_frames().items():
        if ident != me:
            parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n")
            parts.extend(traceback.format_stack(frame))
    sys.stderr.write("".join(parts))
    sys.stderr.flush()


def cleanup() -> bool:
    """Every rank is done with the process group; destroy it (the next request makes its own)."""
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        gc.collect()
        return True
    except BaseException:
        traceback.print_exc()
        return False


def die_with_parent() -> None:
    """SIGKILL this worker when the pool's process ends, even if a request holds it (a hung gloo wait)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (AttributeError, OSError):
        pass  # elsewhere: an idle worker still exits when the pool's socket closes


def serve(socket_path: str, rank: int, world_size: int, env: dict[str, str], log_path: str, cwd: str) -> None:
    """Be rank ``rank`` of the pool listening at ``socket_path``, in a process just forked from the fork server.

    What a fresh ``subprocess.Popen(..., env=env, cwd=cwd, stdout=log, start_new_session=True)`` would
    have given it: a session of its own (the pool kills the worker's whole process group), standard
    input from /dev/null, standard output and error into ``log_path``, ``env`` and ``cwd``.
    """
    global RANK, WORLD_SIZE, _FILTERS
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _write_fds_1_and_2_to(log_path)
    # unbuffered, as PYTHONUNBUFFERED=1 makes a fresh process: a worker killed at a timeout loses nothing it printed
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    RANK, WORLD_SIZE = rank, world_size
    _FILTERS = list(warnings.filters)
    main(socket_path)


def main(socket_path: str) -> None:
    die_with_parent()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    conn = Connection(sock.detach())
    send(conn, ("hello", RANK, os.getpid()))
    home = os.getcwd()
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the pool is gone
            os._exit(0)
        if message[0] == "exit":
            os._exit(0)
        request = message[1]
        with output_to(request["output"]):
            timeout = request["timeout"]
            timer = threading.Timer(max(timeout - 1.0, 0.5 * timeout), dump_stacks, (timeout,))
            timer.daemon = True
            timer.start()
            try:
                reset_state(request)
                status, value = run(message)
            except BaseException as error:  # report everything, the pool decides
                traceback.print_exc()
                status, value = "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
            timer.cancel()
            timer.join()
            try:
                reply = pickle.dumps(("result", status, value))
            except BaseException as error:
                traceback.print_exc()
                status, reply = "error", pickle.dumps(("result", "error", f"unpicklable result: {error!r}"))
            conn.send_bytes(reply)
            clean = status == "ok" and cleanup()
        try:
            send(conn, ("clean", clean))
        except OSError:
            os._exit(1)
        if not clean:
            os._exit(1)  # skip gloo teardown, which can block on a failed peer
        os.chdir(home)
