"""Random small models built from the supported op families, for fuzzing exactness.

`FuzzModel(seed)` stacks 1-3 blocks on a ``[batch, seq, width]`` input. Each
block is an MLP, an attention block (heads split and merged by views), a
mixture of experts (a router's top-k into `autotp.capture.experts.experts`),
or a block of integer and boolean tensors with dropout, optionally behind a
layer norm, optionally residual, optionally reusing an
earlier block's weights; widths are drawn from primes and composites. The
same seed builds the same model and inputs in every process.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from autotp.capture.experts import experts

WIDTHS = (4, 5, 6, 7, 8, 11, 12, 13, 16)
ACTIVATIONS = (F.gelu, F.relu, torch.tanh, F.silu)
EXPERT_ACTIVATIONS = ("silu", "relu", "gelu")


class MLPBlock(nn.Module):
    def __init__(self, width: int, inner: int, act):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(width, inner), nn.Linear(inner, width), act

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class AttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, head_dim: int, causal: bool):
        super().__init__()
        self.heads, self.head_dim, self.causal = heads, head_dim, causal
        self.q, self.k, self.v = (nn.Linear(width, heads * head_dim) for _ in range(3))
        self.out = nn.Linear(heads * head_dim, width, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MoEBlock(nn.Module):
    """A router's top-k experts per token, weights renormalised, as transformers' Mixtral routes."""

    def __init__(self, width: int, inner: int, n_experts: int, top_k: int, activation: str):
        super().__init__()
        self.router = nn.Linear(width, n_experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(n_experts, 2 * inner, width) / width ** 0.5)
        self.down = nn.Parameter(torch.randn(n_experts, width, inner) / inner ** 0.5)
        self.top_k, self.activation = top_k, activation

    def forward(self, x):
        b, s, w = x.shape
        flat = x.reshape(b * s, w)
        weights, index = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts(flat, index, weights, self.gate_up, self.down, self.activation).view(b, s, w)


class MaskBlock(nn.Module):
    """Boolean and integer tensors (a comparison, an argmax and its parity) and dropout, around a linear."""

    def __init__(self, width: int, p: float):
        super().__init__()
        self.proj, self.p = nn.Linear(width, width), p

    def forward(self, x):
        above = x > x.mean(dim=-1, keepdim=True)
        parity = (x.argmax(dim=-1, keepdim=True) % 2).to(x.dtype)
        return F.dropout(self.proj(torch.where(above, x, 0.5 * x)), p=self.p) + parity


class FuzzModel(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        rng = random.Random(seed)
        self.seed = seed
        self.width = rng.choice(WIDTHS)
        self.batch, self.seq = rng.choice((2, 3, 4, 6)), rng.choice((2, 4, 5, 8))
        self.blocks, self.norms, self.residual, self.shared = nn.ModuleList(), nn.ModuleList(), [], []
        for i in range(rng.randint(1, 3)):
            if i and rng.random() < 0.2:
                self.shared.append(rng.randrange(i))  # reuse an earlier block's weights
                self.blocks.append(nn.Identity())
            else:
                self.shared.append(None)
                self.blocks.append(self._block(rng))
            self.norms.append(nn.LayerNorm(self.width) if rng.random() < 0.5 else nn.Identity())
            self.residual.append(rng.random() < 0.6)
        self.head = nn.Linear(self.width, rng.choice(WIDTHS), bias=rng.random() < 0.5)
        self.reduce = rng.choice(("none", "sum", "mean"))

    def _block(self, rng):
        kind = rng.random()
        if kind < 0.35:
            return MLPBlock(self.width, rng.choice(WIDTHS), rng.choice(ACTIVATIONS))
        if kind < 0.7:
            return AttentionBlock(self.width, rng.choice((1, 2, 3, 4)), rng.choice((2, 3, 4)), rng.random() < 0.5)
        if kind < 0.85:
            n_experts = rng.choice((2, 3, 4, 6))
            return MoEBlock(self.width, rng.choice(WIDTHS), n_experts, rng.randint(1, min(2, n_experts)),
                            rng.choice(EXPERT_ACTIVATIONS))
        return MaskBlock(self.width, rng.choice((0.1, 0.2)))

    def forward(self, x):
        for block, norm, residual, shared in zip(self.blocks, self.norms, self.residual, self.shared):
            fn = self.blocks[shared] if shared is not None else block
            y = fn(norm(x))
            x = x + y if residual else y
        y = self.head(x)
        if self.reduce == "sum":
            return y.sum(dim=1)
        if self.reduce == "mean":
            return y.mean(dim=-1)
        return y

    def example_inputs(self):
        gen = torch.Generator().manual_seed(self.seed)
        return (torch.randn(self.batch, self.seq, self.width, generator=gen),)


def build(seed: int):
    torch.manual_seed(seed)
    model = FuzzModel(seed)
    return model, model.example_inputs()


def random_filter(seed: int, keep: float = 0.5):
    """A forced plan: each op keeps a random part of its strategies (R always), the ILP picks among them."""

    def allow(op, strategy) -> bool:
        if strategy.is_replicated:
            return True
        return random.Random(f"{seed}/{op.name}/{strategy.describe()}").random() < keep

    return allow
