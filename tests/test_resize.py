"""A graph at a new batch size read off two captures at other sizes (`autotp.graph.resize`) is the capture's.

For every transformers family of the examples, and the GPT test model, each
with its loss: captures at batches 8 and 4 give the graph at 2 that a
capture at 2 gives, op for op (shapes, arguments, FLOPs, bytes, what
backward keeps) and edge for edge; the loss's own saved bytes differ with
the batch, so that path is checked too. A graph with a number that is not
proportional to the batch (``batch + 1`` rows), or ops that only one size
traces, is refused (and the search then captures that size for real), as is
a batch of one sample. `autotp.plan` reads the
third and later micro-batch counts off the first two and finds the plan each
count gives when captured alone.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import autotp
import hf_models
from autotp.api import capture_model
from autotp.capture.micro import micro_batch
from autotp.graph.resize import NotProportional, derivable, resized
from autotp.progress import Stages
from models import GPT


def _doubled(args, kwargs):
    """The example inputs at twice their batch (every tensor whose dim 0 is the batch, stacked twice)."""
    batch = args[0].shape[0]
    grow = lambda t: torch.cat([t, t]) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t  # noqa: E731
    return tuple(grow(a) for a in args), {k: grow(v) for k, v in kwargs.items()}


def _gpt():
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (4, 8))
    return GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8), (idx,), {"targets": idx}


MODELS = {**{name: (lambda name=name: hf_models.build(name)) for name in [*hf_models.FAMILIES, *hf_models.MORE]},
          "gpt": _gpt}


def _graphs(model, args, kwargs, counts):
    out = {}
    for k in counts:
        a, kw = micro_batch(args, kwargs, k)
        out[a[0].shape[0]] = capture_model(model, a, kw).graph
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_graph_read_off_two_batches_is_the_one_captured_at_the_third(name):
    model, args, kwargs = MODELS[name]()
    args, kwargs = _doubled(args, kwargs)  # batch 8: micro-batches of 8, 4 and 2
    graphs = _graphs(model, args, kwargs, (1, 2, 4))
    first = graphs[8].nodes()
    derived = resized(graphs[8], 8, graphs[4], 4, 2)
    assert derived.order == graphs[2].order and derived.outputs == graphs[2].outputs
    assert set(derived.graph.edges(data="inputs")) == set(graphs[2].graph.edges(data="inputs"))
    differs = [a.name for a, b in zip(derived.nodes(), graphs[2].nodes()) if a != b]
    assert not differs, differs[:5]
    # the batch really changed the graph, and the copy is new (the first capture keeps its own ops)
    assert derived.nodes() != first and all(a is b for a, b in zip(graphs[8].nodes(), first))
    if name in ("llama", "mistral", "gpt"):  # a causal LM's cross-entropy keeps log-probabilities and a scalar
        assert any(a.saved_extra != b.saved_extra for a, b in zip(graphs[8].nodes(), graphs[4].nodes()))


class _PlusOne(nn.Module):
    """A row more than the batch: ``batch + 1`` is not proportional to it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.cat([x, x[:1]])).sum()


class _Branchy(nn.Module):
    """An op only batches above 4 trace."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return (y.relu() if x.shape[0] > 4 else y).sum()


@pytest.mark.parametrize("module, match", [(_PlusOne, "9 at batch 8 and 5 at batch 4"),
                                           (_Branchy, "different ops")])
def test_a_graph_not_proportional_to_the_batch_is_refused(module, match):
    x = torch.randn(8, 4)
    graphs = _graphs(module(), (x,), {}, (1, 2))
    with pytest.raises(NotProportional, match=match):
        resized(graphs[8], 8, graphs[4], 4, 2)


def test_a_batch_of_one_sample_is_never_read_off():
    assert not derivable(1) and derivable(2)
    model, args, kwargs = _gpt()
    graphs = _graphs(model, args, kwargs, (1, 2))
    with pytest.raises(NotProportional, match="need two sizes above one"):
        resized(graphs[4], 4, graphs[2], 2, 1)


def test_a_count_of_one_captures_its_own_copy_of_aliased_inputs():
    ids = torch.randint(0, 8, (4, 3))
    (a,), kwargs = micro_batch((ids,), {"labels": ids}, 1)
    assert a is not kwargs["labels"] and a is not ids and torch.equal(a, ids) and torch.equal(kwargs["labels"], ids)
    (b,), _ = micro_batch((ids,), {"labels": ids}, 1, leaves=False)
    assert b is ids  # the training step's own pieces are the caller's tensors


def test_the_micro_batch_search_reads_counts_off_and_finds_each_counts_plan():
    """The search reads counts off two captures and finds the fastest plan of all; a count read off plans
    exactly as its own capture does (searched alike: the search hands most counts a plan to beat, and of two
    plans equally fast the one a search finds first depends on it)."""
    from autotp.api import _Captures, plan_captured

    torch.manual_seed(0)
    model = GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8)
    inputs = (torch.randint(0, 64, (16, 8)), torch.randint(0, 64, (16, 8)))
    mesh = autotp.Mesh("4", links="nvlink")
    free = autotp.plan(model, mesh, inputs, profile="h100-hgx")
    limit = int(free.memory["total"] * 0.15)
    stream = io.StringIO()
    searched = autotp.plan(model, mesh, inputs, profile="h100-hgx", memory_limit=limit,
                           progress=Stages(stream=stream))
    assert "read off batches" in stream.getvalue(), stream.getvalue()
    k = searched.micro_batches
    alone = autotp.plan(model, mesh, inputs, profile="h100-hgx", micro_batches=k, memory_limit=limit)
    assert searched.predicted["total_s"] == pytest.approx(alone.predicted["total_s"], rel=1e-9)
    captures = _Captures(model, inputs, {}, True, Stages(enabled=False))
    captures.at(1), captures.at(2)  # batches 16 and 8, for real
    for k in (searched.micro_batches, 8):  # read off them, each plans as its own capture does
        assert captures.at(k).graph.nodes() != captures.at(1).graph.nodes()
        off = plan_captured(captures.at(k), mesh, profile="h100-hgx", micro_batches=k, memory_limit=limit)
        alone = autotp.plan(model, mesh, inputs, profile="h100-hgx", micro_batches=k, memory_limit=limit)
        assert off.predicted == alone.predicted, k
        assert (off.parameters, off.nodes, off.memory) == (alone.parameters, alone.nodes, alone.memory), k


def test_the_search_captures_for_real_what_it_cannot_read_off():
    from autotp.api import _Captures

    x = torch.randn(8, 4)
    model = _PlusOne()
    stream = io.StringIO()
    captures = _Captures(model, (x,), {}, True, Stages(stream=stream))
    got = {k: captures.at(k).graph for k in (1, 2, 4)}  # the third is refused, and captured
    assert "not read off batches 8 and 4 (9 at batch 8 and 5 at batch 4)" in stream.getvalue()
    assert got[4].nodes() == _graphs(model, (x,), {}, (4,))[2].nodes()
    assert captures.at(8).graph.nodes() == _graphs(model, (x,), {}, (8,))[1].nodes()  # one sample: always captured
