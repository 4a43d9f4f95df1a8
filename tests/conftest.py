"""Shared fixtures: the test models' import path and a profile in which compute dominates.

The "compute-bound" profile makes any split that divides work worth its
collectives, so the ILP's own plan for the small test models shards heavily
and exercises the lowering, rather than replicating everything as a real
GPU profile would for models this small.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))  # models.py: the MLP and GPT of the examples

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def compute_bound_profile() -> dict:
    curve = [[1, 1e14], [1e12, 1e14]]
    return {
        "schema_version": 1, "name": "compute-bound", "description": "slow device, near-free links (tests only)",
        "device": {"name": "test", "peak_flops": {"float32": 1e9}, "matmul_efficiency": 1.0,
                   "memory_bandwidth_Bps": 1e12, "memory_efficiency": 1.0, "memory_bytes": 1e12,
                   "launch_overhead_s": 0.0, "backward_compute_factor": 2.0, "sources": {}},
        "links": {link: {"latency_s": 1e-9, "busbw_Bps": {c: curve for c in COLLECTIVES}, "source": "test"}
                  for link in ("nvlink", "ethernet")},
    }


def weights_bound_profile() -> dict:
    """The compute-bound profile with a faster device and slow links: data parallelism's gradient sums then cost
    more than the activations tensor parallelism moves, so the small test models split their weights (mesh 2)."""
    profile = compute_bound_profile()
    profile["name"] = "weights-bound"
    profile["device"]["peak_flops"]["float32"] = 4e9
    for link in profile["links"].values():
        link["busbw_Bps"] = {c: [[1, 1e8], [1e12, 1e8]] for c in COLLECTIVES}
    return profile


@pytest.fixture
def compute_bound():
    return compute_bound_profile()
