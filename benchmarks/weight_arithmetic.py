"""Host cost of the live policies' weight arithmetic: xpipe's prediction, pipemare's velocity.

    python benchmarks/weight_arithmetic.py --widths 1024 2048

One process, one thread, the one-device emulation (``stages=2``) of an MLP of 8 ``Linear(width, width)``
layers trained with Adam: for each width, the median host time of one xpipe prediction, and the aten
operations dispatched per prediction (with ``--count``; on an accelerator each is a kernel launch except
the reads of Adam's step counters, host scalars). A CPU runs Adam's directions per tensor, an accelerator
with fused passes; ``--fused`` runs the accelerator's path here, to count what it launches. Run it on two
checkouts to compare them: the numbers of docs/benchmarks.md ("One GPU") came from the commits before and
after each change, on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu import CountOps  # noqa: E402
from lightning_pipe.engine.policies import live  # noqa: E402
from tests.harness.lightning_run import train  # noqa: E402


def measure(width: int, count: bool) -> tuple[float, int | None]:
    """(median seconds per prediction, aten ops per prediction or None) over a 12-step xpipe run."""
    seconds: list[float] = []
    ops: list[int] = []
    predict = live.XPipePolicy.predict

    def timed(policy: live.XPipePolicy, distance: int) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        values = predict(policy, distance)
        seconds.append(time.perf_counter() - start)
        if count:  # again, counted (it writes the same values into the same storage)
            with CountOps() as counter:
                predict(policy, distance)
            ops.append(counter.count)
        return values

    live.XPipePolicy.predict = timed
    try:
        train({"devices": 1, "max_steps": 12, "epochs": 1, "batch_size": 16,
               "model": {"optimizer": "adam", "width": width, "depth": 8},
               "strategy": {"schedule": "xpipe", "stages": 2, "micro_batches": 4, "quality_warning": False}})
    finally:
        live.XPipePolicy.predict = predict
    return statistics.median(seconds), (int(statistics.median(ops)) if ops else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048], help="layer widths to measure")
    parser.add_argument("--count", action="store_true", help="also count the aten operations per prediction")
    parser.add_argument("--fused", action="store_true",
                        help="the accelerator's fused direction passes on the CPU too (live.FUSED_DIRECTIONS_ON_CPU): "
                             "what an accelerator launches, counted here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    live.FUSED_DIRECTIONS_ON_CPU = args.fused
    print("| width | ms per xpipe prediction (median) | aten ops per prediction |")
    print("|---|---|---|")
    for width in args.widths:
        seconds, ops = measure(width, args.count)
        print(f"| {width} | {1e3 * seconds:.2f} | {ops if ops is not None else '-'} |", flush=True)


if __name__ == "__main__":
    main()
