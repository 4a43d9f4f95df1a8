"""Memory per device as a constraint: a limit changes the plan, and an impossible one says why."""

from __future__ import annotations

import re

import pytest
import torch

import autotp
from autotp.errors import MemoryLimitError
from autotp.graph.opgraph import KIND_PARAM
from autotp.interop import pins_from_styles
from autotp.model_spec import ModelSpec, build
from autotp.report.baselines import megatron_styles, sequence_parallel_only
from autotp.solve.constraints import same_as
from autotp.units import parse_bytes
from models import MLP


def _mlp():
    with torch.device("meta"):
        model = MLP(4096, 16384)
    return model, (torch.empty(1, 8, 4096, device="meta"),)  # 8 tokens: weights dominate memory


def test_limit_forces_a_smaller_plan():
    """Over slow Ethernet a small MLP is fastest replicated; a memory limit makes it split its weights."""
    with torch.device("meta"):
        model = MLP(1024, 4096)
    inputs, mesh = (torch.empty(1, 8, 1024, device="meta"),), autotp.Mesh("2", links="ethernet")
    free = autotp.plan(model, mesh, inputs, profile="ethernet-2node")
    assert all(p == ("R",) for p in free.parameters.values())
    limit = free.memory["total"] * 0.6
    bounded = autotp.plan(model, mesh, inputs, profile="ethernet-2node", memory_limit=limit)
    assert bounded.memory["total"] <= limit < free.memory["total"]
    assert bounded.predicted["objective_s"] > free.predicted["objective_s"]
    assert bounded.parameters["fc1.weight"] != ("R",)
    assert set(bounded.memory) >= {"parameters", "gradients", "optimizer", "activations", "total"}


def test_a_limit_one_byte_under_the_fastest_plan_is_met_to_the_byte():
    """The solver meets its memory row only to its tolerances (a binary 1e-6 off its integer is many bytes of a
    large choice): the plan's exact bytes are checked and the row tightened until they fit, never refused.

    A Llama under Megatron's split and sequence parallelism, recomputation offered: with the limit one byte
    under the fastest plan, tightening the row by the excess alone left the same plan four times over, and
    the plan refused with "no plan fits", though recomputing every layer fits a quarter under it."""
    spec = ModelSpec("hf:llama", {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                                  "intermediate_size": 688, "vocab_size": 1024}, batch=8, seq=128)
    model, args, kwargs = build(spec, meta=True)
    mesh = autotp.Mesh("2x2")
    options = dict(pin=pins_from_styles(model, megatron_styles(model), mesh.ndim), micro_batches=1,
                   optimizer_sharding=False, regather=False, allow=sequence_parallel_only(256, 1))
    free = autotp.plan(model, mesh, args, kwargs, memory_limit=None, **options)
    layouts = same_as(free)  # its ops' layouts kept, the parameters' state whole: recomputation is what is left

    def allow(op, strategy) -> bool:
        return not strategy.optimizer_axes if op.kind == KIND_PARAM else layouts(op, strategy)

    allow.strict = True
    limit = free.memory["total"] - 1
    bounded = autotp.plan(model, mesh, args, kwargs, memory_limit=limit, **(options | dict(allow=allow)))
    assert bounded.memory["total"] <= limit and bounded.recompute
    assert bounded.predicted["total_s"] >= free.predicted["total_s"]


def test_impossible_limit_names_the_least_memory_and_its_largest_term():
    model, inputs = _mlp()
    with pytest.raises(MemoryLimitError) as info:
        autotp.plan(model, autotp.Mesh("4"), inputs, memory_limit="100MB")
    message = str(info.value)
    assert "no plan fits 95.4 MiB per device" in message
    smallest = re.search(r"the smallest any plan reaches is ([\d.]+) MiB, of which (\w+)", message)
    assert smallest and smallest.group(2) == "optimizer"  # Adam's two fp32 moments dominate a sharded MLP
    # 2 x 4096 x 16384 fp32 weights split 4 ways, with gradients and Adam: 4 x 128 MiB at the very least
    assert float(smallest.group(1)) >= 4 * 128


def test_sizes():
    assert parse_bytes("80GB") == 80 * 10 ** 9 and parse_bytes("64MiB") == 64 * 2 ** 20 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="80GB"):
        parse_bytes("lots")
    for nothing in (-1, 0):  # `plan(memory_limit=-1)` fails at once, not after its capture
        with pytest.raises(ValueError, match="must be a positive number of bytes"):
            parse_bytes(nothing)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_gathered_weight_kept_for_backward_counts_and_the_ilp_counts_it_alike(micro_batches):
    """Stored split, used whole by a data-parallel matmul whose input needs a gradient: the all-gathered copy lives
    until backward (one copy, however many micro-batches: each one's backward frees its own). The first
    matmul's input needs none, so its backward never reads its weight, and a gathered copy of it is freed at
    once."""
    from autotp.graph.opgraph import KIND_PARAM
    from autotp.solve.constraints import data_parallel_only

    torch.manual_seed(0)
    model, inputs = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)), (
        torch.randn(8, 16),)
    mesh = autotp.Mesh("2", links="nvlink")
    options = dict(profile="h100-hgx", optimizer_sharding=False, recompute=False, micro_batches=micro_batches,
                   allow=lambda op, s: op.kind == KIND_PARAM or data_parallel_only(op, s))
    whole = autotp.plan(model, mesh, inputs, pin={"2.weight": ("R",)}, **options)
    split = autotp.plan(model, mesh, inputs, pin={"2.weight": ("S(0)",)}, **options)
    assert [(c["kind"], c["bytes"]) for c in split.collectives if c["phase"] == "forward"] == [("all_gather", 1024)], \
        split.collectives
    assert split.memory["activations"] - whole.memory["activations"] == 8 * 32 * 4  # the whole fp32 weight
    first = autotp.plan(model, mesh, inputs, pin={"0.weight": ("S(0)",), "2.weight": ("R",)}, **options)
    assert [c["kind"] for c in first.collectives if c["phase"] == "forward"] == ["all_gather"]
    assert first.memory["activations"] == whole.memory["activations"]
    # the ILP's memory row is the report's: the plan fits a limit of exactly its memory, and any plan made
    # under a tighter one (another split of the activations) reports no more than it
    assert autotp.plan(model, mesh, inputs, pin={"2.weight": ("S(0)",)}, memory_limit=split.memory["total"],
                       **options).memory == split.memory
    for limit in (split.memory["total"] - 1, split.memory["total"] - 1024):
        try:
            tighter = autotp.plan(model, mesh, inputs, pin={"2.weight": ("S(0)",)}, memory_limit=limit, **options)
        except MemoryLimitError:
            continue
        assert tighter.memory["total"] <= limit
