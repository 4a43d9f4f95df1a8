"""An inference plan's memory peaks at its largest working set beside its state (`autotp.solve.working`): counted
as the closed form says, bounded by the memory limit, and split to fit where the limit binds on it."""

import pytest
import torch

import autotp
from autotp.errors import MemoryLimitError
from conftest import weights_bound_profile

BATCH, IN, OUT = 64, 32, 128


class Projection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(IN, OUT, bias=False)

    def forward(self, x):
        return self.fc(x)


def slow_links() -> dict:
    """Links whose every message costs 10 ms: no split pays for its time, so only memory makes one."""
    profile = weights_bound_profile()
    for link in profile["links"].values():
        link["latency_s"] = 1e-2
    return profile


def _plan(mesh, **options):
    torch.manual_seed(0)
    return autotp.plan(Projection(), mesh, (torch.randn(BATCH, IN),), training=False, whole_outputs=True,
                       profile=slow_links(), **options)


def test_the_working_set_is_the_largest_ops_inputs_and_outputs():
    plan = _plan(1)
    assert plan.memory["parameters"] == IN * OUT * 4
    assert plan.memory["activations"] == (BATCH * IN + BATCH * OUT) * 4  # x and y; the weight is state
    assert plan.memory["total"] == plan.memory["parameters"] + plan.memory["activations"]


def test_a_limit_on_the_working_set_splits_the_batch_to_fit():
    free = _plan(2)
    assert all(node.out == ("R",) for node in free.nodes.values())  # nothing pays on these links
    limit = free.memory["parameters"] + 30_000  # the whole working set is 40,960 bytes, half of it 20,480
    bound = _plan(2, memory_limit=limit)
    assert bound.nodes["linear"].out == ("S(0)",) and bound.memory["activations"] == free.memory["activations"] // 2
    assert bound.memory["total"] <= limit < free.memory["total"]
    assert bound.predicted["total_s"] > free.predicted["total_s"]  # it pays the all-gather to fit
    with pytest.raises(MemoryLimitError):
        _plan(2, memory_limit=free.memory["parameters"] + 10_000)
