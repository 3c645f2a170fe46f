"""The opt-in CPU accounting plugin (docs/testing.md) charges each test file its wall and machine CPU time."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.harness.cpu_accounting import machine_cpu_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_machine_cpu_seconds_grow_while_this_process_computes():
    before = machine_cpu_seconds()
    deadline = os.times().elapsed + 0.3
    while os.times().elapsed < deadline:
        pass
    assert machine_cpu_seconds() - before >= 0.1  # a busy third of a second is at least a tenth of a CPU-second


def test_the_summary_lists_each_file_with_its_tests(tmp_path):
    (tmp_path / "test_busy.py").write_text(
        "import os\n\ndef test_a():\n    end = os.times().elapsed + 0.2\n    while os.times().elapsed < end:\n        pass\n\n"
        "def test_b():\n    pass\n")
    (tmp_path / "test_idle.py").write_text("def test_c():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.harness.cpu_accounting", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("CPU accounting: "))
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 2:header + 4]}
    assert set(rows) == {"test_busy.py", "test_idle.py"}, done.stdout
    assert rows["test_busy.py"][2] == "2" and rows["test_idle.py"][2] == "1"
    assert float(rows["test_busy.py"][0]) >= 0.2 and float(rows["test_busy.py"][1]) >= 0.1
    assert list(rows) == ["test_busy.py", "test_idle.py"]  # the heaviest first
