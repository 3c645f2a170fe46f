"""Progress of ``lightning-pipe plan``'s profiling on stderr, so a long profile is not silent.

The profiler reports ``progress(phase, done, total)`` after every round
(:data:`lightning_pipe.planning.noise.Progress`): the warm-up (open-ended: until the timings
settle), then the timed rounds (whose total grows when they spread too much). On a terminal that is
a tqdm bar (tqdm comes with Lightning); in a log file, where a bar's carriage returns would pile up
on one line, plain lines: one per phase and one every ``interval`` seconds. stdout keeps only the report.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

from tqdm import tqdm


class ProfileProgress:
    """A context manager whose instance is the profiler's ``progress`` callback.

    Args:
        what: the label, e.g. ``"profiling 8 layers at micro-batch size 8"``.
        enabled: ``False`` shows nothing (``--progress false``).
        stream: where it goes (default stderr).
        interval: seconds between plain lines when ``stream`` is not a terminal.
    """

    def __init__(self, what: str, enabled: bool = True, stream: TextIO | None = None, interval: float = 10.0) -> None:
        self.what, self.enabled, self.interval = what, enabled, interval
        self.stream = stream if stream is not None else sys.stderr
        self.bar: tqdm | None = None
        self.phase, self.done, self.total, self.last = "", 0, None, 0.0

    def __enter__(self) -> ProfileProgress:
        if self.enabled and self.stream.isatty():
            self.bar = tqdm(desc=self.what, file=self.stream, unit="round", leave=True, dynamic_ncols=True)
        return self

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        new_phase = phase != self.phase
        if new_phase and self.phase and self.bar is None:
            self._line()  # how the phase that ends ended
        self.phase, self.done, self.total = phase, done, total
        if self.bar is not None:
            if new_phase:  # a new phase restarts the count
                self.bar.reset(total=total)
                self.bar.set_description(f"{self.what}: {phase}", refresh=False)
            elif total != self.bar.total:  # more timed rounds than planned: the first ones spread too much
                self.bar.total = total
            self.bar.update(done - self.bar.n)
        elif new_phase or time.monotonic() - self.last >= self.interval:
            self._line()

    def _line(self) -> None:
        of = f" of {self.total}" if self.total is not None else ""
        print(f"{self.what}: {self.phase} round {self.done}{of}", file=self.stream, flush=True)
        self.last = time.monotonic()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.phase:
            self._line()


__all__ = ["ProfileProgress"]
