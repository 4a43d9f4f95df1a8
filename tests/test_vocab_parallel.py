"""Vocabulary-parallel embedding and loss: exact, and the logits are never gathered for the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autotp
from autotp.lower.impls import VocabParallelEmbedding
from autotp.runtime import spawn
from autotp.runtime.verify import max_errors
from models import GPT


def test_embedding_rows_sum_to_the_full_lookup():
    torch.manual_seed(0)
    weight, idx = torch.randn(12, 5), torch.randint(0, 12, (3, 4))
    pieces = [VocabParallelEmbedding(start=r * 3, rows=3)(weight[r * 3:(r + 1) * 3], idx) for r in range(4)]
    torch.testing.assert_close(sum(pieces), F.embedding(idx, weight))


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=64, hidden=32, heads=4, layers=1, seq=8), (torch.randint(0, 64, (2, 8)),
                                                                torch.randint(0, 64, (2, 8)))


def _vocab_only(op, strategy) -> bool:
    """Embeddings and the loss must use their vocabulary-parallel implementation; the rest is free."""
    if op.op_name in ("embedding.default", "cross_entropy_loss.default"):
        return strategy.impl == "vocab_parallel"
    return True


def _vocab_plan(mesh):
    model, inputs = _gpt()
    tp = mesh.ndim - 1
    pins = {"head.weight": tuple("S(0)" if a == tp else "R" for a in range(mesh.ndim))}
    return autotp.plan(model, mesh, inputs, pin=pins, allow=_vocab_only)


def _errors(rank, world, plan):
    model, inputs = _gpt()
    return max_errors(model, plan, inputs, rank)


def test_vocab_parallel_gpt_is_exact_without_gathering_logits():
    for shape in ("4", "2x2"):
        mesh = autotp.Mesh(shape)
        plan = _vocab_plan(mesh)
        embedding = next(n for n in plan.nodes.values() if n.op == "embedding.default" and n.impl)
        loss = next(n for n in plan.nodes.values() if n.op == "cross_entropy_loss.default")
        assert embedding.impl == "vocab_parallel" and loss.impl == "vocab_parallel", plan.summary()
        vocab_bytes = 2 * 8 * 64 * 4
        assert not [c for c in plan.forward_collectives() if c["kind"] == "all_gather" and c["bytes"] >= vocab_bytes]
        for errors in spawn(_errors, mesh.size, plan):
            assert errors["output"] <= 1e-5 and errors["gradient"] <= 1e-5, errors
