"""The built-in demo model: small, but with the features a capture should show.

An encoder block called twice (pass labels), functional ops no module hook can see
(``F.scaled_dot_product_attention``, ``torch.relu``, ``+``), an in-place op and a head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DemoNet", "demo_inputs"]


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.transpose(1, 2).reshape(batch, seq, width)
        return x + self.mlp(x)


class DemoNet(nn.Module):
    """Embedding → one encoder block applied twice → ReLU → head."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 4, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.encoder = Block(width, heads)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for _ in range(2):  # one block, two passes: its ops are labelled ...:1 and ...:2
            x = self.encoder(x)
        x = torch.relu(x)
        x.mul_(0.5)  # in-place: the saved relu output must not change
        return self.head(x.mean(dim=1))


def demo_inputs(batch: int = 2, seq: int = 8, vocab: int = 50) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=generator)
