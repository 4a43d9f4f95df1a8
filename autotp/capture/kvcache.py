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
    """``decoder(input_ids, cache_position, attention_mask, position_ids) -> logits``: one step of a transformers
    causal LM (prompt tokens or one new token a row), its cache of ``max_cache_len`` positions kept in buffers
    between calls. The logits are those of the last ``logits_to_keep`` positions of each row (transformers'
    argument, 1 as ``generate`` asks; 0 for every position), where the model takes that argument.

    ``cache_position`` (``[len]``) says which cache slots the step writes;
    ``attention_mask`` (``[batch, max_cache_len]``, 0 at a padding slot, 1
    elsewhere) lets rows of a batch start at different slots, as a
    left-padded batch of prompts does; ``position_ids`` (``[batch, len]``)
    are each row's positions, which count from its first real token
    (`autotp.decoding.step_inputs` makes all four). Every step takes the
    mask, so one plan serves padded and unpadded batches alike.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_cache_len: int, logits_to_keep: int = 1):
        super().__init__()
        from transformers import StaticCache

        config = model.config
        self.model = model
        self._cache_argument = cache_argument(model)
        # the logits of the last position only, as ``generate`` asks for them: the prefill's LM head then reads one
        # position a row, not the prompt's (at a 70B's batch 64 of 2048 tokens, 8 GiB of logits); 0 keeps all
        self._extra = ({"logits_to_keep": logits_to_keep}
                       if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
        self.cache = StaticCache(config=config, max_cache_len=max_cache_len)
        heads = config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = next(model.parameters())
        self.cache.early_initialization(batch_size, heads, head_dim, weight.dtype, weight.device)
        for i, layer in enumerate(self.cache.layers):
            for name in _STATE:
                self.register_buffer(f"{CACHE_PREFIX}{i}_{name}", getattr(layer, name),
                                     persistent=False)  # state, not weights

    def state_names(self) -> list[str]:
        """The names of the cache's buffers."""
        return [f"{CACHE_PREFIX}{i}_{name}" for i in range(len(self.cache.layers)) for name in _STATE]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.cache.layers):  # the buffers as export (or a rank module) holds them now
            for name in _STATE:
                setattr(layer, name, getattr(self, f"{CACHE_PREFIX}{i}_{name}"))
        out = self.model(input_ids=input_ids, cache_position=cache_position, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=True, **{self._cache_argument: self.cache},
                         **self._extra)
        return out.logits


def cache_argument(model: nn.Module) -> str:
    """The name of ``model.forward``'s cache argument: ``cache`` in transformers 5.x, ``past_key_values`` before
    (deprecated since)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


_STATE = ("keys", "values", "cumulative_length")  # a StaticLayer's tensors
CACHE_PREFIX = "cache_"  # the cache's buffers are cache_<layer>_<tensor>

