"""Turning a failed or hung peer into a clear error on every rank.

gloo receives block until the peer sends, and ``Work.is_completed()`` stays ``False`` until
``wait()`` is called, so the engine waits with plain blocking ``wait()`` (no polling overhead) and
relies on two facts: a process that dies closes its connections, which fails its peers' pending
waits at once, and every wait is bounded by the process group timeout, which the strategy sets to
its ``timeout`` option. Before a rank dies it writes its error into the job's key-value store, so
the peers can raise :class:`PeerFailure` with the original message instead of "connection closed".
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from lightning_pipe.errors import PeerFailure, PipelineTimeout

_ERROR_KEY = "lightning_pipe/error"


class Watchdog:
    """Waits on requests and explains their failures.

    Args:
        timeout: seconds a single wait may take (the process group's timeout must match).
        store: the job's key-value store (``None``: no cross-rank error reports).
        rank: this process's global rank (used in reports).
        generation: separates the reports of consecutive runs that share one store.
        grace: seconds to wait for a failed peer's report after a connection error.
    """

    def __init__(
        self, timeout: float, store: Any | None = None, rank: int = 0, generation: int = 0, grace: float = 3.0
    ) -> None:
        self.timeout = timeout
        self.store = store
        self.rank = rank
        self.key = f"{_ERROR_KEY}/{generation}"
        self.grace = grace

    @classmethod
    def from_process_group(cls, timeout: float, generation: int = 0) -> Watchdog:
        """A watchdog on the default process group's store."""
        if not dist.is_initialized():
            return cls(timeout)
        return cls(timeout, dist.distributed_c10d._get_default_store(), dist.get_rank(), generation)

    def report(self, error: BaseException) -> None:
        """Tell every other rank that this one failed (best effort, never raises)."""
        if self.store is None or isinstance(error, PeerFailure):
            return
        try:
            if not self.store.check([self.key]):
                self.store.set(self.key, f"rank {self.rank} raised {type(error).__name__}: {error}")
        except Exception:  # the store may already be gone while shutting down
            pass

    def peer_error(self, wait: float = 0.0) -> str | None:
        """The first reported error message, waiting up to ``wait`` seconds for one to appear."""
        if self.store is None:
            return None
        deadline = time.monotonic() + wait
        while True:
            try:
                if self.store.check([self.key]):
                    return self.store.get(self.key).decode()
            except Exception:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work``; a failure becomes :class:`PeerFailure` or :class:`PipelineTimeout`.

        Args:
            work: a ``torch.distributed`` request.
            what: words for error messages, e.g. ``"RECV_ACT3 from rank 1"``.
        """
        try:
            work.wait()
        except RuntimeError as error:
            raise self.explain(error, what) from error

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Within the block, a failed collective or transfer becomes :class:`PeerFailure` (a peer
        reported its error) or :class:`PipelineTimeout` (it timed out), naming ``what`` was awaited."""
        try:
            yield
        except RuntimeError as error:
            if isinstance(error, (PeerFailure, PipelineTimeout)):
                raise
            explained = self.explain(error, what)
            if explained is error:
                raise
            raise explained from error

    def explain(self, error: BaseException, what: str) -> BaseException:
        """The error to raise instead of a communication failure while waiting for ``what``."""
        message = self.peer_error(wait=self.grace)
        if message is not None:
            return PeerFailure(f"stopped waiting for {what}: {message}")
        if "timed out" in str(error).lower() or "timeout" in str(error).lower():
            return PipelineTimeout(
                f"waited {self.timeout:.0f} s for {what}; a peer is hung or much slower. "
                "Raise PipeStrategy(timeout=...) if that is expected."
            )
        return error
