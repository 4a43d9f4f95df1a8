"""A mixture-of-experts layer's experts as one op, ``autotp::experts``, so that they can be split by expert.

Captured as transformers runs them, the experts are a sort of the routed
tokens, a histogram, offsets and a grouped matmul (a custom op of
transformers' own): data-dependent steps that no per-op rule can split, so
the planner used to replicate them. While autotp captures a model, each
experts module of transformers' common form (Mixtral's, Qwen2-MoE's: the
``gate_up_proj`` and ``down_proj`` stacks of every expert, gate and up
concatenated, no bias, an activation of `ACTIVATIONS`) runs instead as one
op of what it computes:

    out[t] = sum over j < k of weights[t, j] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])),
    e = index[t, j]

That op has strategies (`autotp.strategies.experts`): tokens split (data
parallelism), and experts split, where a device runs its own experts for the
tokens it is sent by all-to-all (`autotp.lower.experts`), or for all tokens
into a partial sum. A module of another form keeps transformers' code, and
the plan replicates it as before. The user's model is left as it was.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu}


def expert_sum(hidden, index, weights, gate_up, down, activation: str, first: int = 0):
    """The experts' weighted sum for every token, from experts ``first`` to ``first + len(gate_up) - 1`` only
    (rows routed elsewhere get nothing from them): ``hidden`` (tokens, h), ``index`` and ``weights`` (tokens, k),
    ``gate_up`` (experts, 2 * inner, h), ``down`` (experts, h, inner). Differentiable in every float input.

    An expert no token picks still runs, on no rows: the output then depends on every input on every device,
    so backward reaches the same collectives on all of them (a device that skipped it would leave the others
    waiting in a gradient's all-reduce)."""
    act = ACTIVATIONS[activation]
    out = torch.zeros_like(hidden)
    for local in range(gate_up.shape[0]):
        token, slot = torch.where(index == first + local)
        gate, up = F.linear(hidden[token], gate_up[local]).chunk(2, dim=-1)
        routed = F.linear(act(gate) * up, down[local]) * weights[token, slot, None]
        out = out.index_add(0, token, routed.to(out.dtype))
    return out


@torch.library.custom_op("autotp::experts", mutates_args=())
def experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, activation: str) -> torch.Tensor:
    return expert_sum(hidden, index, weights, gate_up, down, activation)


@experts.register_fake
def _experts_shape(hidden, index, weights, gate_up, down, activation):
    return torch.empty_like(hidden)


def _save(ctx, inputs, output) -> None:
    hidden, index, weights, gate_up, down, activation = inputs
    ctx.save_for_backward(hidden, index, weights, gate_up, down)
    ctx.activation = activation


def _backward(ctx, grad):
    """The gradients by running `expert_sum` again under autograd: exact, and the op stays one node."""
    hidden, index, weights, gate_up, down = ctx.saved_tensors
    leaves = [t.detach().requires_grad_() for t in (hidden, weights, gate_up, down)]
    with torch.enable_grad():
        out = expert_sum(leaves[0], index, leaves[1], leaves[2], leaves[3], ctx.activation)
    grads = torch.autograd.grad(out, leaves, grad, allow_unused=True, materialize_grads=True)
    return grads[0], None, grads[1], grads[2], grads[3], None


experts.register_autograd(_backward, setup_context=_save)

EXPERTS = torch.ops.autotp.experts.default


def activation_of(module) -> str | None:
    """The activation's name when ``module`` is a transformers experts module of the form `experts` computes,
    else None (left to transformers' code)."""
    config = getattr(module, "config", None)
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if config is None or not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return None
    form = (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
            and not getattr(module, "is_transposed", True) and not getattr(module, "has_bias", True)
            and not getattr(module, "has_post_expert_norm", True))
    default_gate = getattr(type(module), "_apply_gate", None)
    if not form or default_gate is None or default_gate.__name__ != "_default_apply_gate":
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2]:
        return None
    activation = getattr(config, "hidden_act", None)
    return activation if activation in ACTIVATIONS else None


@contextmanager
def experts_as_one_op(model: torch.nn.Module):
    """While capturing: every experts module `activation_of` recognises calls `experts` instead of its code."""
    patched = []
    for module in model.modules():
        activation = activation_of(module)
        if activation is not None:
            module.forward = _one_op(module, activation)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # the class's forward again


def _one_op(module, activation: str):
    def forward(hidden_states, top_k_index, top_k_weights):
        return experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
                       activation)
    return forward
