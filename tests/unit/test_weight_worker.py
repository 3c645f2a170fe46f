"""Zero-bubble ``W`` on the background worker (engine/weight_worker.py): the same bits as on the main thread.

On a CPU the worker is off by default (a CPU's autograd runs on the calling thread); these tests turn it on,
so the worker's ``W`` runs beside the main thread's next forwards and input backwards, as on a GPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_pipe.engine import weight_worker
from lightning_pipe.engine.weight_worker import WeightWorker
from tests.harness.lightning_run import train

BATCH = 16


@pytest.fixture
def worker_on_cpu(monkeypatch):
    """The worker on, every ``W`` handed to it counted (so a test sees that it ran there) and started late, so
    that an action the executor let run beside it without waiting would run first."""
    monkeypatch.setattr(weight_worker, "ON_CPU", True)
    handed = []
    submit = weight_worker.WORKER.submit

    def late(run):
        return lambda: (time.sleep(0.02), run())

    monkeypatch.setattr(weight_worker.WORKER, "submit", lambda run, device: (handed.append(device), submit(late(run), device)))
    return handed


def run(schedule: str, stages: int) -> dict:
    return train({"epochs": 1, "batch_size": BATCH,
                  "strategy": {"schedule": schedule, "stages": stages, "micro_batches": 4}})


def assert_same_bits(got: dict, want: dict) -> None:
    assert [m["train_loss"] for m in got["metrics"]] == [m["train_loss"] for m in want["metrics"]]
    for key, value in want["state"].items():
        assert torch.equal(got["state"][key], value), key


@pytest.mark.parametrize("schedule,stages", [("zb_h1", 4), ("zbv", 2), ("dualpipev", 2)])
def test_background_w_computes_the_main_threads_bits(schedule, stages, worker_on_cpu, monkeypatch):
    """float32 (whose sums depend on their order, unlike bf16-mixed's sums of bfloat16 products): every W handed
    to the worker, and the bits of the same run with every W on the main thread. Without the executor's waits
    (a whole backward of dualpipev after a W of the same chunk) the weights differ by 1e-8."""
    got = run(schedule, stages)
    assert worker_on_cpu, "no W ran on the worker"
    monkeypatch.setattr(weight_worker, "ON_CPU", False)
    assert_same_bits(got, run(schedule, stages))


def test_the_worker_runs_in_order_and_raises_the_first_error_after_all_ran():
    worker, ran = WeightWorker(), []
    main = threading.get_ident()

    def step(i: int, fail: bool = False):
        def run():
            assert threading.get_ident() != main
            ran.append(i)
            if fail:
                raise ValueError(f"W {i}")
        return run

    for i in range(5):
        worker.submit(step(i, fail=i in (1, 3)), torch.device("cpu"))
    with pytest.raises(ValueError, match="W 1"):
        worker.join()
    assert ran == [0, 1, 2, 3, 4]
    worker.join()  # nothing left
    worker.submit(step(5, fail=True), torch.device("cpu"))
    worker.discard()  # a failed run's cleanup drops it
    assert ran[-1] == 5


def test_an_error_in_a_background_w_stops_the_step(worker_on_cpu, monkeypatch):
    """A gradient hook that raises inside a W (on the worker) fails the step with its own error."""
    from tests.harness import lightning_run

    def failing_hook(grad):
        raise RuntimeError("hook failed on the worker")

    build = lightning_run.TrunkModel.build

    def with_hook(self):
        build(self)
        self.model[-2].weight.register_hook(failing_hook)  # the trunk's last linear layer: a later stage's W

    monkeypatch.setattr(lightning_run.TrunkModel, "build", with_hook)
    with pytest.raises(RuntimeError, match="hook failed on the worker"):
        run("zb_h1", 2)
    assert worker_on_cpu
