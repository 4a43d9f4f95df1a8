"""A model that touches every supported op family once, for the single-process rule tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 12))
        self.b = nn.Parameter(torch.randn(12))
        self.scale = nn.Parameter(torch.randn(4, 1, 12))
        self.conv = nn.Conv2d(1, 4, kernel_size=3, padding=1)

    def forward(self, x):  # x: (4, 6, 8)
        y = torch.matmul(x, self.w) + self.b                 # (4, 6, 12)
        z = torch.bmm(y, y.transpose(1, 2))                  # (4, 6, 6)
        z = F.softmax(z, dim=-1) * 2.0 - F.log_softmax(z, dim=1)
        y = torch.bmm(z, y) * self.scale / 3.0               # (4, 6, 12)
        a, b = y.chunk(2, dim=2)                             # (4, 6, 6) each
        c = torch.cat([F.silu(a), torch.tanh(b), -a], dim=2)  # (4, 6, 18)
        d = c.permute(2, 0, 1).unsqueeze(0)                  # (1, 18, 4, 6)
        e = d.expand(3, 18, 4, 6).sum(dim=0) - d.mean(dim=0)  # (18, 4, 6)
        f = torch.mm(e.reshape(18, 24), e.reshape(24, 18))   # (18, 18)
        g = F.relu(F.dropout(f, p=0.0, training=True))
        img = self.conv(x.unsqueeze(1))                      # (4, 4, 6, 8)
        h = img.flatten(2).select(1, 0)                      # (4, 4, 48) -> (4, 48)
        pooled = F.max_pool2d(img, 2) + F.avg_pool2d(img, 2)  # (4, 4, 3, 4)
        pooled = pooled.sum(dim=(2, 3)) + F.adaptive_avg_pool2d(img, 1).flatten(1)  # (4, 4)
        top, top_idx = torch.topk(y, 2, dim=-1)              # (4, 6, 2) values and indices
        row_max, row_idx = y.max(dim=1)                      # (4, 12)
        var, mean = torch.var_mean(y, dim=1)                 # (4, 12)
        picked = torch.where(y > 0, y, y * 0.5).argmax(-1)   # (4, 6) int64
        stats = top.sum(-1) + y.cumsum(1).amax(-1) + torch.logsumexp(y, dim=-1)  # (4, 6)
        # rounded divisions are not linear in the numerator: a partial sum may not pass through them
        rounded = torch.div(y, 0.3, rounding_mode="floor") + torch.div(y, self.scale, rounding_mode="trunc")
        return (g.sum(dim=1), torch.sum(e), h, pooled, stats, row_max + var + mean, top_idx, row_idx, picked,
                rounded)
