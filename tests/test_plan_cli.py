"""`lightning-pipe plan` end to end on tiny models (in-process through jsonargparse, and the console entry)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_pipe.plan_cli import main, plan
from tests.lightning_run import TrunkModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_cli_prints_schedules_and_the_chosen_partition(tmp_path, capsys):
    cache = tmp_path / "profiles.json"
    main(["plan", "--model", "tests.lightning_run.TrunkModel", "--model.depth", "3", "--batch_shape", "[16,8]",
          "--stages", "2", "--memory_gib", "1.0", "--max_micro_batches", "8", "--repeats", "1",
          "--cache", str(cache), "--timeline", "null"])
    out = capsys.readouterr().out
    assert "TrunkModel: trunk model with 6 layers, batch 16, 2 stages, memory limit 1.0 GiB per device" in out
    assert "profiled on cpu at micro-batch sizes 2 and 16" in out
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        assert f"| {schedule} " in out
    assert "chosen: " in out and "| stage | layers" in out and "balance='uniform' [3, 3]" in out
    assert cache.exists()


def test_plan_writes_the_timeline_of_the_chosen_plan(tmp_path):
    path = tmp_path / "plan.png"
    report = plan(TrunkModel(depth=3), stages=2, batch_shape=[16, 8], schedules=["1f1b"], micro_batches=[4],
                  timeline=str(path), repeats=1)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report.timeline == str(path)
    simulated = report.simulated
    # the closed form (M-1) t* + sum t_d bounds the simulated makespan from above; M t* from below
    assert 4 * report.best.bottleneck * (1 - 1e-9) <= simulated.step_time <= report.best.step_time * (1 + 1e-9)
    assert f"timeline of the chosen plan: {path}" in report.text


def test_plan_reports_the_best_plan_and_errors_without_a_batch():
    report = plan(TrunkModel(depth=4), stages=2, batch_shape=[8, 8], schedules=["1f1b", "pipedream"],
                  micro_batches=[2, 4], timeline=None, repeats=1)
    assert set(report.plans) == {"1f1b", "pipedream"} and report.best is not None
    assert report.best.throughput == max(p.throughput for p in report.plans.values())
    assert sum(report.best.balance) == 8 and [p.micro_batch for p in report.profiles] == [2, 4]
    with pytest.raises(ValueError, match="give batch_shape"):
        plan(TrunkModel(), stages=2, timeline=None)


def test_console_script_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-c", "from lightning_pipe.plan_cli import main; main()", "plan", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert result.returncode == 0, result.stderr
    assert "--batch_shape" in result.stdout and "--memory_gib" in result.stdout
