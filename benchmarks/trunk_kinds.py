"""Throughput of a looped ``nn.ModuleList`` trunk against the same blocks as an ``nn.Sequential``.

    python benchmarks/trunk_kinds.py --rounds 4 --steps 30 --micro-batches 4

Workload W2 of ``benchmarks/throughput.py`` (GPT decoder: 4 blocks, d_model 256, 4 heads, sequence
128, vocab 1024, batch 32) as an ordinary LightningModule, trained through ``Trainer(devices=2,
strategy=PipeStrategy(schedule="1f1b"))`` on 2 gloo processes with 1 thread each. The two variants
differ only in the trunk: ``sequential`` calls ``self.blocks(x)``; ``list`` loops ``for block in
self.blocks: x = block(x, mask, rope=...)`` passing two extra tensors that every block uses
(a boolean causal mask and a rotary-style table), as a Hugging Face model does; the Sequential blocks
build the same two tensors themselves, so both compute the same thing.

Both variants run in one job, in alternating order (``list, sequential, sequential, list, ...``), a
fresh model per fit; each fit times its steps after ``--warmup`` steps with a callback (wall time
from one ``on_train_batch_end`` to the next, on rank 0). Printed: samples/s per fit, the median per
variant and the ratio list/sequential per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from throughput import W2_BLOCKS, W2_D_MODEL, W2_HEADS, W2_SEQ, W2_VOCAB, TokenEmbedding  # noqa: E402

import lightning_pipe  # noqa: E402


def causal_mask(length: int) -> Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def rope_table(length: int) -> Tensor:
    return torch.cos(torch.arange(length)[:, None] * torch.linspace(0.01, 1.0, W2_D_MODEL)[None])


class Block(nn.Module):
    """W2's pre-norm GPT block with two extra inputs: a causal mask and a table added to the input of the
    attention; without them it builds both itself."""

    def __init__(self) -> None:
        super().__init__()
        d = W2_D_MODEL
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor, mask: Tensor | None = None, rope: Tensor | None = None) -> Tensor:
        b, t, d = x.shape
        mask = causal_mask(t) if mask is None else mask
        rope = rope_table(t) if rope is None else rope
        q, k, v = self.qkv(self.ln1(x) + rope).view(b, t, 3, W2_HEADS, d // W2_HEADS).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(L.LightningModule):
    def __init__(self, trunk: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = trunk
        self.embed = TokenEmbedding(W2_VOCAB, W2_D_MODEL, W2_SEQ)
        blocks = [Block() for _ in range(W2_BLOCKS)]
        self.blocks = nn.ModuleList(blocks) if trunk == "list" else nn.Sequential(*blocks)
        self.ln_f, self.head = nn.LayerNorm(W2_D_MODEL), nn.Linear(W2_D_MODEL, W2_VOCAB)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        x = self.embed(tokens)
        if self.trunk == "list":
            mask, rope = causal_mask(tokens.shape[1]), rope_table(tokens.shape[1])
            for block in self.blocks:
                x = block(x, mask, rope=rope)
        else:
            x = self.blocks(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.last = warmup, [], None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.last is not None and batch_idx > self.warmup:
            self.times.append(now - self.last)
        self.last = now


def fit(trunk: str, steps: int, warmup: int, micro_batches: int, batch: int) -> float:
    """Samples per second of one fit (rank 0's view)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, W2_VOCAB, (batch * (steps + warmup + 1), W2_SEQ + 1), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    timer = StepTimer(warmup)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps + warmup + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[timer],
                        strategy=lightning_pipe.PipeStrategy(schedule="1f1b", micro_batches=micro_batches))
    trainer.fit(GPT(trunk), data)
    return batch / statistics.median(timer.times) if timer.times else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="fits per variant (alternating order)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of every fit")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[float]] = {"list": [], "sequential": []}
    for r in range(args.rounds):
        order = ["list", "sequential"] if r % 2 == 0 else ["sequential", "list"]
        for trunk in order:
            results[trunk].append(fit(trunk, args.steps, args.warmup, args.micro_batches, args.batch))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0:
        return
    print(f"W2 (GPT, 4 blocks, d_model 256, seq 128, batch {args.batch}), 1f1b, M={args.micro_batches}, 2 processes x 1 thread; "
          f"{args.rounds} fits per trunk of {args.steps} timed steps")
    print("| round | ModuleList samples/s | Sequential samples/s | ratio |")
    print("|---|---|---|---|")
    for r, (a, b) in enumerate(zip(results["list"], results["sequential"])):
        print(f"| {r} | {a:.1f} | {b:.1f} | {a / b:.3f} |")
    a, b = statistics.median(results["list"]), statistics.median(results["sequential"])
    print(f"| median | {a:.1f} | {b:.1f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
