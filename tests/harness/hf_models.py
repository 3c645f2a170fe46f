"""Tiny Hugging Face causal LMs (random weights from a config: nothing downloads) wrapped, unchanged,
in an ordinary LightningModule that calls ``self.model(input_ids=..., labels=...)``."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import TensorDataset

VOCAB, LENGTH = 64, 16


def hf_config(kind: str):
    """A 4-block model of ``kind`` (``"llama"`` or ``"gpt2"``, whose LM head is tied to its input
    embedding), dropout off so that a pipeline and one device draw no random numbers."""
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=LENGTH, use_cache=False, tie_word_embeddings=False)
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=LENGTH, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False, tie_word_embeddings=True)
    raise ValueError(f"unknown model kind {kind!r}")


def hf_model(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    model_class = transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel
    return model_class(hf_config(kind)).float()


class HFCausalLM(L.LightningModule):
    """What a user writes around a Hugging Face model: no pipeline-specific code."""

    def __init__(self, kind: str = "llama", lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = hf_model(kind)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def token_windows(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, LENGTH), generator=g))


class PretrainedLlama(HFCausalLM):
    """A Llama started from ``save_pretrained`` weights at ``path``: with ``per_stage``, built in
    ``configure_model`` (on the meta device under PipeStrategy) and each stage reads only its own
    tensors (docs/large-models.md); otherwise ``from_pretrained``, whole, as on one device."""

    def __init__(self, path: str, per_stage: bool, lr: float = 3e-3) -> None:
        L.LightningModule.__init__(self)
        import transformers

        self.lr, self.path, self.per_stage = lr, path, per_stage
        self.model = None if per_stage else transformers.LlamaForCausalLM.from_pretrained(path)

    def configure_model(self):
        import transformers

        if self.model is None:
            self.model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(self.path))

    def reset_module_parameters(self, module):
        self.model._init_weights(module)  # Hugging Face's own initialiser of one module (rotary tables too)

    def on_fit_start(self):
        from lightning_pipe import load_stage_weights

        if self.per_stage and self.trainer.ckpt_path is None:  # a resumed fit restores its checkpoint instead
            load_stage_weights(self, self.path, prefix="model.")
