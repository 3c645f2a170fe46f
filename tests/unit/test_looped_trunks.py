"""A ModuleList trunk run in the user's own loop (nanoGPT / Hugging Face style), with extra
arguments to every block, pipelines exactly: emulated stages equal one device (synchronous
schedules) and equal the same blocks as an nn.Sequential trunk (every schedule), and what cannot
work ends in an error that says what to change."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.errors import StageOutputError, TrunkUsageError
from tests.harness.lightning_run import Losses

VOCAB, CONTEXT, D_MODEL, BLOCKS, STEPS, BATCH = 24, 12, 16, 4, 4, 8


def rotary(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(length)[:, None] * 0.1 * torch.arange(1, D_MODEL // 2 + 1)[None]
    return angles.cos(), angles.sin()


def causal_mask(length: int) -> torch.Tensor:
    return torch.triu(torch.ones(length, length, dtype=torch.bool), 1)


class Block(nn.Module):
    """Attention with a mask and a ``(cos, sin)`` table, an MLP, a non-tensor ``scale``; without
    arguments it computes the same mask and table itself (so the same blocks also fit an nn.Sequential).
    ``tuple_output`` returns ``(hidden,)`` as Hugging Face blocks of some versions do."""

    def __init__(self, tuple_output: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 2 * D_MODEL), nn.GELU(), nn.Linear(2 * D_MODEL, D_MODEL))
        self.tuple_output = tuple_output
        self.kind = "attention"  # a plain attribute a loop may read (Hugging Face's ``attention_type``)

    def forward(self, x, mask=None, rope=None, *, scale: float = 1.0, aux=None):
        mask = causal_mask(x.shape[1]) if mask is None else mask
        cos, sin = rotary(x.shape[1]) if rope is None else rope
        half = D_MODEL // 2
        h = self.ln1(x)
        h = torch.cat([h[..., :half] * cos - h[..., half:] * sin, h[..., :half] * sin + h[..., half:] * cos], -1)
        x = x + scale * self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        if aux is not None:  # a running auxiliary loss carried through the blocks (a mixture of experts' balance)
            return x, aux + x.pow(2).mean()
        return (x,) if self.tuple_output else x


class WeightlessBlock(Block):
    """Returns ``(hidden, None)``: a Hugging Face block's ``(hidden, attention weights)`` when the weights are not asked for."""

    def forward(self, x, mask=None, rope=None, *, scale: float = 1.0, aux=None):
        return super().forward(x, mask, rope, scale=scale), None


class LoopLM(L.LightningModule):
    """Embedding, a trunk of blocks, head. ``trunk="list"`` loops over an nn.ModuleList passing the
    mask, the rotary table and a constant to every block (``loop`` picks the loop's shape);
    ``trunk="sequential"`` calls the same blocks as an nn.Sequential."""

    def __init__(self, trunk: str = "list", loop: str = "plain", optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.loop, self.optimizer_kind = loop, optimizer
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        blocks = [(WeightlessBlock if loop == "with_none" else Block)(tuple_output=loop == "tuple") for _ in range(BLOCKS)]
        self.blocks = nn.ModuleList(blocks) if trunk == "list" else nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Dropout(0.0), nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB))

    def forward(self, idx):
        x = self.embed(idx)
        self.aux_loss = torch.zeros(())  # read by training_step
        if isinstance(self.blocks, nn.Sequential):
            return self.head(self.blocks(x))
        mask, rope = causal_mask(idx.shape[1]), rotary(idx.shape[1])
        if self.loop == "slice":  # Hugging Face Llama: for layer in self.layers[: config.num_hidden_layers]
            blocks = self.blocks[:BLOCKS]
        else:
            blocks = self.blocks
        x0, outputs, aux = x, [], torch.zeros(())
        if self.loop in ("by_index", "reversed"):  # a loop over the positions: self.blocks[i](x)
            order = range(BLOCKS) if self.loop == "by_index" else reversed(range(BLOCKS))
            for i in order:
                x = self.blocks[i](x, mask, rope=rope)
            blocks = []
        for i, block in enumerate(blocks):
            if self.loop == "tuple":
                x = block(x, mask, rope=rope, scale=1.0)[0]
            elif self.loop == "with_none":
                x, _ = block(x, mask, rope=rope)
            elif self.loop == "norm":  # code between the blocks that reads only the block's output
                x = F.layer_norm(block(x, mask, rope=rope), (D_MODEL,))
            elif self.loop == "skip":  # ... and a value from before the loop, which every stage computes
                x = block(x, mask, rope=rope) + 0.5 * x0
            elif self.loop == "residual":  # the loop's state carried past each block: only a block's output travels
                x = x + block(x, mask, rope=rope)
            elif self.loop in ("every_output", "last_two"):  # the blocks' outputs kept for after the loop
                x = block(x, mask, rope=rope)
                outputs.append(x)
            elif self.loop == "aux_sum":  # an auxiliary loss summed over the blocks' outputs, in the loop
                x = block(x, mask, rope=rope)
                aux = aux + x.pow(2).mean()
            elif self.loop == "aux_carry":  # the same sum carried through the blocks: it crosses the stages with x
                x, aux = block(x, mask, rope=rope, aux=aux)
            elif self.loop == "per_block":  # arguments that differ per block are computed on every stage
                x = block(x, mask, rope=rope, scale=(i + 1) / BLOCKS)
            else:
                assert block.kind == "attention"
                x = block(x, mask, rope=rope, scale=1.0)
        if self.loop == "every_output":  # reads blocks that ran on earlier stages
            x = torch.stack(outputs).mean(0)
        if self.loop == "last_two":  # with 2 stages of 2 blocks, both ran on the last stage
            x = outputs[-1] + outputs[-2]
        if self.loop == "twice":
            for block in self.blocks:
                x = block(x)
        if self.loop == "index":
            x = self.blocks[0](x)
        self.aux_loss = aux
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten()) + 0.1 * self.aux_loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer_kind == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=3e-3)
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


def windows() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS * BATCH, CONTEXT + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def fit(model: L.LightningModule, strategy: PipeStrategy | None) -> tuple[list[float], dict]:
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
                        use_distributed_sampler=False, **({"strategy": strategy} if strategy else {}))
    trainer.fit(model, DataLoader(windows(), batch_size=BATCH))
    return losses.losses, model.state_dict()


def assert_same(got: tuple[list[float], dict], want: tuple[list[float], dict], tol: float = 1e-5) -> None:
    assert got[0] == pytest.approx(want[0], rel=tol)
    assert got[1].keys() == want[1].keys()
    for key, value in want[1].items():
        torch.testing.assert_close(got[1][key], value, rtol=tol, atol=tol / 10, msg=key)


@pytest.mark.parametrize("schedule,stages,extra,loop", [
    ("gpipe", 4, {}, "plain"), ("1f1b", 2, {}, "plain"), ("1f1b", 4, {"checkpoint_activations": True}, "plain"),
    ("interleaved_1f1b", 2, {"chunks_per_stage": 2}, "plain"), ("1f1b", 4, {}, "slice"), ("1f1b", 4, {}, "tuple"),
    ("gpipe", 2, {}, "per_block"), ("1f1b", 4, {}, "norm"), ("interleaved_1f1b", 2, {"chunks_per_stage": 2}, "skip"),
    ("1f1b", 2, {"balance": [1, 3]}, "residual"),  # block 1's input is block 0's output plus the embedding: exact
    ("1f1b", 2, {}, "last_two"), ("1f1b", 2, {}, "aux_carry"), ("1f1b", 2, {}, "with_none"),
    ("1f1b", 4, {}, "by_index"), ("interleaved_1f1b", 2, {"chunks_per_stage": 2}, "by_index"),
])
def test_a_looped_module_list_trunk_equals_one_device(schedule, stages, extra, loop):
    one_device = fit(LoopLM(loop=loop), None)
    pipelined = fit(LoopLM(loop=loop), PipeStrategy(schedule=schedule, stages=stages, micro_batches=4, **extra))
    assert_same(pipelined, one_device)


class StackedLSTM(L.LightningModule):
    """A language model whose trunk is an nn.ModuleList of nn.LSTM layers: each returns ``(output, (h, c))``,
    a nested tuple, which crosses the stage boundary as it is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList(nn.LSTM(D_MODEL, D_MODEL, batch_first=True) for _ in range(BLOCKS))
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for lstm in self.layers:
            x, (_, _) = lstm(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


@pytest.mark.parametrize("schedule,extra", [("1f1b", {}), ("interleaved_1f1b", {"chunks_per_stage": 2}), ("zb_h1", {})])
def test_stacked_lstm_layers_returning_nested_tuples_train_like_one_device(schedule, extra):
    assert_same(fit(StackedLSTM(), PipeStrategy(schedule=schedule, stages=2, micro_batches=4, **extra)),
                fit(StackedLSTM(), None))


class PackedGRU(nn.Module):
    """A GRU layer that takes and returns a ``PackedSequence``."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(D_MODEL, D_MODEL, batch_first=True)

    def forward(self, packed: nn.utils.rnn.PackedSequence) -> nn.utils.rnn.PackedSequence:
        return self.gru(packed)[0]


class PackedRNN(StackedLSTM):
    """Sequences of several lengths (from the tokens: each sample's own) packed before an nn.Sequential of GRU
    layers and padded after it: a ``PackedSequence`` crosses every stage boundary."""

    block: type[nn.Module] = PackedGRU

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.Sequential(*(self.block() for _ in range(BLOCKS)))
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx):
        lengths = 3 + idx[:, 0] % (CONTEXT - 3)
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(idx), lengths, batch_first=True, enforce_sorted=False)
        hidden, _ = nn.utils.rnn.pad_packed_sequence(self.layers(packed), batch_first=True, total_length=CONTEXT)
        return self.head(hidden)


@pytest.mark.parametrize("schedule,extra", [("1f1b", {}), ("zb_h1", {}), ("interleaved_1f1b", {"chunks_per_stage": 2})])
def test_packed_sequences_cross_stage_boundaries_and_train_like_one_device(schedule, extra):
    """A PackedSequence was refused (``returned PackedSequence; a pipeline stage must return a tensor ...``), and no
    balance could help when every layer takes one; it now crosses as its four tensors and is rebuilt (its
    ``batch_sizes`` on the host, where an RNN reads them). Lengths are per sample, so micro-batches do not change
    the result. The 2-process path was checked by hand: equal to one device with accumulation."""
    shapes = "always"  # the packed data's length depends on the lengths, not only on the input's shape
    assert_same(fit(PackedRNN(), PipeStrategy(schedule=schedule, stages=2, micro_batches=4, shape_headers=shapes, **extra)),
                fit(PackedRNN(), None))


def test_a_packed_sequence_without_headers_on_every_message_is_told_why():
    """With headers only on a change of the inputs' shapes, the second micro-batch's packed data (another total
    length) stops the sender with an error that names the PackedSequence and the option."""
    from lightning_pipe.errors import StageOutputError

    with pytest.raises(StageOutputError, match=r"returns a PackedSequence.*shape_headers=\"always\""):
        fit(PackedRNN(), PipeStrategy(schedule="1f1b", stages=2, micro_batches=4))


class PaddedGRU(PackedGRU):
    """The same GRU layer between padded tensors: it packs its input by the lengths that travel beside it."""

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, lengths = value
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        return nn.utils.rnn.pad_packed_sequence(self.gru(packed)[0], batch_first=True, total_length=CONTEXT)[0], lengths


class PaddedRNN(PackedRNN):
    """PackedRNN's model with padded tensors and the lengths crossing the stage boundaries instead."""

    block = PaddedGRU

    def forward(self, idx):
        hidden, _ = self.layers((self.embed(idx), 3 + idx[:, 0] % (CONTEXT - 3)))
        return self.head(hidden)


@pytest.mark.parametrize("schedule", ["pipemare", "pipedream_2bw"])
def test_packed_sequences_cross_the_boundaries_of_asynchronous_schedules(schedule):
    """The emulation's first-step probe of the asynchronous schedules passed a PackedSequence on as a plain tuple
    (``'tuple' object has no attribute 'dim'``); it now hands each virtual stage what a process would receive, and the
    packed trunk trains as the same layers passing padded tensors and their lengths."""
    strategy = {"schedule": schedule, "stages": 2, "micro_batches": 4, "shape_headers": "always"}
    assert_same(fit(PackedRNN(), PipeStrategy(**strategy)), fit(PaddedRNN(), PipeStrategy(**strategy)))


@pytest.mark.parametrize("schedule", ["1f1b", "pipemare", "pipedream_2bw", "xpipe"])
def test_a_module_list_trunk_trains_exactly_like_the_same_blocks_in_a_sequential(schedule):
    """The Sequential trunk is checked against one device and the literal references elsewhere
    (tests/unit/test_emulation_mode.py); the ModuleList trunk must give identical weights."""
    strategy = {"schedule": schedule, "stages": 4, "micro_batches": 4}
    as_list = fit(LoopLM("list", optimizer="adamw"), PipeStrategy(**strategy))
    as_sequential = fit(LoopLM("sequential", optimizer="adamw"), PipeStrategy(**strategy))
    assert_same(as_list, as_sequential)


@pytest.mark.parametrize("loop,match", [
    ("twice", r"blocks was iterated twice in one step.*Loop over it once"),
    ("index", r"blocks\[0\] inside a pipelined step \(the step already looped over blocks\).*once each, in order"),
    ("reversed", r"blocks\[3\] inside a pipelined step \(blocks\[0\] is the block to call next\)"),
    ("residual", r"reads the output of blocks\[0\] again after the loop went past it.*x = x \+ block\(x\).*"
                 r"Move that code into the blocks"),
    ("every_output", r"reads the output of blocks\[0\] again"),
    ("aux_sum", r"reads the output of blocks\[0\] again.*auxiliary loss summed.*x, aux = block\(x, aux\)"),
])
def test_a_loop_that_cannot_be_split_says_what_to_change(loop, match):
    with pytest.raises(TrunkUsageError, match=match):
        fit(LoopLM(loop=loop), PipeStrategy(schedule="1f1b", stages=2, micro_batches=2))


def test_a_stage_holding_a_stub_still_answers_the_blocks_plain_attributes():
    """On a process that holds only a stub of a block, a loop reading ``block.kind`` (Hugging Face's
    ``attention_type``) gets the block's own value, and skipped blocks return the received activation."""
    from lightning_pipe.partition.split import PartitionedTrunk, StagePass, StageStop

    blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
    for i, block in enumerate(blocks):
        block.kind = f"kind{i}"
    partition = PartitionedTrunk(blocks, "blocks", [(0, 2), (2, 4)], local=[1])
    assert isinstance(blocks[0], nn.Identity) and isinstance(blocks[3], Block)
    received = torch.randn(2, CONTEXT, D_MODEL)
    seen, x = [], None
    with partition.acting(StagePass(0, first=False, received=received, stop=False)):
        for block in blocks:
            seen.append(block.kind)
            x = block(received if x is None else x, causal_mask(CONTEXT))
            if len(seen) <= 2:
                assert x is received
    assert seen == ["kind0", "kind1", "kind2", "kind3"] and x.shape == received.shape
    with partition.acting(StagePass(0, first=False, received=received, stop=True)), pytest.raises(StageStop):
        for block in blocks:
            block(received)
    outside = list(blocks)  # outside a step: introspection works, running a block held elsewhere does not
    assert outside[3] is blocks[3] and outside[0].kind == "kind0" and "(0): Identity()" in repr(blocks)
    with pytest.raises(TrunkUsageError, match="runs only inside a pipelined step"):
        outside[0](received)
    # inside a step a block read by index (nn.TransformerEncoder reads self.layers[0].self_attn.batch_first) answers
    # its submodules' plain attributes and the module's mode; called, it runs as the loop would, once and in order
    with partition.acting(StagePass(0, first=False, received=received, stop=False)):
        first = blocks[0]
        assert first.attn.batch_first is True and first.training is True and blocks[-1].kind == "kind3"
        blocks.eval()
        assert first.training is False
        assert first(received) is received  # a block of the earlier stage: the received activation
        with pytest.raises(TrunkUsageError, match=r"blocks\[0\] inside a pipelined step \(blocks\[1\] is the block to call next\)"):
            first(received)


def test_a_partial_slice_is_refused():
    model = LoopLM()
    strategy = PipeStrategy(schedule="gpipe", stages=2, micro_batches=2)

    def forward(idx):
        x = model.embed(idx)
        for block in model.blocks[:2]:
            x = block(x)
        return model.head(x)

    model.forward = forward
    with pytest.raises(TrunkUsageError, match=r"blocks\[slice\(None, 2, None\)\] inside a pipelined step"):
        fit(model, strategy)


class Windows(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(windows(), batch_size=BATCH)


def test_plan_profiles_every_block_on_its_own_recorded_call():
    """The profiler times each block with the mask, rotary table and constant the loop passes it."""
    from lightning_pipe.cli.plan import plan

    calls = []
    model = LoopLM()
    original = Block.forward
    Block.forward = lambda self, x, *a, **k: (calls.append((len(a), sorted(k))), original(self, x, *a, **k))[1]
    try:
        report = plan(model, stages=2, datamodule=Windows(), schedules=["1f1b"], micro_batches=[2, 4], timeline=None,
                      repeats=1)
    finally:
        Block.forward = original
    assert [p.micro_batch for p in report.profiles] == [2, 4]
    assert [layer.name for layer in report.profiles[0].layers] == ["Block"] * BLOCKS
    assert all(layer.forward > 0 and layer.backward > 0 for layer in report.profiles[0].layers)
    assert report.profiles[0].input_bytes == 2 * CONTEXT * D_MODEL * 4  # the hidden state, not the arguments
    assert calls and all(call == (1, ["rope", "scale"]) for call in calls)  # every profiled call had the loop's arguments
    # equal blocks: an even split is expected, but the split comes from timings (one repeat), which a busy
    # machine skews; the plan only has to be a valid cut of the blocks
    assert len(report.best.balance) == 2 and sum(report.best.balance) == BLOCKS and min(report.best.balance) >= 1


def test_balance_auto_splits_a_looped_trunk_and_trains_like_one_device():
    one_device = fit(LoopLM(), None)
    pipelined = fit(LoopLM(), PipeStrategy(schedule="1f1b", stages=2, micro_batches=4, balance="auto"))
    assert_same(pipelined, one_device)


class TorchEncoder(L.LightningModule):
    """PyTorch's own nn.TransformerEncoder, whose forward reads ``self.layers[0]`` before it loops over the layers."""

    def __init__(self, nested: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, 2, 2 * D_MODEL, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=BLOCKS, norm=nn.LayerNorm(D_MODEL),
                                             enable_nested_tensor=nested)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.encoder(self.embed(x), mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]), is_causal=True)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        padding = torch.zeros_like(x, dtype=torch.bool)
        padding[:, -2:] = True  # a padding mask alone: the encoder's fast path in evaluation
        h = self.encoder(self.embed(x), src_key_padding_mask=padding)
        self.log("val_loss", F.cross_entropy(self.head(h).flatten(0, 1), y.flatten()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)  # Adam would magnify rounding in ~0 gradients


def test_torch_s_transformer_encoder_splits_and_trains_like_one_device():
    def run(strategy: PipeStrategy | None) -> tuple[list[float], dict, float]:
        losses, module = Losses(), TorchEncoder()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
                            use_distributed_sampler=False, **({"strategy": strategy} if strategy else {}))
        trainer.fit(module, DataLoader(windows(), batch_size=BATCH), DataLoader(windows(), batch_size=BATCH))
        return losses.losses, module.state_dict(), float(trainer.callback_metrics["val_loss"])

    *want, want_val = run(None)
    *got, got_val = run(PipeStrategy(schedule="1f1b", stages=2, micro_batches=2))
    assert_same(tuple(got), tuple(want))
    assert got_val == pytest.approx(want_val, rel=1e-5)


def test_a_nested_tensor_at_a_stage_boundary_says_how_to_avoid_it():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        strategy=PipeStrategy(schedule="1f1b", stages=2, micro_batches=2))
    with pytest.raises(StageOutputError, match=r"nested tensor.*enable_nested_tensor=False"):
        trainer.validate(TorchEncoder(nested=True), DataLoader(windows(), batch_size=BATCH))
