"""`Plan`: the chosen placement of every parameter and op, its predicted cost, and its JSON form.

The JSON is canonical (sorted keys, fixed float formatting, no timings), so the
same inputs give byte-identical files across runs and processes. Wall-clock
facts such as solve time live in ``plan.stats`` and are not saved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from autotp.errors import PlanError
from autotp.fileio import atomic_write_text
from autotp.mesh import Mesh
from autotp.placement import parse_layout

PLAN_VERSION = 10  # 10: ``buffers`` (split buffers: a key/value cache); 9: ZeRO-2 gradients summed every micro-batch (``each_micro_batch``); 8 added ``runtime["overlap_tp"]``; 7 ``regather``; 6 ``gradient_sharding``; 5 ``optimizer_sharding``, ``recompute`` and ``micro_batches``; 4 ``runtime`` and ``io``; 3 ``source`` and ``scopes``
READABLE_VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9, 10)
# what plans made before version 4 mean: every output whole, gradient sums run where they are used
LEGACY_RUNTIME = {"overlap_gradients": False, "bucket_bytes": 25 * 2**20, "whole_outputs": True}


@dataclass
class NodePlan:
    """The strategy of one fx node: its output layout and the layout each tensor input arrives in."""

    op: str
    out: tuple[str, ...]
    ins: tuple[tuple[str, ...], ...]
    impl: str | None = None  # a local implementation other than the op itself, e.g. "vocab_parallel"

    def out_layout(self):
        return parse_layout(self.out)

    def in_layouts(self):
        return tuple(parse_layout(layout) for layout in self.ins)


@dataclass
class Plan:
    """A sharding plan for one model on one mesh (see docs/concepts.md)."""

    mesh: Mesh
    profile: str
    training: bool
    parameters: dict[str, tuple[str, ...]]
    nodes: dict[str, NodePlan]
    fallback_ops: dict[str, str]
    collectives: list[dict]
    predicted: dict[str, float]
    memory: dict[str, int]
    inputs: dict  # {"args": [spec], "kwargs": {name: spec}}: shapes and dtypes, to re-capture
    ilp: dict[str, int]
    stats: dict = field(default_factory=dict, compare=False)
    source: dict | None = None  # how to rebuild the model, e.g. {"model": "hf:llama", "config": {...}}
    scopes: dict[str, str] = field(default_factory=dict)  # fx node -> module path, to fold identical layers
    # how the rank program runs, as the cost model priced it: gradient overlap, bucket size, outputs whole or not
    runtime: dict = field(default_factory=lambda: dict(LEGACY_RUNTIME))
    # {"inputs": [[placeholder, layout a rank may be given], ...], "outputs": [layout each output comes back in]}
    io: dict = field(default_factory=dict)
    # parameter -> the mesh axes (names) its optimizer state is split on (ZeRO-1); `autotp.runtime.shard_optimizer`
    optimizer_sharding: dict[str, list[str]] = field(default_factory=dict)
    # parameters whose gradient is reduce-scattered into those slices as well (ZeRO-2), a subset of the above
    gradient_sharding: list[str] = field(default_factory=list)
    # the layers (module paths) recomputed in backward; `autotp.lower.recompute` checkpoints them
    recompute: list[str] = field(default_factory=list)
    # a step runs this many micro-batches of ``inputs`` (the example batch / k), gradients summed once
    micro_batches: int = 1
    # the kinds of all-gathered inputs ("weights", "activations") kept as shards and gathered again in backward
    regather: list[str] = field(default_factory=list)
    # buffer -> its layout, for the buffers the plan splits (a key/value cache by kv-head); the others are whole
    buffers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "version": PLAN_VERSION, "mesh": self.mesh.to_dict(), "profile": self.profile,
            "training": self.training,
            "parameters": {k: list(v) for k, v in self.parameters.items()},
            "nodes": {k: _node_dict(n) for k, n in self.nodes.items()},
            "fallback_ops": dict(self.fallback_ops), "collectives": self.collectives,
            "predicted": {k: _round(v) for k, v in self.predicted.items()}, "memory": self.memory,
            "inputs": self.inputs, "ilp": self.ilp, "source": self.source, "scopes": dict(self.scopes),
            "runtime": dict(self.runtime), "io": self.io,
            "optimizer_sharding": {k: list(v) for k, v in self.optimizer_sharding.items()},
            "gradient_sharding": list(self.gradient_sharding),
            "recompute": list(self.recompute), "micro_batches": self.micro_batches,
            "regather": list(self.regather), "buffers": {k: list(v) for k, v in self.buffers.items()},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    def save(self, path) -> None:
        atomic_write_text(path, self.to_json())  # a reader never sees half a plan

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("version") not in READABLE_VERSIONS:
            raise PlanError(f"plan version {d.get('version')!r} is not supported (expected one of "
                            f"{READABLE_VERSIONS}); re-plan")
        return cls(
            mesh=Mesh.from_dict(d["mesh"]), profile=d["profile"], training=d["training"],
            parameters={k: tuple(v) for k, v in d["parameters"].items()},
            nodes={k: NodePlan(n["op"], tuple(n["out"]), tuple(tuple(i) for i in n["ins"]), n.get("impl"))
                   for k, n in d["nodes"].items()},
            fallback_ops=dict(d["fallback_ops"]), collectives=list(d["collectives"]),
            predicted=dict(d["predicted"]), memory=dict(d["memory"]), inputs=dict(d["inputs"]), ilp=dict(d["ilp"]),
            source=d.get("source"), scopes=dict(d.get("scopes") or {}),
            runtime={**LEGACY_RUNTIME, **(d.get("runtime") or {})}, io=dict(d.get("io") or {}),
            optimizer_sharding={k: list(v) for k, v in (d.get("optimizer_sharding") or {}).items()},
            gradient_sharding=list(d.get("gradient_sharding") or []),
            recompute=list(d.get("recompute") or []), micro_batches=int(d.get("micro_batches", 1)),
            regather=list(d.get("regather") or []),
            buffers={k: tuple(v) for k, v in (d.get("buffers") or {}).items()},
        )

    @classmethod
    def load(cls, path) -> "Plan":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"cannot read plan {path}: {exc}") from exc
        return cls.from_dict(data)

    def forward_collectives(self) -> list[dict]:
        return [c for c in self.collectives if c["phase"] == "forward"]

    def summary(self) -> str:
        from autotp.solve.summary import format_summary

        return format_summary(self)


def _node_dict(n: NodePlan) -> dict:
    d = {"op": n.op, "out": list(n.out), "ins": [list(i) for i in n.ins]}
    if n.impl:
        d["impl"] = n.impl
    return d


def _round(x: float) -> float:
    """Floats rounded to 12 significant digits so the JSON does not depend on summation order noise."""
    return float(f"{x:.12g}")
