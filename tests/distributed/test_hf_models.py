"""Hugging Face LlamaForCausalLM and GPT2LMHeadModel (tied embeddings), unchanged inside an ordinary
LightningModule, pipelined on 2 processes and on 4 emulated stages: synchronous schedules equal one
device, pipemare equals the literal reference of its rule, and the checkpoint loads into the plain
Hugging Face model and gives the same logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipe.engine import split_micro_batches
from lightning_pipe.engine.policies import AsyncOptions
from tests.harness.launch import launch
from tests.harness.lightning_run import train
from tests.reference.async_reference import AsyncEmulator

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
from tests.harness.hf_models import hf_model, token_windows  # noqa: E402

STEPS, BATCH, MICRO = 3, 16, 4
TOL = 1e-5


def config(kind: str, **strategy) -> dict:
    return {"hf": kind, "max_steps": STEPS, "batch_size": BATCH, **({"strategy": strategy} if strategy else {})}


def assert_weights_equal(got: dict, want: dict) -> None:
    """AdamW turns float-rounding differences of near-zero gradients into steps of up to its learning rate:
    on some CPUs one element of GPT-2's 4,096-element c_fc weight ends 1.25e-5 apart after 3 steps, so weights
    get 5e-5 where losses get 1e-5 (a wrong gradient moves whole tensors by far more)."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=TOL, atol=5 * TOL, msg=key)


def logits(kind: str, state: dict, ids: torch.Tensor) -> torch.Tensor:
    """The plain Hugging Face model with the LightningModule's weights (its ``model.`` keys)."""
    model = hf_model(kind)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_processes_equal_one_device_and_the_checkpoint_loads_into_the_plain_model(kind, schedule, tmp_path):
    reference = train(config(kind))
    code, output, records = launch({**config(kind, schedule=schedule, micro_batches=MICRO),
                                    "devices": 2, "ckpt_out": str(tmp_path / "last.ckpt")})
    assert code == 0, output[-3000:]
    assert f"model.{'model.layers' if kind == 'llama' else 'transformer.h'}[0:2]" in output  # the stage table names the trunk
    for record in records:  # every rank returned and logged the last stage's losses
        assert record["returned"] == pytest.approx(reference["returned"], rel=TOL)
    for record in records:  # gradients of the first step, where each rank has them (GPT-2's tied embedding: both)
        assert record["grads"]
        for name, grad in record["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], rtol=TOL, atol=1e-7, msg=name)
    assert set().union(*(r["grads"] for r in records)) == set(reference["grads"])
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert_weights_equal(state, reference["state"])
    ids = token_windows(4, seed=3).tensors[0]
    torch.testing.assert_close(logits(kind, state, ids), logits(kind, reference["state"], ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,schedule", [("llama", "gpipe"), ("gpt2", "1f1b"), ("llama", "interleaved_1f1b")])
def test_four_emulated_stages_equal_one_device(kind, schedule):
    chunks = {"chunks_per_stage": 2} if schedule == "interleaved_1f1b" else {}
    stages = 2 if chunks else 4
    reference = train(config(kind))
    got = train(config(kind, schedule=schedule, stages=stages, micro_batches=MICRO, **chunks))
    assert got["returned"] == pytest.approx(reference["returned"], rel=TOL)
    assert_weights_equal(got["state"], reference["state"])


# ------------------------------------------------------------------ pipemare against its reference
class LlamaStage(nn.Module):
    """Blocks ``start:end`` of a LlamaForCausalLM as one reference stage: the embedding before the
    first, the final norm and LM head after the last, and the blocks' arguments computed as
    LlamaModel.forward computes them."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        inner = model.model
        self.config, self.rotary = inner.config, inner.rotary_emb
        self.embed = inner.embed_tokens if start == 0 else None
        self.layers = nn.ModuleList(inner.layers[start:end])
        last = end == len(inner.layers)
        self.norm, self.lm_head = (inner.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed(x) if self.embed is not None else x
        position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        rope = self.rotary(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=position_ids)
        return self.lm_head(self.norm(hidden)) if self.lm_head is not None else hidden


def causal_lm_loss(logits: torch.Tensor, micro_batch) -> torch.Tensor:
    ids = micro_batch[0]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def pipemare_reference(stages: int) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    from tests.harness.hf_models import HFCausalLM

    module = HFCausalLM("llama")
    per_stage = 4 // stages
    parts = [LlamaStage(module.model, s * per_stage, (s + 1) * per_stage) for s in range(stages)]
    optimizers = [torch.optim.AdamW(p.parameters(), lr=module.lr, weight_decay=0.01) for p in parts]
    emulator = AsyncEmulator("pipemare", parts, optimizers, MICRO, lambda mb: mb[0], causal_lm_loss, AsyncOptions())
    loader = DataLoader(token_windows(STEPS * BATCH), batch_size=BATCH)
    losses = [sum(emulator.train_window(split_micro_batches(batch, MICRO))) / MICRO for batch in loader]
    emulator.drain()
    return losses, module.state_dict()


@pytest.mark.parametrize("devices,stages", [(1, 4), (2, 2)])
def test_pipemare_on_a_llama_equals_its_reference(devices, stages, tmp_path):
    want_losses, want = pipemare_reference(stages)
    run = {**config("llama", schedule="pipemare", micro_batches=MICRO, **({"stages": stages} if devices == 1 else {})),
           "samples": STEPS * BATCH}
    if devices == 1:
        got = train(run)
        losses, state = got["returned"], got["state"]
    else:
        code, output, records = launch({**run, "devices": devices, "ckpt_out": str(tmp_path / "last.ckpt")})
        assert code == 0, output[-3000:]
        losses = records[0]["returned"]
        state = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert losses == pytest.approx(want_losses, rel=TOL)
    assert_weights_equal(state, want)
