"""A one-device checkpoint's optimizer state has no parameter names, only positions: a pipeline matches them to the
order the whole module's configure_optimizers lists (asked at setup, before the cut), and writes its own checkpoints
in that order, so that plain Lightning resumes them; where the order is unknown, a wrong match is refused by shape,
not left to the optimizer's step."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy, consolidate_checkpoint
from lightning_pipe.errors import CheckpointMismatchError
from lightning_pipe.lightning.checkpointing import check_state_shapes, merge_optimizer_states, slice_optimizer_state


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


def fit(epochs: int, strategy: PipeStrategy | None = None, ckpt_in: str | None = None, ckpt_out: str | None = None,
        module: type[L.LightningModule] = Grouped) -> dict:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    model = module()
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


class Reordered(Grouped):
    """One param group listing the trunk last to first and its biases before its weights, another the rest: no
    stage's share of it is in ``self.parameters()`` order."""

    def configure_optimizers(self):
        trunk = [m for layer in reversed(self.trunk) for m in layer.modules() if isinstance(m, nn.Linear)]
        listed = [m.bias for m in trunk] + [m.weight for m in trunk]
        return torch.optim.Adam([{"params": listed}, {"params": [*self.head.parameters(), *self.pre.parameters()], "lr": 3e-3}],
                                lr=1e-2)


def test_a_pipeline_checkpoint_resumes_on_one_device_whatever_order_the_param_groups_list(tmp_path):
    """Plain Lightning reads optimizer state by position: a pipeline's checkpoint lists each group as the whole
    module's configure_optimizers does, so the resumed run equals the uninterrupted one (before, each parameter got
    another one's Adam moments)."""
    ckpt = str(tmp_path / "pipeline.ckpt")
    fit(1, PipeStrategy(schedule="1f1b", stages=2, micro_batches=2), ckpt_out=ckpt, module=Reordered)
    want = fit(2, module=Reordered)
    got = fit(2, ckpt_in=ckpt, module=Reordered)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("schedule, sharded", [("1f1b", False), ("pipemare", False), ("1f1b", True)])
def test_the_merged_optimizer_state_lists_each_group_as_configure_optimizers_does(tmp_path, schedule, sharded):
    """In the single file, and in a sharded directory consolidated into one."""
    ckpt = str(tmp_path / "pipeline.ckpt")
    fit(1, PipeStrategy(schedule=schedule, stages=4, micro_batches=2, save_distributed_checkpoint=sharded), ckpt_out=ckpt,
        module=Reordered)
    if sharded:
        consolidate_checkpoint(ckpt, tmp_path / "one.ckpt")
        ckpt = str(tmp_path / "one.ckpt")
    state = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    model = Reordered()
    names = {id(p): n for n, p in model.named_parameters()}
    want = [[names[id(p)] for p in group["params"]] for group in model.configure_optimizers().param_groups]
    assert [[state["pipe_param_names"][i] for i in group["params"]] for group in state["param_groups"]] == want


def test_stage_states_merge_in_the_whole_modules_group_order():
    """Each stage's optimizer lists only its own parameters (in the user's relative order); the merge places them as
    the whole module's optimizer does, not by module order, and takes a shared parameter from its owner."""
    def part(names, value):
        return {"state": {i: {"step": torch.tensor(value)} for i in range(len(names))},
                "param_groups": [{"params": list(range(len(names))), "lr": 0.1}]}, [names]
    parts = [part(["t.1", "t.0", "pre"], 0.0), part(["t.3", "t.2", "pre"], 1.0)]
    module_order = ["pre", "t.0", "t.1", "t.2", "t.3"]
    configured = [["t.3", "t.2", "t.1", "t.0", "pre"]]
    merged = merge_optimizer_states(parts, module_order, {"pre": 1}, configured)
    assert merged["pipe_param_names"] == configured[0]
    assert [float(merged["state"][i]["step"]) for i in range(5)] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert merge_optimizer_states(parts, module_order, {"pre": 1})["pipe_param_names"] == module_order  # order unknown


def test_a_stage_slices_a_one_device_state_by_the_whole_modules_group_order():
    """Processes holding one stage each: the one-device file's positions are the whole module's optimizer's."""
    merged = {"state": {i: {"step": torch.tensor(float(i))} for i in range(4)},
              "param_groups": [{"params": [0, 1, 2, 3], "lr": 0.1}]}
    configured = [["t.1.bias", "t.0.bias", "t.1.weight", "t.0.weight"]]
    local = slice_optimizer_state(merged, [["t.1.bias", "t.1.weight"]], ["t.0.weight", "t.0.bias", "t.1.weight", "t.1.bias"],
                                  configured)
    assert [float(local["state"][i]["step"]) for i in range(2)] == [0.0, 2.0]
