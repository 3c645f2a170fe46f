"""Session-wide test fixtures, and the ``multiprocess`` mark of everything under tests/distributed/."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

DISTRIBUTED = pathlib.Path(__file__).parent / "distributed"

#: One intra-op thread for the in-process tests, as every multi-process job of the suite already has
#: (tests/harness: OMP_NUM_THREADS=1). Their tensors are tiny, so a second thread buys nothing; on a loaded
#: machine with few cores each op then waits for a descheduled OpenMP thread instead (an emulated 2-stage
#: Trainer run: 5.2 s with two threads, 1.8 s with one, on 2 busy cores). Set in the environment too, so
#: Lightning's launcher keeps it (it sets the thread count only without OMP_NUM_THREADS) and the
#: subprocesses tests start inherit it. Set OMP_NUM_THREADS to run the suite with more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, import Lightning (through the package) in the controller before a worker reports.

    The controller rebuilds each warning a worker reports by importing the module of its class, in the
    thread that receives from that worker. Two workers' first Lightning warnings arriving together made two
    threads import Lightning at once, which Python's import locks ended with a ``_DeadlockError`` that
    crashed a worker (``-n 2``: every time on four of the unit test files run together)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        import lightning_pipe  # noqa: F401


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/distributed/ ``multiprocess`` (deselect them with ``-m "not multiprocess"``)."""
    for item in items:
        if DISTRIBUTED in pathlib.Path(item.fspath).parents:
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(scope="session", autouse=True)
def _worker_pools():
    """The worker pools (tests/harness/pool.py) live for the session; end them when it ends."""
    yield
    from tests.harness.pool import shutdown_all

    shutdown_all()
