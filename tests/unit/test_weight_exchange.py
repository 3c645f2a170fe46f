"""pipemare and xpipe without in-place storage exchange (torch 2.11 lacks ``UntypedStorage._swap_data_ptr_``):
they copy the weights instead, compute the same numbers, and say so once at setup (issue 30)."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_pipe.engine.policies import base, live
from tests.harness.lightning_run import train

OPTIONS = {"pipemare": {"pipemare": {"lr_warmup_steps": 3}}, "xpipe": {}}


def assert_same_numbers(got: dict, want: dict) -> None:
    """Two runs' losses and final weights are equal, bit for bit."""
    assert [m["train_loss"] for m in got["metrics"]] == [m["train_loss"] for m in want["metrics"]]
    for key, value in want["state"].items():
        assert torch.equal(got["state"][key], value), key


def run(schedule: str) -> dict:
    return train({"devices": 1, "max_steps": 6, "epochs": 1, "batch_size": 16, "model": {"optimizer": "adam"},
                  "strategy": {"schedule": schedule, "stages": 3, "micro_batches": 4, "quality_warning": False,
                               **OPTIONS[schedule]}})


@pytest.mark.parametrize("schedule", sorted(OPTIONS))
def test_copying_the_weights_computes_what_exchanging_them_computes(schedule, monkeypatch, caplog):
    assert live.exchanges_storage(), "this torch exchanges in place: the comparison needs it"
    exchanges = []
    exchange = live._exchange
    monkeypatch.setattr(live, "_exchange", lambda a, b: exchanges.append(1) or exchange(a, b))
    exchanged = run(schedule)
    assert exchanges, "the first run exchanges"
    exchanges.clear()
    monkeypatch.setattr(live, "exchanges_storage", lambda: False)  # as on torch 2.11
    with caplog.at_level(logging.INFO, logger="lightning_pipe"):
        copied = run(schedule)
    assert not exchanges, "the second run copies"
    assert_same_numbers(copied, exchanged)
    assert any("copies the weights at every forward and backward" in r.getMessage() for r in caplog.records)


def test_fused_chunks_cut_tensors_by_bytes_small_on_a_cpu_and_large_on_an_accelerator(monkeypatch):
    monkeypatch.setattr(base, "CPU_FUSED_CHUNK_BYTES", 4 * 100)  # 100 float32 elements
    tensors = [torch.zeros(n) for n in (60, 40, 10, 200, 30)]
    assert base.fused_chunks(tensors) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]  # a large one alone
    assert base.fused_chunks([]) == []
    meta = [torch.empty(n, device="meta") for n in (60, 40, 10, 200, 30)]  # any device but the CPU: the larger limit
    assert base.fused_chunks(meta) == [slice(0, 5)]
    monkeypatch.setattr(base, "ACCELERATOR_FUSED_CHUNK_BYTES", 4 * 100)
    assert base.fused_chunks(meta) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]


@pytest.mark.parametrize("schedule", sorted(OPTIONS))
def test_chunked_fused_passes_compute_what_one_pass_computes(schedule, monkeypatch):
    """On a CPU the fused weight arithmetic runs over chunks of at most ``CPU_FUSED_CHUNK_BYTES``: a tensor per
    chunk computes, bit for bit, what one chunk for the whole stage computes."""
    monkeypatch.setattr(base, "CPU_FUSED_CHUNK_BYTES", 2**62)
    whole = run(schedule)
    monkeypatch.setattr(base, "CPU_FUSED_CHUNK_BYTES", 1)
    calls = []
    chunks = live.fused_chunks
    monkeypatch.setattr(live, "fused_chunks", lambda tensors: calls.append(len(chunks(tensors))) or chunks(tensors))
    chunked = run(schedule)
    assert max(calls) > 1, "the chunked run cuts a stage's tensors into several chunks"
    assert_same_numbers(chunked, whole)


@pytest.mark.parametrize("optimizer,xpipe", [("adam", {}), ("sgd", {"momentum_direction": "spectrain"})])
def test_fused_directions_compute_what_the_per_tensor_path_computes(optimizer, xpipe, monkeypatch):
    """xpipe's Adam and SpecTrain directions: the fused passes an accelerator runs equal, bit for bit, the
    per-tensor path a CPU runs (``FUSED_DIRECTIONS_ON_CPU`` runs the fused one here)."""
    def run_xpipe() -> dict:
        return train({"devices": 1, "max_steps": 6, "epochs": 1, "batch_size": 16, "model": {"optimizer": optimizer},
                      "strategy": {"schedule": "xpipe", "stages": 3, "micro_batches": 4, "quality_warning": False,
                                   "xpipe": xpipe}})

    per_tensor = run_xpipe()
    monkeypatch.setattr(live, "FUSED_DIRECTIONS_ON_CPU", True)
    calls = []
    directions = live.XPipePolicy._directions
    monkeypatch.setattr(live.XPipePolicy, "_directions", lambda self, *args: calls.append(1) or directions(self, *args))
    fused = run_xpipe()
    assert calls, "the second run takes the fused path"
    assert_same_numbers(fused, per_tensor)


def test_pipemare_writes_each_corrected_version_once_between_steps(monkeypatch):
    """``W - tau * delta`` changes only at a STEP: the corrected backwards between two STEPs with the same tau
    share one write of the corrected storage (the numbers stay those of the copying run, tested above)."""
    writes, backwards = [], []
    write, corrected = live.PipeMarePolicy._write_corrected, live.PipeMarePolicy._corrected

    def counted_write(self, outs, names, tau):
        writes.append((self.stage, self.steps, tau))
        return write(self, outs, names, tau)

    def counted_backward(self, tau):
        backwards.append((self.stage, self.steps, tau))
        return corrected(self, tau)

    monkeypatch.setattr(live.PipeMarePolicy, "_write_corrected", counted_write)
    monkeypatch.setattr(live.PipeMarePolicy, "_corrected", counted_backward)
    run("pipemare")
    assert len(backwards) > len(writes), "some corrected backwards share a version"
    assert writes == list(dict.fromkeys(backwards)), "one write per (stage, STEPs, tau), in the order first needed"
