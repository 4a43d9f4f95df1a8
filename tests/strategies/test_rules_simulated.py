"""Every strategy of every op, checked by simulating the ranks of a 1-D mesh in one process.

For each op of the test models and each strategy the rules offer, the inputs
are split per the strategy (partial sums as random addends), the op runs on
each simulated rank with localized arguments, and the pieces are combined per
the output placement. The forward must equal the op on whole tensors, and so
must the backward: each input's local gradients are combined per the autograd
duals (S -> concatenate, P -> replicated, R -> partial where the strategy says
so, else replicated).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autotp.capture import capture
from autotp.graph import build_opgraph
from autotp.graph.opgraph import KIND_OP
from autotp.lower.local_args import localize_args
from autotp.placement import Partial, Replicate, Shard, local_shape
from autotp.strategies import default_registry, enumerate_strategies
from models import GPT, MLP
from zoo import Zoo


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps every node's evaluated args, kwargs and result."""

    def __init__(self, gm):
        super().__init__(gm)
        self.seen = {}

    def run_node(self, n):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        result = super().run_node(n)
        self.seen[n.name] = (args, kwargs, result)
        return result


def _cases():
    """The models in float64, so that a mismatch is a wrong rule and never rounding."""
    torch.manual_seed(0)
    yield "mlp", MLP(8, 12).double(), (torch.randn(4, 8, dtype=torch.float64),)
    yield "gpt", GPT(vocab=16, hidden=16, heads=4, layers=1, seq=4).double(), (
        torch.randint(0, 16, (4, 4)), torch.randint(0, 16, (4, 4)))
    yield "zoo", Zoo().double(), (torch.randn(4, 6, 8, dtype=torch.float64),)


def _split(value, placement, n, gen):
    if isinstance(placement, Shard):
        return list(value.chunk(n, dim=placement.dim))
    if isinstance(placement, Partial):
        weights = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5  # addends of the value's own magnitude
        weights = weights / weights.sum()
        return [value * w for w in weights]
    return [value] * n


def _combine(pieces, placement):
    if isinstance(placement, Shard):
        return torch.cat(pieces, dim=placement.dim)
    if isinstance(placement, Partial):
        return sum(pieces)
    for p in pieces[1:]:
        torch.testing.assert_close(p, pieces[0], atol=1e-9, rtol=1e-9)
    return pieces[0]


def _strategies_of(name, model, inputs, n):
    gm = capture(model, inputs)
    graph = build_opgraph(gm)
    strategies = enumerate_strategies(graph, (n,), default_registry())
    rec = _Recorder(gm)
    rec.run(*inputs)
    nodes = {node.name: node for node in gm.graph.nodes}
    for op in graph.nodes():
        if op.kind != KIND_OP or op.target is operator.getitem:
            continue  # getitem takes a list; split's own cases cover its layouts
        args, kwargs, _ = rec.seen[op.name]
        for s in strategies.by_node[op.name]:
            if s.impl:
                continue  # runs its own module with collectives: tests/test_vocab_parallel.py
            yield f"{name}-n{n}-{op.name}-{s.describe()}", n, op, nodes[op.name].target, args, kwargs, s


def _all_cases():
    out = []
    for name, model, inputs in _cases():
        for n in (2, 4):
            out += list(_strategies_of(name, model, inputs, n))
    return out


CASES = _all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_strategy_forward_and_backward(case):
    _, n, op, target, args, kwargs, strategy = case
    _check_rule(op, target, args, kwargs, strategy, n)


def test_every_family_is_exercised():
    ops = {c[2].op_name.split(".")[0] for c in CASES}
    for family in ("linear", "matmul", "bmm", "mm", "add", "mul", "div", "gelu", "softmax", "log_softmax", "layer_norm", "view",
                   "transpose", "permute", "unsqueeze", "expand", "chunk", "cat", "scaled_dot_product_attention",
                   "embedding", "sum", "cross_entropy_loss", "dropout", "conv2d", "flatten", "select"):  # mean is captured as sum / count
        assert family in ops or any(o.startswith(family) for o in ops), family


def _check_rule(op, target, args, kwargs, strategy, n):
    """Forward and backward of one strategy against the op on whole tensors."""
    gen = torch.Generator().manual_seed(1)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    full_ins = [leaves[i].detach().clone().requires_grad_(leaves[i].is_floating_point()) for i in tensor_pos]

    def call(values, local_out=None):
        new = list(leaves)
        for i, v in zip(tensor_pos, values):
            new[i] = v
        a, k = pytree.tree_unflatten(new, spec)
        a = tuple(a) if local_out is None else localize_args(target, tuple(a), local_out)
        return target(*a, **k)

    full_out = pytree.tree_leaves(call(full_ins))
    per_rank = [[] for _ in range(n)]
    for value, layout in zip(full_ins, strategy.ins):
        for r, piece in enumerate(_split(value.detach(), layout[0], n, gen)):
            per_rank[r].append(piece.clone().requires_grad_(value.requires_grad))
    local_out = local_shape(op.out[0].shape, strategy.out, (n,))
    outs = [pytree.tree_leaves(call(per_rank[r], local_out)) for r in range(n)]
    for i, expected in enumerate(full_out):
        got = _combine([o[i] for o in outs], strategy.out[0])
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)

    diff = [i for i, o in enumerate(full_out) if o.requires_grad]
    if not diff:
        return
    grads = [torch.randn(full_out[i].shape, generator=gen, dtype=full_out[i].dtype) for i in diff]
    torch.autograd.backward([full_out[i] for i in diff], grads)
    grad_layout = strategy.out[0]
    for r in range(n):
        local_grads = [_split_grad(g, grad_layout, n)[r] for g in grads]
        torch.autograd.backward([outs[r][i] for i in diff], local_grads)
    for j, value in enumerate(full_ins):
        if not value.requires_grad or value.grad is None:
            continue
        layout = strategy.ins[j][0]
        pieces = [per_rank[r][j].grad if per_rank[r][j].grad is not None else torch.zeros_like(per_rank[r][j])
                  for r in range(n)]
        if isinstance(layout, Shard):
            got = torch.cat(pieces, dim=layout.dim)
        elif isinstance(layout, Replicate) and 0 in strategy.grad_allreduce_axes(j):
            got = sum(pieces)
        else:  # a replicated gradient: of an R input whose op is replicated, or of a P input
            got = _combine(pieces, Replicate())
        torch.testing.assert_close(got, value.grad, atol=1e-9, rtol=1e-9)


def _split_grad(grad, placement, n):
    """The gradient each rank receives for an output of this placement (P's gradient is R)."""
    if isinstance(placement, Shard):
        return list(grad.chunk(n, dim=placement.dim))
    return [grad] * n
