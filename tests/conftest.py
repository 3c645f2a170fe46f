"""Session-wide test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _worker_pools():
    """The worker pools (tests/pool.py) live for the session; end them when it ends."""
    yield
    from tests.pool import shutdown_all

    shutdown_all()
