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

Every layer keeps all ``max_cache_len`` positions, sliding-window and
chunked layers (Gemma-2 and 3, Mistral with a window) included. Their
window is the attention mask's to apply, as transformers' masks do for a
full-length cache: transformers' own sliding layer instead rolls a buffer
of the window's size and branches on a Python counter of the tokens seen,
so one captured step would hold one branch of it, and the counter is state
that no buffer carries (a second generation would start from the first's
count). With full-length layers the whole state of the cache is its
buffers, which `autotp.decoding.reset_cache` empties; the cost is the
positions beyond each window, which the plan's memory counts.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from autotp.errors import PlanError


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

        _check_generates(model)
        config = model.config
        self.model = model
        self._cache_argument = cache_argument(model)
        # the logits of the last position only, as ``generate`` asks for them: the prefill's LM head then reads one
        # position a row, not the prompt's (at a 70B's batch 64 of 2048 tokens, 8 GiB of logits); 0 keeps all
        self._extra = ({"logits_to_keep": logits_to_keep}
                       if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
        self.cache = StaticCache(config=config, max_cache_len=max_cache_len)
        self.cache.layers = [_full_length(layer, max_cache_len, model) for layer in self.cache.layers]
        weight = next(model.parameters())
        self.cache.early_initialization(batch_size, kv_heads(config), head_dim(config), weight.dtype, weight.device)
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


def _check_generates(model: nn.Module) -> None:
    """A `PlanError` unless ``model`` is a transformers model that generates with a cache (a causal LM's
    ``can_generate``, and a forward that takes the cache)."""
    name = type(model).__name__
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        raise PlanError(f"{name} does not generate (transformers' can_generate() is false, or it is not a "
                        "transformers model): autotp.decoding steps causal LMs such as AutoModelForCausalLM's")
    taken = inspect.signature(model.forward).parameters
    if not {"cache", "past_key_values"} & set(taken):
        raise PlanError(f"{name}.forward takes no key/value cache (neither cache nor past_key_values): autotp "
                        "cannot step it one token at a time; generate with it on one device")


def kv_heads(config) -> int:
    """The key/value heads of a layer, under whichever name the config gives them: ``num_key_value_heads`` (Llama,
    Mistral, Gemma; Falcon maps it), ``num_kv_heads``, or as many as the query heads (GPT-2, BLOOM, OPT, GPT-NeoX
    name those ``n_head`` or ``num_attention_heads``, which transformers' configs map to the latter)."""
    for name in ("num_key_value_heads", "num_kv_heads", "num_attention_heads"):
        heads = getattr(config, name, None)
        if heads:
            return heads
    raise PlanError(f"{type(config).__name__} names no attention heads (num_key_value_heads, num_kv_heads or "
                    "num_attention_heads): autotp cannot size its key/value cache")


def head_dim(config) -> int:
    """The width of one head: the config's ``head_dim`` (Gemma's differs from hidden / heads), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _full_length(layer, max_cache_len: int, model: nn.Module):
    """``layer`` as a full-length ``StaticLayer``: a sliding-window or chunked layer becomes one (its window is the
    mask's); a layer of another kind (linear attention, a compressed or indexed cache) holds state this decoder does
    not carry, so the model is refused by name."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    if type(layer) is StaticLayer:
        return layer
    if type(layer) is StaticSlidingWindowLayer:
        return StaticLayer(max_cache_len=max_cache_len)
    raise PlanError(f"{type(model).__name__}'s cache has a {type(layer).__name__}, which holds state other than "
                    "keys and values: autotp steps models whose every layer caches keys and values (full, sliding "
                    "or chunked attention); generate with this model on one device")


def cache_argument(model: nn.Module) -> str:
    """The name of ``model.forward``'s cache argument: ``cache`` in transformers 5.x, ``past_key_values`` before
    (deprecated since)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


_STATE = ("keys", "values", "cumulative_length")  # a StaticLayer's tensors
CACHE_PREFIX = "cache_"  # the cache's buffers are cache_<layer>_<tensor>

