"""Where the suite's time goes: an opt-in pytest plugin that charges each test the whole machine's CPU time.

    python -m pytest -q -p tests.harness.cpu_accounting

Each test (setup, call and teardown) is charged the CPU seconds that every process of the machine used
while it ran (``/proc/stat``), so the processes it started (pool workers, fresh jobs, Lightning's
launched ranks) count too; run it serially on an otherwise idle machine. At the end it prints the wall
and CPU seconds per test file, the heaviest first, and the session's totals (docs/testing.md).
Linux only.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Generator
from typing import Any

import pytest

_TICKS = os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """CPU seconds every core of this machine has spent busy since boot."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / _TICKS


class CpuAccounting:
    def __init__(self) -> None:
        self.per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        self.start = (time.monotonic(), machine_cpu_seconds())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
        wall, cpu = time.monotonic(), machine_cpu_seconds()
        yield
        totals = self.per_file[item.nodeid.split("::")[0]]
        totals[0] += time.monotonic() - wall
        totals[1] += machine_cpu_seconds() - cpu
        totals[2] += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        wall, cpu = time.monotonic() - self.start[0], machine_cpu_seconds() - self.start[1]
        write = terminalreporter.write_line
        write("")
        write(f"CPU accounting: {wall:.0f} s wall, {cpu:.0f} CPU-s on the machine ({os.cpu_count()} cores)")
        write(f"{'file':<62} {'wall s':>7} {'CPU s':>7} {'tests':>5}")
        for path, (file_wall, file_cpu, count) in sorted(self.per_file.items(), key=lambda kv: -kv[1][1]):
            write(f"{path:<62} {file_wall:7.1f} {file_cpu:7.1f} {count:5d}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuAccounting(), "cpu_accounting_instance")
