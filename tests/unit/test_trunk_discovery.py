"""Trunk discovery: nn.Sequential and nn.ModuleList at any depth, the one holding most parameters;
a doubtful or ambiguous choice is an error listing the candidates, never a silent wrong split."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_pipe.errors import TrunkError
from lightning_pipe.partition import find_trunk


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))


class ListBlocksSequentialHead(nn.Module):
    """The case that used to pipeline the head: blocks in a ModuleList, a small Sequential head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.blocks = nn.ModuleList(block() for _ in range(6))
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 10))


class NestedEncoder(nn.Module):
    """Blocks one level down (``encoder.layers``) next to a top-level Sequential head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.Sequential(*(block() for _ in range(6)))
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 10))


class NanoGPTLike(nn.Module):
    """nanoGPT's layout: blocks in ``transformer.h`` inside an ``nn.ModuleDict``, LM head tied to ``wte``."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(50, 32), wpe=nn.Embedding(16, 32), h=nn.ModuleList(block() for _ in range(4)),
            ln_f=nn.LayerNorm(32)))
        self.lm_head = nn.Linear(32, 50, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(block() for _ in range(4))
        self.decoder = nn.ModuleList(block() for _ in range(4))


class BigEmbedding(nn.Module):
    """The only container holds a small share: the real blocks are probably not in it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5000, 32)
        self.blocks = nn.ModuleList(block() for _ in range(2))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("make,path", [
    (ListBlocksSequentialHead, "blocks"), (NestedEncoder, "encoder.layers"), (Plain, "model"),
    (NanoGPTLike, "transformer.h"),
])
def test_the_container_holding_the_blocks_is_chosen(make, path):
    model = make()
    name, trunk = find_trunk(model)
    assert name == path and trunk is model.get_submodule(path)


def test_close_candidates_are_listed_with_the_option_to_pass():
    with pytest.raises(TrunkError, match=r"several containers that could be the pipeline's trunk \(decoder \(ModuleList of 4, "
                                         r"8,448 parameters\); encoder \(ModuleList of 4, 8,448 parameters\)\); name the one "
                                         r"to split with PipeStrategy\(module='decoder'\) or module='encoder'\.$"):
        find_trunk(EncoderDecoder())


def test_a_container_with_a_small_share_is_not_trusted():
    with pytest.raises(TrunkError, match=r"largest container blocks \(ModuleList of 2, 4,224 parameters\) holds only 3% "
                                         r"of its 164,224 parameters.*PipeStrategy\(module='...'\)"):
        find_trunk(BigEmbedding())


def test_module_names_any_container_at_any_depth():
    model = EncoderDecoder()
    assert find_trunk(model, "decoder") == ("decoder", model.decoder)
    assert find_trunk(NestedEncoder(), "encoder.layers")[0] == "encoder.layers"
    with pytest.raises(TrunkError, match=r"encoder.layers is a Sequential|has no attribute 'encoder.blocks'.*candidates: "
                                         r"encoder.layers \(Sequential of 6"):
        find_trunk(NestedEncoder(), "encoder.blocks")
    with pytest.raises(TrunkError, match=r"ListBlocksSequentialHead.embed is a Embedding, not an nn.Sequential or nn.ModuleList"):
        find_trunk(ListBlocksSequentialHead(), "embed")


def test_a_frozen_teacher_beside_the_student_is_no_candidate():
    module = ListBlocksSequentialHead()
    module.teacher = nn.Sequential(*(block() for _ in range(12))).requires_grad_(False)  # larger, but frozen
    assert find_trunk(module)[0] == "blocks"


def test_a_wholly_frozen_module_still_finds_its_blocks():
    """BackboneFinetuning freezes the backbone before the strategy looks for the trunk, and unfreezes it later."""
    module = ListBlocksSequentialHead().requires_grad_(False)
    assert find_trunk(module)[0] == "blocks"


def test_blocks_kept_in_a_module_dict_are_refused_with_the_list_to_make():
    """A dict's blocks cannot be cut by position; the error used to offer a Sequential inside one block instead."""
    class DictBlocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleDict({f"block{i}": block() for i in range(4)})

    with pytest.raises(TrunkError, match=r"DictBlocks.blocks is an nn.ModuleDict of 4 blocks.*Make it nn.ModuleList\(\[...\]\)"):
        find_trunk(DictBlocks())

    class MainAndAuxiliary(nn.Module):  # a dict around one dominant network still finds the network
        def __init__(self) -> None:
            super().__init__()
            self.nets = nn.ModuleDict({"main": nn.Sequential(*(block() for _ in range(4))), "aux": nn.Linear(32, 2),
                                       "probe": nn.Linear(32, 2)})

    assert find_trunk(MainAndAuxiliary())[0] == "nets.main"
