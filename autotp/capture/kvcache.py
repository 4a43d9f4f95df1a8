"""A transformers decoder stepping with its key/value cache held as module buffers, so that a plan can carry it.

A decode step reads and updates a cache that lives between calls. Passed as
transformers' ``StaticCache``, its tensors sit on a Python object that
``torch.export`` does not see as the module's state: they would be captured
as constants, and their in-place updates lost. `CachedDecoder` registers
each layer's ``keys``, ``values`` and ``cumulative_length`` as buffers and
hands them back to the cache at the start of every call, so the capture sees
buffers updated in place (``index_copy_`` into the keys and values, and
``add_`` on the length), which `autotp.capture.normalize` keeps in place and
in order, and which a rank module then updates on every rank. The cache is
transformers' own class, allocated ahead of use with its
``early_initialization``, as its ``torch.export`` recipes do.

The plan may split the cache as it splits the keys and values it holds, by
kv-head, each rank then keeping and writing its own heads
(`autotp.strategies.inplace`); a cache whose heads the devices do not divide
stays whole.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


class CachedDecoder(nn.Module):
    """``decoder(input_ids, cache_position) -> logits``: one step of a transformers causal LM (prompt tokens or
    one new token a row), its cache of ``max_cache_len`` positions kept in buffers between calls."""

    def __init__(self, model: nn.Module, batch_size: int, max_cache_len: int):
        super().__init__()
        from transformers import StaticCache

        config = model.config
        self.model = model
        # transformers 5.x names the argument ``cache`` (``past_key_values`` before, now deprecated)
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.cache = StaticCache(config=config, max_cache_len=max_cache_len)
        heads = config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = next(model.parameters())
        self.cache.early_initialization(batch_size, heads, head_dim, weight.dtype, weight.device)
        for i, layer in enumerate(self.cache.layers):
            for name in _STATE:
                self.register_buffer(f"cache_{i}_{name}", getattr(layer, name), persistent=False)  # state, not weights

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.cache.layers):  # the buffers as export (or a rank module) holds them now
            for name in _STATE:
                setattr(layer, name, getattr(self, f"cache_{i}_{name}"))
        out = self.model(input_ids=input_ids, cache_position=cache_position, use_cache=True,
                         **{self._cache_argument: self.cache})
        return out.logits


_STATE = ("keys", "values", "cumulative_length")  # a StaticLayer's tensors


def greedy(step, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The ``new_tokens`` tokens greedy decoding appends to ``prompt`` (rows of equal length), one position a
    call of ``step`` (a `CachedDecoder` or its rank module, whose outputs are whole): prompt tokens are fed
    one by one, as the decode step's shape is one token a row. A fresh step (an empty cache) for each prompt."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, not {new_tokens}")
    out, token = [], None
    for position in range(prompt.shape[1] + new_tokens - 1):
        ids = prompt[:, position:position + 1] if position < prompt.shape[1] else token
        logits = step(ids, torch.tensor([position], device=prompt.device))
        if position >= prompt.shape[1] - 1:
            token = logits[:, -1].argmax(-1, keepdim=True)
            out.append(token)
    return torch.cat(out, dim=1)
