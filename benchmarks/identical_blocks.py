"""A nanoGPT-style LM whose trunk is 8 identical transformer blocks in an nn.ModuleList (issue 27.3).

The best split of identical blocks is the uniform one; a planner that splits them otherwise is
splitting by noise. Plan it on a loaded machine:

    lightning-pipe plan --model benchmarks.identical_blocks.TinyGPT --batch_shape [16,64] --batch_dtype int64 \\
        --stages 2 --threads 1 --timeline null

(docs/planning.md, "Noise", records the runs.)
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class TinyGPT(L.LightningModule):
    """Token and position embeddings, ``depth`` identical blocks (the trunk), a final norm and an LM head."""

    def __init__(self, vocab: int = 256, width: int = 128, heads: int = 4, depth: int = 8, context: int = 64) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)
