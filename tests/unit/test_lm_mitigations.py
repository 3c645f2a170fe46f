"""A small transformer language model, 4 stages through the one-device emulation: every staleness
mitigation (2BW's look-ahead, Muon in every weight policy, xpipe's Muon prediction, the NAdam recipe of
arXiv 2505.01099) moves the weights exactly as the literal reference of its rule does, and differently
from training without it."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.engine import split_micro_batches
from lightning_pipe.engine.policies import AsyncOptions, DoubleBufferOptions, PipeDreamOptions, PipeMareOptions, XPipeOptions
from lightning_pipe.optim import BasisRotationAdam, CombinedOptimizer
from tests.harness.lightning_run import Losses, muon_with_adam
from tests.reference.async_reference import AsyncEmulator

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair."
)
VOCAB = sorted(set(TEXT))
CONTEXT, D_MODEL, BLOCKS, STAGES, MICRO, STEPS, BATCH = 16, 32, 4, 4, 4, 5, 8


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(len(VOCAB), D_MODEL), nn.Embedding(CONTEXT, D_MODEL)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 2 * D_MODEL), nn.GELU(), nn.Linear(2 * D_MODEL, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(L.LightningModule):
    """Embeddings before the trunk ``blocks``, final LayerNorm and head after it."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.optimizer_kind = optimizer
        self.embed = Embed()
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.ln_f, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, len(VOCAB))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.blocks(self.embed(idx))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_kind, self.parameters())


def make_optimizer(kind: str, parameters) -> torch.optim.Optimizer:
    if kind == "muon":
        return muon_with_adam(parameters)
    if kind == "basis_rotation":  # arXiv 2602.03515: Adam in the matrices' eigenbasis (refreshed every 2 steps here)
        parameters = list(parameters)
        return CombinedOptimizer(
            BasisRotationAdam([p for p in parameters if p.ndim == 2], lr=3e-3, precondition_frequency=2),
            torch.optim.AdamW([p for p in parameters if p.ndim != 2], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01),
        )
    if kind == "nadamw":  # arXiv 2505.01099's recipe: Nesterov momentum 0.99, decoupled weight decay
        return torch.optim.NAdam(parameters, lr=3e-3, betas=(0.99, 0.999), weight_decay=0.01, decoupled_weight_decay=True)
    if kind == "sgd":
        return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(parameters, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def windows() -> TensorDataset:
    ids = torch.tensor([VOCAB.index(c) for c in TEXT])
    starts = torch.randint(0, len(ids) - CONTEXT - 1, (STEPS * BATCH,), generator=torch.Generator().manual_seed(1))
    return TensorDataset(torch.stack([ids[s:s + CONTEXT] for s in starts]), torch.stack([ids[s + 1:s + CONTEXT + 1] for s in starts]))


def emulated(schedule: str, optimizer: str, micro_batches: int = MICRO, **strategy) -> tuple[list[float], dict]:
    model, losses = TinyLM(optimizer), Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses], use_distributed_sampler=False,
                        strategy=PipeStrategy(schedule=schedule, stages=STAGES, micro_batches=micro_batches, **strategy))
    trainer.fit(model, DataLoader(windows(), batch_size=BATCH))
    return losses.losses, model.state_dict()


def reference(schedule: str, optimizer: str, options: AsyncOptions, micro_batches: int = MICRO) -> tuple[list[float], dict]:
    """The same model cut into 4 stages (embeddings with the first block, the head with the last), each
    with its own optimizer, run by the literal reference."""
    model = TinyLM(optimizer)
    stages = [nn.Sequential(model.embed, model.blocks[0]), model.blocks[1], model.blocks[2],
              nn.Sequential(model.blocks[3], model.ln_f, model.head)]
    emulator = AsyncEmulator(schedule, stages, [make_optimizer(optimizer, s.parameters()) for s in stages], micro_batches, lambda mb: mb[0],
                             lambda out, mb: lm_loss(out, mb[1]), options)
    losses = [sum(emulator.train_window(split_micro_batches(batch, micro_batches))) / micro_batches
              for batch in DataLoader(windows(), batch_size=BATCH)]
    emulator.drain()
    return losses, model.state_dict()


def comparable(key: str, value: torch.Tensor) -> torch.Tensor:
    """The attention's key bias has an exactly-zero gradient (adding one vector to every key shifts all
    of a query's scores equally, which softmax ignores); what autograd returns for it is float rounding,
    which Adam-type optimizers normalise into full-size steps. Its values depend on the order of
    additions, not on the rule under test, so it is left out of the comparison."""
    if key.endswith("attn.in_proj_bias"):
        return torch.cat([value[:D_MODEL], value[2 * D_MODEL:]])
    return value


#: (schedule, optimizer, 2BW look-ahead); the other Muon cases: tests/unit/test_emulation_mode.py
CASES = [("pipedream_2bw", "adamw", 1.0), ("pipedream_2bw", "muon", 1.0), ("xpipe", "muon", 0.0),
         ("pipedream", "nadamw", 0.0), ("pipemare", "nadamw", 0.0), ("pipedream_2bw", "nadamw", 1.0),
         ("xpipe", "nadamw", 0.0), ("pipedream", "basis_rotation", 0.0), ("pipedream_2bw", "basis_rotation", 1.0)]


@pytest.mark.parametrize("schedule,optimizer,lookahead", CASES)
def test_each_mitigation_moves_the_weights_as_its_reference_says(schedule, optimizer, lookahead):
    """Muon's Newton-Schulz iteration runs in bfloat16, so float-rounding differences (the order in
    which micro-batch gradients add up) come out of it about 100x larger: 1e-4 there, 1e-5 otherwise."""
    strategy = {"pipedream_2bw": {"lookahead": lookahead}} if schedule == "pipedream_2bw" else {}
    got_losses, got = emulated(schedule, optimizer, **strategy)
    want_losses, want = reference(schedule, optimizer, AsyncOptions(pipedream_2bw=DoubleBufferOptions(lookahead)))
    tolerance = 1e-4 if optimizer == "muon" else 1e-5
    assert got_losses == pytest.approx(want_losses, rel=tolerance)
    for key, value in want.items():
        torch.testing.assert_close(comparable(key, got[key]), comparable(key, value), rtol=tolerance, atol=tolerance / 10, msg=key)
    # not a no-op: the reference without it (2BW without look-ahead; AdamW instead of Muon or NAdam) ends elsewhere
    paper = AsyncOptions(pipedream_2bw=DoubleBufferOptions(lookahead=0.0))
    _, without = reference(schedule, "adamw" if not lookahead else optimizer, paper)
    assert any(not torch.allclose(got[k], without[k], atol=1e-4) for k in got)


@pytest.mark.parametrize("optimizer,options", [("adamw", {"distances": "exact"}), ("muon", {"distances": "exact"}),
                                               ("sgd", {"momentum_direction": "spectrain"})])
def test_xpipe_options_move_the_weights_as_their_reference_says(optimizer, options):
    """``xpipe.distances="exact"`` (every prediction targets the version its mini-batch's STEP updates)
    and ``xpipe.momentum_direction="spectrain"``: the engine equals the literal reference, and differs
    from xpipe's defaults."""
    got_losses, got = emulated("xpipe", optimizer, xpipe=options)
    want_losses, want = reference("xpipe", optimizer, AsyncOptions(xpipe=XPipeOptions(**options)))
    tolerance = 1e-4 if optimizer == "muon" else 1e-5
    assert got_losses == pytest.approx(want_losses, rel=tolerance)
    for key, value in want.items():
        torch.testing.assert_close(comparable(key, got[key]), comparable(key, value), rtol=tolerance, atol=tolerance / 10, msg=key)
    _, paper = reference("xpipe", optimizer, AsyncOptions())
    assert any(not torch.allclose(got[k], paper[k], atol=1e-4) for k in got)


def test_pipedream_vertical_sync_moves_the_weights_as_its_reference_says():
    """``pipedream.vertical_sync``: every stage runs a micro-batch on the version stage 0 ran it on; the
    engine equals the literal reference (which records that version when stage 0 runs the forward),
    and differs from PipeDream's default (each stage's newest weights)."""
    got_losses, got = emulated("pipedream", "adamw", pipedream={"vertical_sync": True})
    want_losses, want = reference("pipedream", "adamw", AsyncOptions(pipedream=PipeDreamOptions(vertical_sync=True)))
    assert got_losses == pytest.approx(want_losses, rel=1e-5)
    for key, value in want.items():
        torch.testing.assert_close(comparable(key, got[key]), comparable(key, value), rtol=1e-5, atol=1e-6, msg=key)
    _, default = reference("pipedream", "adamw", AsyncOptions())
    assert any(not torch.allclose(got[k], default[k], atol=1e-4) for k in got)


@pytest.mark.parametrize("rule, other", [("per_stage", "fixed"), ("fixed", "per_stage")])
def test_pipemare_decay_rules_move_the_weights_as_their_reference_says(rule, other):
    """``pipemare.correction_decay_rule`` at M = 1, where the 4 stages are 3, 2, 1 and 0 STEPs stale: the
    engine equals the literal reference under either rule, and the two rules differ."""
    options = {"correction_decay_rule": rule}
    got_losses, got = emulated("pipemare", "adamw", micro_batches=1, pipemare=options)
    want_losses, want = reference("pipemare", "adamw", AsyncOptions(pipemare=PipeMareOptions(**options)), micro_batches=1)
    assert got_losses == pytest.approx(want_losses, rel=1e-5)
    for key, value in want.items():
        torch.testing.assert_close(comparable(key, got[key]), comparable(key, value), rtol=1e-5, atol=1e-6, msg=key)
    _, other_rule = reference("pipemare", "adamw", AsyncOptions(pipemare=PipeMareOptions(correction_decay_rule=other)),
                              micro_batches=1)
    assert any(not torch.allclose(got[k], other_rule[k], atol=1e-4) for k in got)


@pytest.mark.parametrize("lookahead", [0.0, 1.0])
def test_2bw_delay_compensation_moves_the_weights_as_its_reference_says(lookahead):
    """DC-ASGD-a on the stale gradient (``pipedream_2bw.delay_compensation``), with and without the
    look-ahead: the engine equals the literal reference, and the correction is not a no-op."""
    options = {"lookahead": lookahead, "delay_compensation": 2000.0}
    got_losses, got = emulated("pipedream_2bw", "adamw", pipedream_2bw=options)
    want_losses, want = reference("pipedream_2bw", "adamw", AsyncOptions(pipedream_2bw=DoubleBufferOptions(**options)))
    assert got_losses == pytest.approx(want_losses, rel=1e-5)
    for key, value in want.items():
        torch.testing.assert_close(comparable(key, got[key]), comparable(key, value), rtol=1e-5, atol=1e-6, msg=key)
    _, without = reference("pipedream_2bw", "adamw", AsyncOptions(pipedream_2bw=DoubleBufferOptions(lookahead=lookahead)))
    assert any(not torch.allclose(got[k], without[k], atol=1e-4) for k in got)


@pytest.mark.parametrize("schedule,micro_batches", [("pipedream", 4), ("pipedream", 1), ("pipedream_2bw", 4),
                                                    ("pipemare", 1), ("xpipe", 4)])
def test_delay_scaled_warmup_moves_the_weights_as_its_reference_says(schedule, micro_batches):
    """``delay_warmup_steps``: each stale stage ramps its learning rate over ``K * tau_s`` STEPs (at M = 1
    the 4 stages are 3, 2, 1 and 0 STEPs stale; pipemare's T1 multiplies on top). The engine equals the
    literal reference, and the warm-up is not a no-op."""
    got_losses, got = emulated(schedule, "adamw", micro_batches=micro_batches, delay_warmup_steps=2)
    want_losses, want = reference(schedule, "adamw", AsyncOptions(delay_warmup_steps=2), micro_batches=micro_batches)
    assert got_losses == pytest.approx(want_losses, rel=1e-5)
    for key, value in want.items():
        torch.testing.assert_close(comparable(key, got[key]), comparable(key, value), rtol=1e-5, atol=1e-6, msg=key)
    _, without = reference(schedule, "adamw", AsyncOptions(), micro_batches=micro_batches)
    assert any(not torch.allclose(got[k], without[k], atol=1e-4) for k in got)
