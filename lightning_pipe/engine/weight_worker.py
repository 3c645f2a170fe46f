"""Zero-bubble ``W`` halves on a background thread, so that their host work overlaps the main thread's.

A ``W`` computes weight gradients that nothing reads before the optimizer step (docs/algorithms.md §4a).
Where the host is what limits a GPU step (docs/benchmarks.md, "One GPU": on an H200's VM a ``W`` took 6.1 ms
of host time, for 3.2 ms of which the device sat idle), the main thread running it cannot meanwhile queue the
next forward. A worker thread runs the ``W`` instead; its autograd calls and kernel launches release the GIL,
so the two threads' host work overlaps, and both feed the same CUDA stream.

Exactness: one worker per process runs the ``W`` halves in the order they were handed over, and the executor
waits for it (:meth:`WeightWorker.join`) before any other action that adds to a weight gradient or reads
one: a whole backward, the STEP, an averaging, a backward wrapped by a gradient-reduction context, and
the end of a run. Every gradient therefore sums the same terms in the same order as when the main thread
runs each ``W`` itself, bit for bit (tests/unit/test_weight_worker.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

#: Run ``W`` on the worker where its graph lives on a CUDA device (``False``: on the main thread, as on a CPU;
#: benchmarks/gpu.py measures the difference).
ON_CUDA = True
#: Run ``W`` on the worker on a CPU too (tests only: a CPU's autograd runs on the calling thread, so the worker
#: would compete with the main thread for the same cores).
ON_CPU = False


def overlaps(device: torch.device) -> bool:
    """Whether a ``W`` whose graph lives on ``device`` runs on the worker."""
    return ON_CPU if device.type == "cpu" else ON_CUDA and device.type == "cuda"


class WeightWorker:
    """One background thread that runs handed-over ``W`` halves in order (module docstring)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []

    def submit(self, run: Callable[[], None], device: torch.device) -> None:
        """Run ``run`` after every ``W`` handed over before it, on the caller's current stream of ``device``."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_pipe-W")
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._pending.append(self._pool.submit(_run_on, run, stream))

    def join(self) -> None:
        """Wait until every handed-over ``W`` has run; raise the first one's error, if any."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future in pending:
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001 - every W is waited for before the first error is raised
                error = error or e
        if error is not None:
            raise error

    def discard(self) -> None:
        """Wait for the handed-over ``W`` halves and drop their errors (a run that failed already)."""
        try:
            self.join()
        except BaseException:  # noqa: BLE001, S110 - the run's own error is the one reported
            pass


def _run_on(run: Callable[[], None], stream: torch.cuda.Stream | None) -> None:
    # the stream (and with it the device) is thread-local: the W's kernels follow the main thread's
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        run()


#: The process's worker, shared by its executors (an emulated pipeline runs several), so that a weight tied
#: across stages also sums its gradients in the main thread's order.
WORKER = WeightWorker()
