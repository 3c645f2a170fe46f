"""pipemare and xpipe without in-place storage exchange (torch 2.11 lacks ``UntypedStorage._swap_data_ptr_``):
pipemare redirects its backwards to the weights they want through saved-tensor hooks instead (xpipe always does),
computes the same numbers, and copies no weights at forwards and backwards; copying every version in (the
benchmarks' baseline, and parameters that are views of a larger buffer) computes them too (issue 30)."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.engine.policies import base, live, saved_weights
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
def test_exchanging_redirecting_or_copying_the_weights_computes_the_same_numbers(schedule, monkeypatch):
    """pipemare exchanges storages where this torch can and redirects its corrected backwards where it cannot
    (torch 2.11); xpipe always redirects, so that a forward and a backward prediction made from the same STEP at
    the same distance are one (here all of them: half the predictions). Copying every version in is the
    benchmarks' baseline. All compute the same numbers, bit for bit; only copying copies at the passes."""
    assert live.exchanges_storage(), "this torch exchanges in place: the comparison needs it"
    calls = {"exchange": 0, "copy": 0, "segment end": 0, "redirect": 0, "prediction": 0, "bellwether": 0}
    exchange, load, end_segment = live._exchange, live._LivePolicy.load, live._LivePolicy.end_segment
    predict, distance = live.XPipePolicy.predict, live.XPipePolicy._distance
    pack = saved_weights.BackwardWeights._pack_parameter  # (float32: no casts to find)

    def count(key: str) -> None:
        calls[key] += 1

    def counted_load(self, values, token):
        calls["copy"] += self._holding != token and bool(self.params)
        return load(self, values, token)

    def counted_pack(self, saved):
        packed = pack(self, saved)
        calls["redirect"] += not isinstance(packed, torch.Tensor)
        return packed

    monkeypatch.setattr(live, "_exchange", lambda a, b: count("exchange") or exchange(a, b))
    monkeypatch.setattr(live._LivePolicy, "load", counted_load)
    monkeypatch.setattr(live._LivePolicy, "end_segment", lambda self, m: count("segment end") or end_segment(self, m))
    monkeypatch.setattr(live.XPipePolicy, "predict", lambda self, d: count("prediction") or predict(self, d))
    monkeypatch.setattr(live.XPipePolicy, "_distance", lambda self, *a: count("bellwether") or distance(self, *a))
    monkeypatch.setattr(saved_weights.BackwardWeights, "_pack_parameter", counted_pack)

    def counted_run() -> tuple[dict, dict]:
        calls.update(dict.fromkeys(calls, 0))
        return run(schedule), dict(calls)

    default, by_default = counted_run()
    if schedule == "pipemare":
        assert by_default["exchange"] and not by_default["redirect"], by_default
    else:
        assert by_default["redirect"] and not by_default["exchange"], by_default
        assert 2 * by_default["prediction"] == by_default["bellwether"], by_default
    monkeypatch.setattr(live._LivePolicy, "moves_values", "copy")
    copied, by_copy = counted_run()
    assert by_copy["copy"] > 2 * by_copy["segment end"] and not by_copy["exchange"] and not by_copy["redirect"], by_copy
    monkeypatch.setattr(live._LivePolicy, "moves_values", "auto")
    monkeypatch.setattr(live, "exchanges_storage", lambda: False)  # as on torch 2.11
    redirected, by_redirect = counted_run()
    assert by_redirect["redirect"] and not by_redirect["exchange"], by_redirect
    assert by_redirect["copy"] <= by_redirect["segment end"], "a copy only where a segment ends (the masters back in)"
    assert_same_numbers(copied, default)
    assert_same_numbers(redirected, default)


def test_a_parameter_that_is_a_view_of_a_larger_buffer_is_copied_in():
    """Neither an exchange nor a redirected view can stand for a parameter that shares its storage (a flat buffer)."""
    flat = torch.zeros(10)
    views = {"a": torch.nn.Parameter(flat[:4]), "b": torch.nn.Parameter(flat[4:])}
    whole = {"a": torch.nn.Parameter(torch.zeros(2, 2)), "b": torch.nn.Parameter(torch.zeros(6).t())}
    assert live.how_values_move(views) == "copy"
    assert live.how_values_move(whole) == ("exchange" if live.exchanges_storage() else "redirect")
    assert live.how_values_move(whole, "copy") == "copy"
    assert live.how_values_move(whole, "redirect") == "redirect"
    assert live.how_values_move(whole, exchange=False) == "redirect"  # (xpipe's)
    with pytest.raises(ValueError, match="choose 'auto', 'redirect' or 'copy'"):
        live.how_values_move(whole, "exchange")


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


@pytest.mark.parametrize("correction", [True, False])
def test_a_redirecting_pipemare_stage_hooks_its_forwards_only_where_a_backward_can_be_corrected(correction, monkeypatch):
    """Without the exchange, a pipemare forward keeps its parameters as references only where its backward may read
    ``W - tau * delta``: not on the last stage (no STEP between its forward and backward), not without correction."""
    from torch import nn

    from lightning_pipe.engine.policies import AsyncOptions, PipeMareOptions, PipeMarePolicy

    monkeypatch.setattr(live, "exchanges_storage", lambda: False)
    packed = []
    pack = saved_weights.BackwardWeights._pack_parameter
    monkeypatch.setattr(saved_weights.BackwardWeights, "_pack_parameter", lambda self, t: packed.append(1) or pack(self, t))
    for stage, corrected in ((0, correction), (1, False)):
        module = nn.Linear(4, 4)
        policy = PipeMarePolicy(module, torch.optim.SGD(module.parameters(), lr=0.1), stage, 2, 1,
                                AsyncOptions(PipeMareOptions(correction=correction)))
        assert policy.moves == "redirect"
        packed.clear()
        with policy.forward(0):
            module(torch.randn(2, 4, requires_grad=True))
        assert bool(packed) is corrected, (stage, correction)


def test_a_corrected_backward_on_a_redirecting_pipemare_stage_without_hooks_stops_rather_than_reads_w(monkeypatch):
    """The last stage's forwards keep their parameters as they are (no STEP falls between its forward and backward);
    should a corrected backward ever come there, it stops instead of reading the uncorrected weights."""
    from torch import nn

    from lightning_pipe.engine.policies import AsyncOptions, PipeMareOptions, PipeMarePolicy

    monkeypatch.setattr(live, "exchanges_storage", lambda: False)  # as on torch 2.11
    module = nn.Linear(4, 4)
    policy = PipeMarePolicy(module, torch.optim.SGD(module.parameters(), lr=0.1), 1, 2, 1,
                            AsyncOptions(PipeMareOptions(correction=True)))
    assert policy.moves == "redirect" and not policy._weights.redirect
    with policy.forward(0):
        y = module(torch.randn(2, 4))
    y.sum().backward()
    policy.step()  # a STEP between the forward and its backward: tau = 1
    with pytest.raises(RuntimeError, match="pipemare backward on stage 1, the last, is 1 STEPs late"):
        with policy.backward(0):
            pass
