"""pipemare and xpipe without in-place storage exchange (torch 2.11 lacks ``UntypedStorage._swap_data_ptr_``):
they copy the weights instead, compute the same numbers, and say so once at setup (issue 30)."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_pipe.engine.policies import live
from tests.harness.lightning_run import train

OPTIONS = {"pipemare": {"pipemare": {"lr_warmup_steps": 3}}, "xpipe": {}}


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
    assert [m["train_loss"] for m in copied["metrics"]] == [m["train_loss"] for m in exchanged["metrics"]]
    for key, value in exchanged["state"].items():
        assert torch.equal(copied["state"][key], value), key
    assert any("copies the weights at every forward and backward" in r.getMessage() for r in caplog.records)
