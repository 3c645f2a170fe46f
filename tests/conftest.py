"""Session-wide test fixtures, and the ``multiprocess`` mark of everything under tests/distributed/."""

from __future__ import annotations

import pathlib

import pytest

DISTRIBUTED = pathlib.Path(__file__).parent / "distributed"


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
