"""Logged values are captured per micro-batch without a host synchronisation (the tensor stays where
it was logged) and combined once per step into what one full-batch call would log."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_pipe.lightning.log_replay import LogCapture, combine


class Logs(L.LightningModule):
    pass


def test_values_stay_tensors_until_the_step_is_combined():
    module = Logs()
    with LogCapture(module) as capture:
        for size, loss in ((3, 1.0), (1, 5.0)):
            capture.batch_size = size
            module.log("loss", torch.tensor(loss))
            module.log("biggest", torch.tensor(loss), reduce_fx="max")
            module.log("seen", float(size), reduce_fx="sum")
    assert all(isinstance(r.value, torch.Tensor) for r in capture.records if r.name != "seen")
    combined = {r.name: r for r in combine(capture.records, module)}
    assert combined["loss"].value == pytest.approx((3 * 1.0 + 1 * 5.0) / 4) and combined["loss"].batch_size == 4
    assert combined["biggest"].value == 5.0 and combined["seen"].value == 4.0
    assert all(type(r.value) is float for r in combined.values())  # picklable, device-free for the broadcast


def test_a_pipelined_run_leaves_the_warning_filters_alone_and_gives_no_sync_dist_advice():
    """Epoch-level values are logged as synced (the identity with one pipeline): Lightning has no advice to
    give, and the process-wide warning filters stay as the user set them."""
    import warnings

    from tests.harness.lightning_run import train

    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inside = list(warnings.filters)
        train({"epochs": 1, "batch_size": 16, "evaluate": True, "strategy": {"schedule": "1f1b", "stages": 2}})
        assert warnings.filters == inside
    assert warnings.filters == before
    assert not [w for w in caught if "sync_dist=True" in str(w.message)]


def test_in_one_process_the_step_reads_nothing_back_to_the_host(monkeypatch):
    """Within one process (the emulation) the loss and the logged values stay on the device: a read
    (``item``, ``tolist``, ``float``) would make the host wait for the step's queued work on a GPU, and
    the device would idle across the step boundary (issue 30; benchmarks/gpu.py counts it on one)."""
    from lightning_pipe.lightning.pipeline import StagePipeline
    from tests.harness.lightning_run import train

    replayed = StagePipeline.replayed_loss
    inside = []

    def forbidden(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if inside:
                raise AssertionError(f"Tensor.{name} read a value back to the host inside the step")
            return original(self, *args, **kwargs)
        return read

    def watched(self, ran):
        inside.append(True)
        try:
            return replayed(self, ran)
        finally:
            inside.pop()

    for name in ("item", "tolist", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    monkeypatch.setattr(StagePipeline, "replayed_loss", watched)
    got = train({"devices": 1, "max_steps": 3, "epochs": 1, "batch_size": 16,
                 "strategy": {"schedule": "1f1b", "stages": 2, "micro_batches": 4}})
    monkeypatch.undo()
    want = train({"devices": 1, "max_steps": 3, "epochs": 1, "batch_size": 16})
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx([m["train_loss"] for m in want["metrics"]], rel=1e-6)
    assert [m["seen"] for m in got["metrics"]] == [m["seen"] for m in want["metrics"]]


@pytest.mark.parametrize("precision, dtype", [("64-true", torch.float64), ("32-true", torch.float32)])
def test_the_step_s_loss_and_logged_values_keep_one_device_s_dtype(precision, dtype):
    """Under "64-true" one device returns and logs the loss in float64; the pipeline rounded both to float32."""
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipeStrategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.trunk = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)])

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self.trunk(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Seen(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.loss, self.logged = outputs["loss"], trainer.callback_metrics["train_loss"]

    def fit(strategy: PipeStrategy | None) -> Seen:
        seen, g = Seen(), torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, precision=precision, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[seen], **({"strategy": strategy} if strategy else {}))
        trainer.fit(Net(), DataLoader(data, batch_size=8))
        return seen

    want, got = fit(None), fit(PipeStrategy(schedule="1f1b", stages=2, micro_batches=4))
    for one_device, pipelined in ((want.loss, got.loss), (want.logged, got.logged)):
        assert one_device.dtype == pipelined.dtype == dtype
        torch.testing.assert_close(pipelined, one_device, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)
