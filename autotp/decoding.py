"""Generation across ranks: a planned prefill step and a planned decode step sharing one key/value cache.

A transformers decoder generates in two shapes of step: the prefill reads
the prompt (``P`` tokens a row) and fills the cache, and each decode step
reads one token a row and appends to it. Each gets its own plan, since what
is fast for ``P`` tokens (compute bound) is not what is fast for one (bound
by reading weights and cache), but both read the same cache and the same
weights: `plan_decoding` plans the decode step first (it runs once per new
token) and then the prefill with every parameter and cache buffer pinned to
the decode plan's layouts, so each rank holds one copy of its shards and
nothing moves between the two steps. `parallelize_decoding` builds both rank
programs and binds the second's weights and cache to the first's, and
`generate` runs the loop of transformers' ``generate`` (greedy or sampled,
its logits warpers, its stop at the end-of-sequence token) over either the
rank programs or the single-device `CachedDecoder`. Every rank returns the
whole logits, so every rank draws the same tokens from the same random seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.capture.kvcache import CACHE_PREFIX, CachedDecoder
from autotp.errors import PlanError
from autotp.lower.rewrite import set_module_tensor
from autotp.solve.plan import Plan
from autotp.units import format_bytes

# transformers' values for sampling settings a generation config leaves unset (GenerationConfig's defaults)
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass
class DecodingPlans:
    """The plans of the two steps of generation, for ``batch_size`` rows of ``prompt_length`` tokens and a cache
    of ``max_length`` positions (prompt and new tokens together)."""

    prefill: Plan
    decode: Plan
    batch_size: int
    prompt_length: int
    max_length: int

    @property
    def peak_bytes(self) -> int:
        """Memory per device at the peak of either step: weights, cache and that step's largest working set."""
        return max(self.prefill.memory["total"], self.decode.memory["total"])

    def summary(self) -> str:
        """The predicted time of each step, the decode step's throughput per device, and the memory each device
        keeps."""
        token_s, devices, peak = self.decode.predicted["total_s"], self.decode.mesh.size, self.peak_bytes
        return (f"prefill of {self.batch_size}x{self.prompt_length} tokens: "
                f"{self.prefill.predicted['total_s'] * 1e3:.3f} ms predicted\n"
                f"decode: {token_s * 1e3:.3f} ms predicted per token, buffers (the cache) "
                f"{format_bytes(self.decode.memory.get('buffers', 0))} per device\n"
                f"decode throughput (the prefill not counted): {self.batch_size / token_s:.1f} tokens/s at "
                f"{self.batch_size} rows, {self.batch_size / (token_s * devices):.1f} per device\n"
                f"memory per device: {format_bytes(peak)} at the peak (weights, cache, and the prefill's largest "
                f"working set {format_bytes(self.prefill.memory.get('activations', 0))})\n"
                f"cache layouts: {_cache_layouts(self.decode)}" + _whole_note(self))


def _whole_note(plans: DecodingPlans) -> str:
    """A line saying that no step is split, where none is: each device then repeats one device's work."""
    if any(p.forward_collectives() or any(x != "R" for n in p.nodes.values() for x in n.out)
           for p in (plans.prefill, plans.decode)):
        return ""
    return ("\nno split pays at this size on these links: every device runs the whole model, so one device "
            "generates as fast")


def _cache_layouts(plan: Plan) -> str:
    split = sorted({" ".join(v) for k, v in plan.buffers.items() if k.startswith(CACHE_PREFIX)})
    return ", ".join(split) or "whole on every device"


def step_inputs(batch_size: int, length: int, max_length: int, start: int = 0, device=None) -> tuple:
    """Example inputs of a `CachedDecoder` step: ``length`` tokens a row at cache slots ``start, start + 1, ...``,
    no padding, a cache of ``max_length`` slots."""
    ids = torch.zeros(batch_size, length, dtype=torch.long, device=device)
    slots = torch.arange(start, start + length, device=device)
    mask = torch.ones(batch_size, max_length, dtype=torch.long, device=device)
    return ids, slots, mask, slots.expand(batch_size, length).clone()


def plan_decoding(model, mesh, batch_size: int, prompt_length: int, max_length: int, **options) -> DecodingPlans:
    """Plan the decode step of ``model`` (a transformers causal LM), then its prefill with the same weights and
    cache layouts; ``options`` go to both `autotp.plan` calls (``profile``, ``pin``, ``memory_limit``, ...).
    A pin may name a parameter as the model names it; the plans name it as the step does (``model.`` first)."""
    from autotp.api import plan

    if not 0 < prompt_length < max_length:
        raise PlanError(f"the prompt length ({prompt_length}) must be at least 1 and below max_length "
                        f"({max_length}), which counts the prompt and the new tokens")
    device = next(model.parameters()).device  # the meta device plans a model too large for this machine
    step = CachedDecoder(model, batch_size, max_length)  # one cache allocated, for both captures
    options = {**options, "training": False, "whole_outputs": True, "pin": _step_names(step, options.get("pin"))}
    decode = plan(step, mesh, step_inputs(batch_size, 1, max_length, prompt_length, device), **options)
    whole = ("R",) * len(decode.mesh.shape)
    pin = {**options["pin"], **decode.parameters,
           **{n: decode.buffers.get(n, whole) for n in step.state_names()}}
    prefill = plan(step, mesh, step_inputs(batch_size, prompt_length, max_length, 0, device),
                   **{**options, "pin": pin})
    return DecodingPlans(prefill, decode, batch_size, prompt_length, max_length)


def _step_names(step: CachedDecoder, pin: dict | None) -> dict:
    """``pin`` with the names of the model's own parameters and buffers (``model.layers.0.mlp.up_proj.weight``, as
    `autotp.interop.hf_tp_plan_pins` gives them) turned into the step's (``model.`` before them); the step's own
    names, and names of neither, are kept as given (the planner names what is wrong with them)."""
    own = {n for n, _ in step.named_parameters()} | {n for n, _ in step.named_buffers()}
    return {k if k in own or f"model.{k}" not in own else f"model.{k}": v for k, v in (pin or {}).items()}


@dataclass
class RankDecoder:
    """This rank's two step programs, the decode step's weights and cache the prefill's own tensors."""

    prefill: torch.nn.Module
    decode: torch.nn.Module
    prompt_length: int
    max_length: int

    def generate(self, input_ids: torch.Tensor, generation_config=None, **kwargs) -> torch.Tensor:
        return generate(self.prefill, self.decode, input_ids, generation_config, prompt_length=self.prompt_length,
                        max_length=self.max_length, **kwargs)


def parallelize_decoding(model, plans: DecodingPlans, rank: int | None = None, *, device_mesh=None,
                         **options) -> RankDecoder:
    """This rank's prefill and decode programs (`autotp.parallelize` of each plan), sharing one set of shards.

    The plans agree on every parameter's and cache buffer's layout
    (`plan_decoding`), so the decode program's tensors are replaced by the
    prefill program's: one copy of the weights and one cache per rank.
    """
    from autotp.api import _mesh_device_type, parallelize
    from autotp.runtime.groups import plan_device_mesh

    if device_mesh is None and options.get("groups") is None:  # one set of process groups for both programs
        device_mesh = plan_device_mesh(plans.decode.mesh, _mesh_device_type(options.get("device"), model))
    step = CachedDecoder(model, plans.batch_size, plans.max_length)  # one whole cache, cut into each program's piece
    steps = [parallelize(step, p, rank, device_mesh=device_mesh, **options) for p in (plans.prefill, plans.decode)]
    alike = {n for n, layout in plans.decode.parameters.items() if plans.prefill.parameters.get(n) == layout}
    share_state(*steps, alike)
    return RankDecoder(*steps, plans.prompt_length, plans.max_length)


def share_state(source: torch.nn.Module, target: torch.nn.Module, parameters=frozenset()) -> None:
    """Bind ``target``'s cache buffers, and those of its ``parameters`` (names laid out alike in both plans), to
    ``source``'s tensors of the same name."""
    params = dict(source.named_parameters())
    for name, param in list(target.named_parameters()):
        if name in parameters and name in params and params[name].shape == param.shape:
            set_module_tensor(target, name, params[name])
    buffers = dict(source.named_buffers())
    for name, buffer in list(target.named_buffers()):
        if _leaf(name).startswith(CACHE_PREFIX):
            if name not in buffers or buffers[name].shape != buffer.shape:
                raise PlanError(f"the prefill and decode programs hold cache buffer {name!r} in different layouts: "
                                "plan them together with autotp.decoding.plan_decoding")
            set_module_tensor(target, name, buffers[name])


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def reset_cache(*steps: torch.nn.Module) -> None:
    """Empty the cache of each step (a `CachedDecoder` or its rank program): the next call starts a new batch.
    Steps that are not modules (a wrapper) are passed over: the module they call holds the cache."""
    for step in steps:
        if not isinstance(step, torch.nn.Module):
            continue
        for name, buffer in step.named_buffers():
            if _leaf(name).startswith(CACHE_PREFIX):
                buffer.zero_()


def generate(prefill, decode, input_ids: torch.Tensor, generation_config=None, *, attention_mask=None,
             prompt_length: int | None = None, max_length: int | None = None, **kwargs) -> torch.Tensor:
    """The prompt and its continuation, as transformers' ``generate`` returns them, one row per prompt.

    ``prefill`` fills the cache from the whole prompt in one call, or, when
    None, ``decode`` takes the prompt one token at a time. Prompts of
    different lengths come left-padded with their ``attention_mask`` (0 at
    padding), as transformers takes them; each row's positions then count
    from its first real token. Settings come from ``generation_config``
    (transformers' ``GenerationConfig``, e.g. the model's
    ``generation_config``) updated by ``kwargs``: ``max_new_tokens``,
    ``do_sample`` with ``temperature``, ``top_k`` and ``top_p``
    (transformers' warpers, in its order), ``eos_token_id`` (a row that
    produced it gets ``pad_token_id`` after, and generation stops when every
    row has). Sampling draws from torch's global generator, as ``generate``
    does. The cache (``max_length`` slots, read from the steps' cache
    buffers when not given) is emptied first.
    """
    from transformers import GenerationConfig

    config = GenerationConfig(**{**(generation_config.to_dict() if generation_config is not None else {}), **kwargs})
    new_tokens = config.max_new_tokens  # transformers' config refuses a count below 1
    if new_tokens is None:
        raise ValueError("give max_new_tokens, the number of tokens to generate after the prompt")
    rows, length = input_ids.shape
    if prefill is not None and prompt_length is not None and length != prompt_length:
        raise PlanError(f"the prefill step was planned for prompts of {prompt_length} tokens, not {length}: plan "
                        "it for this length (autotp.decoding.plan_decoding), or left-pad the prompts to it")
    steps = list({id(s): s for s in (prefill, decode) if s is not None}.values())
    max_length = max_length or _cache_length(steps)
    if length + new_tokens - 1 > max_length:
        raise PlanError(f"{length} prompt tokens and {new_tokens} new ones do not fit a cache of {max_length} "
                        f"slots (the last token is not fed back): ask for at most {max_length - length + 1} new "
                        "tokens, or plan a longer cache (max_length)")
    reset_cache(*steps)
    warp = _warpers(config) if config.do_sample else None
    eos = _token_ids(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones(rows, length, dtype=torch.long, device=device)
    mask = torch.cat([attention_mask.long(), attention_mask.new_ones(rows, max_length - length)], dim=1)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # as transformers
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    sequences = input_ids
    logits = _fill(prefill, decode, input_ids, mask, positions)
    for t in range(new_tokens):
        scores = logits[:, -1].to(torch.float32)
        if warp is not None:
            token = torch.multinomial(torch.softmax(warp(sequences, scores), dim=-1), num_samples=1).squeeze(1)
        else:
            token = scores.argmax(-1)
        if eos:
            token = token * unfinished + pad * (1 - unfinished)
        sequences = torch.cat([sequences, token[:, None]], dim=-1)
        if eos:
            unfinished = unfinished & ~torch.isin(token, torch.tensor(eos, device=device))
            if unfinished.max() == 0:
                break
        if t + 1 < new_tokens:
            logits = decode(token[:, None], torch.tensor([length + t], device=device), mask,
                            positions[:, -1:] + t + 1)
    return sequences


def _fill(prefill, decode, prompt: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The cache filled with ``prompt``; the logits of its last position."""
    if prefill is not None:
        return prefill(prompt, torch.arange(prompt.shape[1], device=prompt.device), mask, positions)
    for i in range(prompt.shape[1]):
        logits = decode(prompt[:, i:i + 1], torch.tensor([i], device=prompt.device), mask, positions[:, i:i + 1])
    return logits


def _cache_length(steps) -> int:
    """The cache's slots, read from a step's key buffer (``[batch, heads, slots, head_dim]``, never split on its
    slots: `autotp.strategies.inplace`)."""
    for step in steps:
        if isinstance(step, torch.nn.Module):
            for name, buffer in step.named_buffers():
                if _leaf(name).startswith(CACHE_PREFIX) and name.endswith("_keys"):
                    return buffer.shape[-2]
    raise PlanError("no step holds a key/value cache: pass max_length, the cache's slots")


def _token_ids(ids) -> list[int]:
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def _warpers(config):
    """transformers' sampling warpers for ``config``, in the order its ``generate`` applies them."""
    from transformers.generation import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                                         TopPLogitsWarper)

    settings = {k: getattr(config, k) if getattr(config, k) is not None else v for k, v in SAMPLING_DEFAULTS.items()}
    warpers = LogitsProcessorList()
    if settings["temperature"] != 1.0:
        warpers.append(TemperatureLogitsWarper(settings["temperature"]))
    if settings["top_k"] != 0:
        warpers.append(TopKLogitsWarper(top_k=settings["top_k"]))
    if settings["top_p"] < 1.0:
        warpers.append(TopPLogitsWarper(top_p=settings["top_p"]))
    return warpers
