"""Random ops on split tensors, drawn as the single device draws them.

A rank that ran ``dropout`` on its shard would draw a mask of the shard's
shape: a different mask from the single device's, and a generator advanced
differently, so every later draw would differ too. Here a random op whose
output is split draws the *whole* tensor, exactly as the unsplit op would (the
same ATen op, on a stand-in of the full shape and the single device's
strides, from the same generator state), and keeps this device's piece. Every
rank then holds the single device's values and its generator advances as the
single device's does; a replicated random op is left as it is, which gives
every rank the same values. Both need every rank's generator seeded alike
(``torch.manual_seed`` on every rank), as DTensor's RNG tracker assumes too.

This is the CPU way of DTensor's offset-based RNG: drawing the whole tensor
costs its full time on every rank (`autotp.cost.compute` prices it so). On
CUDA, DTensor advances Philox offsets to draw only the shard instead; here
CUDA draws the whole tensor too, exact as long as the op itself is.

Attention dropout inside ``scaled_dot_product_attention`` is drawn alike:
split attention (by batch or heads) runs the op's math decomposition on its
shard with its piece of the whole weights' mask, which is what the CPU kernel
computes when ``dropout_p > 0`` (within float rounding: the kernel scales ``q``
and ``k`` apart).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from autotp.graph.random import MULTIPLICATIVE, SDPA, sdpa_dropout, sdpa_weights_shape
from autotp.placement import cut_piece, shard_cuts

aten = torch.ops.aten


class _Piece(nn.Module):
    """Cuts this device's piece, under ``layout``, out of a whole tensor (a view: the caller uses it at once)."""

    def __init__(self, layout, mesh_shape, coords):
        super().__init__()
        self.cuts = shard_cuts(layout, mesh_shape, coords)  # worked out once: the forward pass is tensor code

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        return cut_piece(full, self.cuts)


class WholeDraw(_Piece):
    """A random op on this device's piece ``x``: the whole tensor drawn from a stand-in of the single device's
    shape and strides (what the unsplit op's ``empty_like`` gives, so the draw fills it alike), this piece kept.
    """

    def __init__(self, target, args: tuple, kwargs: dict, shape, stride, layout, mesh_shape, coords):
        super().__init__(layout, mesh_shape, coords)
        self.target, self.args, self.kwargs = target, tuple(args), dict(kwargs)
        self.shape, self.stride = tuple(shape), tuple(stride)

    def _stand_in(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=x.dtype, device=x.device)

    def forward(self, x):
        if self.target in MULTIPLICATIVE:
            p, train = self.args
            if not train or p == 0:
                return x  # ATen returns the input itself, drawing nothing
            return x * self.piece(self.target(self._stand_in(x).fill_(1.0), p, train))
        return self.piece(self.target(self._stand_in(x), *self.args, **self.kwargs)).contiguous()

    def extra_repr(self) -> str:
        return f"{self.target}, drawn whole at {self.shape}"


class WholeDrawAttention(_Piece):
    """``scaled_dot_product_attention`` with ``dropout_p > 0`` on this device's batch or heads: the CPU math
    kernel's steps, with this device's piece of the whole attention weights' dropout mask ``[b, h, s, t]``."""

    def __init__(self, weights_shape, dropout_p: float, is_causal: bool, scale, enable_gqa: bool, layout,
                 mesh_shape, coords):
        super().__init__(layout, mesh_shape, coords)
        self.weights_shape, self.dropout_p, self.is_causal = tuple(weights_shape), dropout_p, is_causal
        self.scale, self.enable_gqa = scale, enable_gqa

    def forward(self, q, k, v, attn_mask=None):
        if self.enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        root = math.sqrt(self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        scores = (q * root) @ (k * root).transpose(-2, -1)  # the kernel scales both factors by the root
        if self.is_causal:
            keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                      else scores + attn_mask)
        weights = torch.softmax(scores, dim=-1)
        ones = torch.ones(self.weights_shape, dtype=weights.dtype, device=weights.device)
        return (weights * self.piece(aten.dropout.default(ones, self.dropout_p, True))) @ v

    def extra_repr(self) -> str:
        return f"dropout {self.dropout_p}, mask drawn whole at {self.weights_shape}"


def whole_draw(target, args: tuple, kwargs: dict, in_metas, layout, mesh_shape, coords) -> nn.Module:
    """The module that runs random op ``target`` on this device's piece (`draws_whole` said it must).

    ``args``/``kwargs`` are the op's, tensors included (their values unused);
    ``in_metas`` the captured whole values of its tensor inputs.
    """
    if target == SDPA:
        q, k = in_metas[0], in_metas[1]
        scale = args[6] if len(args) > 6 else kwargs.get("scale")
        is_causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
        return WholeDrawAttention(sdpa_weights_shape(q, k), sdpa_dropout(args, kwargs), is_causal, scale,
                                  bool(kwargs.get("enable_gqa", False)), layout, mesh_shape, coords)
    rest = tuple(args[1:])
    return WholeDraw(target, rest, kwargs, in_metas[0].shape, in_metas[0].stride(), layout, mesh_shape, coords)
