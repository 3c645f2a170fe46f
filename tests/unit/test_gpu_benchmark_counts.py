"""benchmarks/gpu.py's host-bound proxy on the CPU (issue 30): ``--count`` counts one step's host work exactly."""

from __future__ import annotations

import math

import pytest

from tests.harness.benchmark_scripts import load_benchmark


def test_host_bound_counts_one_steps_python_calls_engine_calls_and_operations():
    benchmark = load_benchmark("gpu")
    rows = benchmark.main(["--host-bound", "--blocks", "4", "--warmup", "1", "--steps", "1", "--count",
                           "--variants", "accumulation", "1f1b", "zb_h1"])
    accumulation, one_f_one_b, zero_bubble = rows
    for row in rows:
        assert math.isfinite(row.ms_per_step) and row.python_calls > 0 and row.aten_ops > 0
    # one backward per micro-batch (8) and, emulated, per stage (4); zero-bubble W adds one per weight group
    assert accumulation.engine_calls == 8
    assert one_f_one_b.engine_calls == 8 * 4
    assert zero_bubble.engine_calls > one_f_one_b.engine_calls
    # the same forward and backward kernels: a pipeline's step dispatches about what accumulation's does
    assert 0.9 < one_f_one_b.aten_ops / accumulation.aten_ops < 1.2


def test_ablations_are_named_variants_of_their_schedule():
    """``SCHEDULE/ABLATION`` runs the schedule's options with the ablation's merged in (its patches apply during
    the run); an unknown ablation stops with the names there are."""
    benchmark = load_benchmark("gpu")
    chosen = ["accumulation", "pipemare", "pipemare/no-correction", "zbv/w-main-thread"]
    got = dict(benchmark.variants(4, chosen))
    assert list(got) == chosen
    assert got["pipemare/no-correction"] == {**got["pipemare"], "pipemare": {"correction": False}}
    assert got["zbv/w-main-thread"]["schedule"] == "zbv"
    with pytest.raises(SystemExit, match="w-main-thread"):
        benchmark.variants(4, ["zbv/no-such-thing"])


def test_allocator_events_are_per_step_differences_and_zero_where_torch_lacks_a_counter():
    benchmark = load_benchmark("gpu")
    before = {"num_device_alloc": 10, "num_device_free": 4, "num_alloc_retries": 0}
    after = {"num_device_alloc": 26, "num_device_free": 4, "num_alloc_retries": 2}
    assert benchmark.allocator_events(before, after, steps=8) == {
        "device_alloc": 2.0, "device_free": 0.0, "alloc_retries": 0.25, "sync_all_streams": 0.0}
