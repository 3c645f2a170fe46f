"""A one-device checkpoint's optimizer state has no parameter names: an emulated pipeline matches it position by
position to its own optimizer (the same configure_optimizers built both), whatever order its param groups list the
parameters in; where it cannot (processes holding one stage each), a wrong match is refused by shape, not left to
the optimizer's step."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.errors import CheckpointMismatchError
from lightning_pipe.lightning.checkpointing import check_state_shapes, slice_optimizer_state


class Grouped(L.LightningModule):
    """AdamW with weight decay on the weights only: two param groups chosen by name, the weights first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.trunk = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.head(self.trunk(self.pre(batch[0]))), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        named = list(self.named_parameters())
        return torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                                  {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}], lr=1e-2)


def fit(epochs: int, strategy: PipeStrategy | None = None, ckpt_in: str | None = None, ckpt_out: str | None = None) -> dict:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    model = Grouped()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        **({"strategy": strategy} if strategy else {}))
    trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return model.state_dict()


def test_an_emulated_pipeline_resumes_a_one_device_checkpoint_with_param_groups_by_name(tmp_path):
    ckpt = str(tmp_path / "one-device.ckpt")
    fit(1, ckpt_out=ckpt)
    want = fit(2, ckpt_in=ckpt)
    got = fit(2, PipeStrategy(schedule="1f1b", stages=2, micro_batches=2), ckpt_in=ckpt)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_state_matched_to_the_wrong_parameters_is_refused_by_shape():
    """State matched to other parameters than it was saved for (here the optimizer lists them in another order than
    the file) fails on shape with the parameter's name, not inside the optimizer's step."""
    weight, bias = nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(3))
    merged = {"state": {0: {"exp_avg": torch.zeros(3, 2)}, 1: {"exp_avg": torch.zeros(3)}},  # groups: weights, biases
              "param_groups": [{"params": [0], "lr": 0.1}, {"params": [1], "lr": 0.1}]}
    optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [bias]}], lr=0.1)
    names = [["weight"], ["bias"]]
    check_state_shapes(slice_optimizer_state(merged, names, ["weight", "bias"]), optimizer, names)  # position by position
    merged["param_groups"] = [{"params": [0, 1], "lr": 0.1}]  # another grouping: self.parameters() order is assumed
    swapped = torch.optim.SGD([bias, weight], lr=0.1)
    with pytest.raises(CheckpointMismatchError, match=r"'exp_avg' for bias has shape \(3, 2\), not the parameter's \(3,\)"):
        check_state_shapes(slice_optimizer_state(merged, [["bias", "weight"]], ["weight", "bias"]), swapped,
                           [["bias", "weight"]])
