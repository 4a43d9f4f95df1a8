"""Regathered inputs: backward gathers again, from the shard, what an all-gather returned, instead of keeping it.

A plan with ``plan.regather`` (`autotp.solve.regather`) keeps, of an
all-gathered input that an op's backward reads, only the shard; backward
gathers it again when it needs it. Megatron-LM's sequence parallelism does
so for a column-parallel matmul's input, FSDP's reshard after forward for a
parameter stored split (ZeRO-3). The rank module runs its forward under
`torch.autograd.graph.saved_tensors_hooks`:

* a regathering collective (``Collective(..., regather=True)``, and any
  collective step after it on the same tensor) tags what it returns with a
  `Regathered`: its input and how to run it again;
* when autograd saves a tagged tensor, or a view of one, the pack hook
  keeps the `Regathered` and the view's geometry instead;
* when backward unpacks it, the collective runs again (without autograd) and
  the view is taken anew. Every saved use of one gathered tensor shares one
  rebuild, as the cost model counts one per redistribution.

A collective matmul whose matmuls are the gathered tensor's only readers
saves the shard itself and gathers it again in the ring of its backward
(`autotp.lower.collective_matmul`), behind the matmuls' backward.

Every rank saves and unpacks the same tensors in the same order (the same
program), so the gathers in backward match across ranks. Inside a
recomputed layer the checkpoint's own hooks take over: `recompute_layers`
puts the regathering collectives into the checkpointed stretch of the ops
that read them, so the checkpoint keeps the shard and its recomputation
gathers again (`regathering_nodes`).

Under ``torch.compile`` regathering does nothing: saved-tensor hooks and
attributes set on tensors do not trace, so while the module is compiled its
regathering collectives neither tag nor hook, and autograd saves the
gathered tensors as the compiler's partitioner decides. The values are the
same and the module compiles whole (``fullgraph=True``); what the plan counts
as freed by regathering is held. Eager runs regather as planned.
"""

from __future__ import annotations

import torch
from torch import fx

_TAG = "_autotp_regathered"  # the attribute a regathering collective sets on what it returns


class Regathered:
    """How to rebuild one gathered tensor: its source (a shard, or the `Regathered` it came from) and the
    collective module that made it. The rebuild is kept while any saved use still holds this record."""

    __slots__ = ("source", "module", "full")

    def __init__(self, source, module):
        self.source, self.module, self.full = source, module, None

    def rebuild(self) -> torch.Tensor:
        if self.full is None:
            x = self.source.rebuild() if isinstance(self.source, Regathered) else self.source
            with torch.no_grad():
                self.full = self.module.run(x)
        return self.full


def tag(out: torch.Tensor, x: torch.Tensor, module) -> torch.Tensor:
    """Mark ``out`` (``module`` applied to ``x``) as rebuildable from ``x``, or from ``x``'s own record (not while
    ``torch.compile`` traces the module: see the module's docstring)."""
    if not torch.compiler.is_compiling():
        setattr(out, _TAG, Regathered(getattr(x, _TAG, None) or x.detach(), module))
    return out


def tagged(x: torch.Tensor) -> bool:
    return getattr(x, _TAG, None) is not None


def _pack(t: torch.Tensor):
    base = t if t._base is None else t._base
    record = getattr(base, _TAG, None)
    if record is None:
        return t
    return record, t.size(), t.stride(), t.storage_offset()


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    record, size, stride, offset = packed
    return record.rebuild().as_strided(size, stride, offset)


def _enter(module, args) -> None:
    if torch.compiler.is_compiling():
        return  # saved-tensor hooks do not trace: compiled, the module saves what it gathered (module docstring)
    hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
    hooks.__enter__()
    module.__dict__.setdefault("_autotp_saved_hooks", []).append(hooks)


def _leave(module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    module.__dict__["_autotp_saved_hooks"].pop().__exit__(None, None, None)


def install_regather_hooks(gm: torch.nn.Module) -> None:
    """Run ``gm``'s forward under the hooks that save regathered tensors as shards (also when it raises)."""
    gm.register_forward_pre_hook(_enter)
    gm.register_forward_hook(_leave, always_call=True)


def regathering_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The collective calls whose outputs are tagged: a regathering one, and each step after it, in order."""
    from autotp.lower.collectives import Collective

    out: dict[fx.Node, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, Collective) and (module.regather or (node.args and node.args[0] in out)):
            out[node] = None
    return list(out)
