"""Building on the meta device and materialising only this rank's stage (docs/large-models.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe import load_stage_weights
from lightning_pipe.errors import CheckpointMismatchError, PipeConfigError
from lightning_pipe.partition.materialize import MetaConstruction, has_meta_tensors, materialize
from lightning_pipe.partition.split import PartitionedTrunk
from tests.harness.lightning_run import train
from tests.reference.async_cases import emulated, reference


def build() -> nn.Module:
    torch.manual_seed(0)
    root = nn.Module()
    root.embed = nn.Embedding(10, 16)
    root.model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])
    root.attention = nn.MultiheadAttention(16, 2)  # its own initialiser reaches into its child out_proj
    root.norm = nn.BatchNorm1d(16)  # buffers too
    root.head = nn.Linear(16, 10)
    root.head.weight = root.embed.weight  # tied after construction: the head's own init still drew numbers
    root.last = nn.Linear(16, 3)
    return root


def test_materialize_keeps_only_what_remains_and_equals_one_device():
    want = build()
    after_want = torch.rand(4)
    torch.manual_seed(123)  # the construction re-seeds: replay starts from that seed
    with MetaConstruction() as construction:
        got = build()
    assert has_meta_tensors(got) and got.model[0].weight.is_meta
    dropped = [got.model[i] for i in (0, 2)]
    got.model._modules["0"] = got.model._modules["2"] = nn.Identity()  # what another stage holds
    materialize(got, construction)
    assert not has_meta_tensors(got)
    assert all(p.is_meta for layer in dropped for p in layer.parameters())  # never kept on this rank
    assert got.head.weight is got.embed.weight
    state = got.state_dict()
    assert set(want.state_dict()) - set(state) == {"model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"}
    for key, value in state.items():
        assert torch.equal(value, want.state_dict()[key]), key
    assert torch.equal(torch.rand(4), after_want)  # the generator is where one device's construction left it


def test_a_module_without_an_initialiser_is_named_with_the_hook_to_supply():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    root = nn.Module()
    with MetaConstruction() as construction:
        root.scale = Scale()
    with pytest.raises(PipeConfigError, match=r"scale \(Scale\).*reset_module_parameters\(self, module\)"):
        materialize(root, construction)
    materialize(root, construction, lambda module: nn.init.ones_(module.gain))
    assert torch.equal(root.scale.gain, torch.ones(4))


def test_the_modules_own_tensors_are_named_with_how_the_hook_reaches_them():
    """A buffer the LightningModule registers itself (under trainer.init_module()) reaches the hook as module=self."""
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.full((3,), 2.0))

    with MetaConstruction() as construction:
        root = Root()
    with pytest.raises(PipeConfigError, match=r"trainer.init_module\(\).*the LightningModule itself \(Root\).*as module=self"):
        materialize(root, construction)
    materialize(root, construction, lambda module: module.scale.fill_(2.0) if module is root else None)
    assert torch.equal(root.scale, torch.full((3,), 2.0))


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_configure_model_on_four_emulated_stages_equals_one_device(schedule):
    common = {"max_steps": 4, "batch_size": 16, "model": {"optimizer": "adam", "configure": True}}
    want = train(common)
    got = train({**common, "strategy": {"schedule": schedule, "stages": 4, "micro_batches": 4}})
    assert got["returned"] == pytest.approx(want["returned"], rel=1e-5)
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_configure_model_with_pipemare_equals_its_reference():
    """The asynchronous rule's reference builds the module in __init__: the same weights."""
    got = emulated("pipemare", 4, 2, model={"configure": True})
    want_losses, want_state = reference("pipemare", 4, 2, None, None)
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx(want_losses, rel=1e-5)
    for key, value in want_state.items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_balance_auto_is_refused_for_a_model_built_on_the_meta_device():
    with pytest.raises(PipeConfigError, match="balance='auto' times the layers"):
        train({"max_steps": 1, "model": {"configure": True}, "strategy": {"schedule": "1f1b", "stages": 2, "balance": "auto"}})


# ------------------------------------------------------------------ pretrained weights per stage
def cut_module() -> nn.Module:
    """A module whose trunk keeps layers 0 and 1 of 4, as stage 0 of 2 holds them."""
    torch.manual_seed(1)
    root = nn.Module()
    root.embed = nn.Embedding(10, 8)
    root.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
    PartitionedTrunk(root.layers, "layers", [(0, 2), (2, 4)], [0])
    return root


@pytest.mark.parametrize("kind", ["safetensors", "checkpoint"])
def test_load_stage_weights_reads_only_this_stages_tensors(kind, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(2)
    whole = nn.Module()
    whole.embed = nn.Embedding(10, 8)
    whole.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
    state = whole.state_dict()
    if kind == "safetensors":
        source = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, source)
    else:  # a Lightning checkpoint of a LightningModule holding it as self.net
        source = tmp_path / "last.ckpt"
        torch.save({"state_dict": {f"net.{k}": v for k, v in state.items()}, "epoch": 3}, source)
    module = cut_module()
    if kind == "checkpoint":  # the checkpoint's keys are the holder's
        holder = nn.Module()
        holder.net = module
        loaded = [k.removeprefix("net.") for k in load_stage_weights(holder, source)]
    else:
        loaded = load_stage_weights(module, tmp_path)
    assert sorted(loaded) == sorted(module.state_dict())  # not layers 2 and 3
    for key, value in module.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_load_stage_weights_names_the_missing_tensors(tmp_path):
    from safetensors.torch import save_file

    save_file({"embed.weight": torch.zeros(10, 8)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"lacks 4 tensors this stage holds: layers.0.weight, layers.0.bias"):
        load_stage_weights(cut_module(), tmp_path)


def test_configure_model_resumes_from_a_checkpoint_into_its_stages(tmp_path):
    """The checkpoint is restored after setup, when each stage has memory (it cannot be before)."""
    ckpt = str(tmp_path / "one.ckpt")
    pipe = {"schedule": "1f1b", "stages": 2, "micro_batches": 4}
    train({"epochs": 1, "model": {"configure": True}, "strategy": pipe, "ckpt_out": ckpt})
    want = train({"epochs": 2, "model": {"configure": True}})
    got = train({"epochs": 2, "model": {"configure": True}, "strategy": pipe, "ckpt_path": ckpt})
    assert got["global_step"] == want["global_step"]
    assert len(got["returned"]) == len(want["returned"]) // 2  # it ran the second epoch only: it did restore
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_sharded_save_that_fails_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "last.ckpt"
    pipe = {"schedule": "1f1b", "stages": 2, "micro_batches": 4, "save_distributed_checkpoint": True}
    train({"max_steps": 1, "strategy": pipe, "ckpt_out": str(path)})
    before = {f.name: f.read_bytes() for f in path.iterdir()}

    def killed(state_dict, checkpoint_id, **kwargs):
        checkpoint_id.mkdir()
        (checkpoint_id / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", killed)
    with pytest.raises(OSError, match="disk full"):
        train({"max_steps": 2, "strategy": pipe, "ckpt_out": str(path)})
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before


def test_a_sharded_checkpoint_of_another_model_names_the_missing_tensors(tmp_path):
    path = tmp_path / "six.ckpt"
    pipe = {"schedule": "1f1b", "stages": 2, "micro_batches": 4, "save_distributed_checkpoint": True}
    train({"max_steps": 1, "strategy": pipe, "ckpt_out": str(path)})
    with pytest.raises(CheckpointMismatchError, match=r"lacks 2 tensors this stage holds: model.12.weight, model.12.bias"):
        train({"max_steps": 2, "model": {"depth": 7}, "strategy": pipe, "ckpt_path": str(path)})


def test_a_damaged_shard_is_named_as_such(tmp_path):
    path = tmp_path / "last.ckpt"
    pipe = {"schedule": "1f1b", "stages": 2, "micro_batches": 4, "save_distributed_checkpoint": True}
    train({"max_steps": 1, "strategy": pipe, "ckpt_out": str(path)})
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointMismatchError, match=r"could not be read \(EOFError\): one of its files \(__0_0.distcp\) is damaged"):
        train({"max_steps": 2, "strategy": pipe, "ckpt_path": str(path)})
