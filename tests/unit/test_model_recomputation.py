"""The model's own activation checkpointing (``torch.utils.checkpoint`` in a block, Hugging Face's
``gradient_checkpointing_enable()``) under each kind of weight policy (docs/algorithms.md, "Activation
recomputation"): a policy that keeps the forward's weights recomputes them exactly; pipemare and xpipe,
which keep none, refuse it at the first backward instead of training something else."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.errors import PipeConfigError


class Block(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.linear, self.recompute = nn.Linear(16, 16), recompute

    def forward(self, x):
        def layer(h):
            return torch.tanh(self.linear(h))

        return checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)


class Net(L.LightningModule):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.model = nn.Sequential(*[Block(recompute) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.model(torch.relu(self.pre(x)))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)  # large steps: stale weights differ visibly


def fit(module: L.LightningModule, schedule: str, data: TensorDataset, batch_size: int = 16) -> L.LightningModule:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        strategy=PipeStrategy(schedule=schedule, stages=4, micro_batches=4))
    trainer.fit(module, DataLoader(data, batch_size=batch_size))
    return module


def samples() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream", "pipedream_2bw"])
def test_a_model_that_checkpoints_its_blocks_trains_as_without(schedule):
    recomputed, kept = fit(Net(True), schedule, samples()), fit(Net(False), schedule, samples())
    for (name, got), want in zip(recomputed.state_dict().items(), kept.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("schedule", ["pipemare", "xpipe"])
def test_a_policy_without_forward_weights_refuses_the_models_own_checkpointing(schedule):
    with pytest.raises(PipeConfigError, match=r"a Linear ran its forward again inside .*'s backward.*"
                                              r"torch\.utils\.checkpoint.*schedule='pipedream' or 'pipedream_2bw'"):
        fit(Net(True), schedule, samples())
    nn.Linear(2, 2)(torch.ones(2))  # the refusal is held only during a backward: nothing is left behind


def test_hugging_face_gradient_checkpointing_is_refused_under_pipemare():
    pytest.importorskip("transformers")
    from tests.harness.hf_models import HFCausalLM, token_windows

    module = HFCausalLM("llama")
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(PipeConfigError, match="ran its forward again inside"):
        fit(module, "pipemare", token_windows(32), batch_size=8)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_gradient_checkpointing_trains_as_without_under_pipedream(reentrant):
    """Reentrant checkpointing (the older default) refuses ``autograd.grad``, which finding the stage of the
    parameters outside the trunk used; that walks the graph now."""
    pytest.importorskip("transformers")
    from tests.harness.hf_models import HFCausalLM, token_windows

    recomputing = HFCausalLM("llama")
    recomputing.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    recomputed = fit(recomputing, "pipedream", token_windows(32), batch_size=8)
    kept = fit(HFCausalLM("llama"), "pipedream", token_windows(32), batch_size=8)
    for (name, got), want in zip(recomputed.state_dict().items(), kept.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
