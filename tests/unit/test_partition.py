"""Trunk discovery, balance and the in-place split, in one process."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.errors import BalanceError, TrunkUsageError
from lightning_pipe.partition import min_max_split, resolve_balance, stage_bounds
from lightning_pipe.partition.split import PartitionedTrunk, StagePass, StageStop


def trunk(n: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def test_split_keeps_state_dict_keys_and_runs_only_inside_a_step():
    seq = trunk()
    full = seq(torch.ones(2, 4))
    keys = set(seq.state_dict())
    part = PartitionedTrunk(seq, "model", stage_bounds([2, 4]), local=[1])
    assert set(seq.state_dict()) == {k for k in keys if not k.startswith(("0.", "1."))}
    assert isinstance(seq[0], nn.Identity) and isinstance(seq[2], nn.Linear)
    with pytest.raises(TrunkUsageError, match=r"only holds model\[2:6\].*load_from_checkpoint"):
        seq(torch.ones(2, 4))
    with part.acting(StagePass(0, first=True)):
        hidden = trunk()[:2](torch.ones(2, 4))
        torch.testing.assert_close(seq(hidden), full)
    with pytest.raises(TrunkUsageError):
        seq(torch.ones(2, 4))  # the behaviour ends with the block


def test_stage_stop_is_not_an_exception():
    assert not issubclass(StageStop, Exception)  # a user's `except Exception` cannot swallow it


def test_balance_modes():
    seq = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU())
    assert resolve_balance("uniform", seq, 4) == [2, 2, 1, 1]
    assert resolve_balance("parameters", seq, 2) == [1, 5]
    assert resolve_balance([1, 2, 3], seq, 3) == [1, 2, 3]
    with pytest.raises(BalanceError, match="gives a stage no layers"):
        resolve_balance([0, 6], seq, 2)
    with pytest.raises(BalanceError, match="'auto' is not known"):
        resolve_balance("auto", seq, 2)


class Blocks(nn.ModuleList):
    """A user's own container class."""


@pytest.mark.parametrize("container, named", [
    (nn.Sequential, "nn.Sequential"), (nn.ModuleList, "nn.ModuleList"), (Blocks, r"Blocks \(an nn.ModuleList\)"),
])
def test_too_few_layers_names_the_trunks_own_container(container, named):
    """zbv on 2 stages needs 4 virtual stages; the advice names the container the user wrote, not always nn.Sequential."""
    blocks = [nn.Linear(4, 4) for _ in range(3)]
    layers = container(*blocks) if container is nn.Sequential else container(blocks)
    with pytest.raises(BalanceError, match=rf"the trunk has 3 layers but the pipeline needs 4 stages; .* into more {named} entries"):
        resolve_balance("uniform", layers, 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(1, 12))
def test_min_max_split_is_optimal(costs, parts):
    parts = min(parts, len(costs))
    prefix = [0, *itertools.accumulate(costs)]
    _, counts = min_max_split(len(costs), parts, lambda i, j, d: prefix[j] - prefix[i], ties="earlier")
    assert len(counts) == parts and sum(counts) == len(costs) and min(counts) >= 1
    worst = max(sum(costs[a:b]) for a, b in stage_bounds(counts))
    # brute force over all contiguous splits
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in itertools.combinations(range(1, len(costs)), parts - 1)
    )
    assert worst == best


def test_checkpoint_writes_are_atomic(tmp_path):
    """A save that dies half-way leaves neither a truncated file nor a temporary behind."""
    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_pipe import PipeStrategy

    class DiesHalfway(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            with open(path, "wb") as f:
                f.write(b"half a checkpoint")
            raise KeyboardInterrupt("killed while saving")

    target = tmp_path / "model.ckpt"
    strategy = PipeStrategy(checkpoint_io=DiesHalfway())
    with pytest.raises(KeyboardInterrupt):
        strategy.save_checkpoint({"state_dict": {}}, target)
    assert list(tmp_path.iterdir()) == []
    strategy = PipeStrategy()
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, target)
    assert list(tmp_path.iterdir()) == [target]
    assert torch.load(target, weights_only=True)["state_dict"]["w"].sum() == 2


def test_a_killed_saves_leftovers_are_removed_by_the_next_save(tmp_path):
    """A save killed half-way leaves '<name>.partial-<pid>'; the next save into that directory removes
    it once process pid is gone, and leaves everyone else's files alone."""
    import subprocess
    import sys

    from lightning_pipe import PipeStrategy

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"epoch=1.ckpt.partial-{int(gone.stdout)}"
    stale.write_bytes(b"half a checkpoint")
    mine = tmp_path / f"other.ckpt.partial-{os.getpid()}"  # a save still running (this process)
    mine.write_bytes(b"in progress")
    unrelated = tmp_path / "notes.partial-x"
    unrelated.write_bytes(b"not ours")
    PipeStrategy().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "epoch=2.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["epoch=2.ckpt", mine.name, unrelated.name])


def test_layers_sharing_a_parameter_must_stay_on_one_stage():
    """The same module at two positions (ALBERT's repeated block) or tied weights: split apart, each stage would train
    its own copy (on 2 processes the losses drifted from one device's by 5e-5 within 4 steps), so the cut refuses and
    names a range to keep together; kept on one stage, it is cut."""
    from lightning_pipe.errors import SharedParameterError

    block = nn.Linear(4, 4)
    shared = nn.Sequential(block, nn.Linear(4, 4), block, nn.Linear(4, 4))
    with pytest.raises(SharedParameterError, match=r"model\[0\] and model\[2\] share parameters .* virtual stages 0 and 1"
                                                   r".*keeps model\[0:3\] on one stage"):
        PartitionedTrunk(shared, "model", stage_bounds([2, 2]), local=[0])
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    tied[2].weight = tied[0].weight
    with pytest.raises(SharedParameterError, match=r"model\[0\] and model\[2\]"):
        PartitionedTrunk(tied, "model", stage_bounds([1, 2]), local=[1])
    PartitionedTrunk(shared, "model", stage_bounds([3, 1]), local=[0])


def test_a_weight_tied_across_the_trunks_edge_is_refused():
    """A layer outside the trunk holding a trunk layer's weight: that layer trains on its stage, the outside code on
    the first or last, each its own copy (on 2 processes the losses drifted from one device's), so fit stops before
    any process starts; without the tie it trains."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipeStrategy
    from lightning_pipe.errors import SharedParameterError

    class Tied(L.LightningModule):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.trunk = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
            self.mid, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
            if tie:
                self.mid.weight = self.trunk[0].weight

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.head(self.mid(self.trunk(batch[0]))), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(model: L.LightningModule) -> None:
        data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
        L.Trainer(strategy=PipeStrategy(schedule="1f1b", stages=2, micro_batches=2), accelerator="cpu", devices=1, max_steps=1,
                  logger=False, enable_progress_bar=False, enable_checkpointing=False,
                  enable_model_summary=False).fit(model, DataLoader(data, batch_size=4))

    with pytest.raises(SharedParameterError, match=r"mid\.weight is tied to trunk\.0\.weight, a parameter of the trunk trunk"
                                                   r".*untie them, or move that layer out of trunk"):
        fit(Tied(tie=True))
    fit(Tied(tie=False))
