"""Memory per device, by term: parameters, gradients, optimizer state, buffers and saved activations.

Counted on local shapes. Activations are what autograd keeps for the
backward pass (`autotp.graph.saved`, found by running each op on the meta
device under saved-tensor hooks): the outputs of differentiated ops that
their own backward or a consumer's reads, and tensors an op saves of its own
(a dropout mask), in the dtypes the model computes in. What leaves a layer
for the next counts whether or not a backward reads it, and so does the sum
of a partial result, in its target layout, on its use (`kept_use_bytes`):
a recomputed layer's checkpoint keeps both (`autotp.solve.recompute`).
A trained parameter's state follows the training ``precision``, in bytes per
element of the parameter (Adam's two moments in the optimizer term):

============  ========  =========  =========================================
precision     weight    gradient   optimizer state
============  ========  =========  =========================================
``fp32``      4         4          8: two fp32 moments
``mixed``     2         4          12: fp32 master weight and two moments
``bf16``      2         2          4: two bf16 moments
============  ========  =========  =========================================

``mixed`` is Megatron-LM's 18 bytes per parameter (bf16 weights, fp32 main
gradients, fp32 master weights and moments). ``auto`` reads each
parameter's dtype: ``mixed`` for a 16-bit one, which is how such models are
trained, and for a wider one the weight, gradient and two moments in its
own dtype (``fp32`` for fp32). With the optimizer state split over
mesh axes (ZeRO-1, ``Strategy.optimizer_axes``) each device keeps its slice
of it, rounded up to a whole element. With the gradient reduce-scattered
into that slice as well (ZeRO-2, ``Strategy.gradient_split``) so is the
gradient: with several micro-batches a step, such a gradient is
reduce-scattered after each one's backward and its slices accumulate
(`autotp.lower.reducer`, as DeepSpeed's ZeRO-2), while the others
accumulate whole until the last one's sum.
"""

from __future__ import annotations

import math

from autotp.errors import PlanError
from autotp.graph.flops import is_alias
from autotp.graph.opgraph import KIND_OP, KIND_PARAM, KIND_BUFFER
from autotp.graph.signature import layer_path
from autotp.placement import Partial, local_bytes
from autotp.strategies.inplace import writes_in_place

TERMS = ("parameters", "gradients", "optimizer", "buffers", "activations")
# bytes per parameter element: weight, gradient, optimizer state
PRECISIONS = {"fp32": (4, 4, 8), "mixed": (2, 4, 12), "bf16": (2, 2, 4)}
AUTO = "auto"


def check_precision(precision: str) -> str:
    """``precision`` itself, or a `PlanError` naming the ones there are."""
    if precision != AUTO and precision not in PRECISIONS:
        raise PlanError(f"unknown training precision {precision!r}: use one of {', '.join((AUTO, *PRECISIONS))}")
    return precision


def state_bytes(itemsize: int, precision: str = AUTO) -> tuple[int, int, int]:
    """``(weight, gradient, optimizer)`` bytes per element of a trained parameter of ``itemsize`` bytes."""
    if precision != AUTO:
        return PRECISIONS[precision]
    return (itemsize, itemsize, 2 * itemsize) if itemsize >= 4 else PRECISIONS["mixed"]


def node_memory_bytes(op, strategy, mesh, training: bool, precision: str = AUTO) -> dict[str, int]:
    """Bytes one node keeps on each device under ``strategy``, by term (only the terms it has)."""
    layout = strategy.out
    if op.kind == KIND_PARAM:
        local = local_bytes(op.out[0], layout, mesh.shape)
        if not (training and op.requires_grad):
            return {"parameters": local}
        numel = local // op.out[0].dtype.itemsize
        weight, gradient, optimizer = state_bytes(op.out[0].dtype.itemsize, precision)
        split = math.prod(mesh.shape[a] for a in strategy.optimizer_axes)
        return {"parameters": weight * numel,
                "gradients": gradient * (-(-numel // split) if strategy.gradient_split else numel),
                "optimizer": optimizer * -(-numel // split)}
    if op.kind == KIND_BUFFER:
        return {"buffers": local_bytes(op.out[0], layout, mesh.shape)}
    if op.kind == KIND_OP and training and op.requires_grad and not is_alias(op.target):
        out = sum(local_bytes(m, layout, mesh.shape) for m in op.out)
        kept = op.keeps_output and not _partial(layout, mesh.shape)  # a sum's result counts on its use instead
        extra = 0
        if op.saved_extra:  # scaled to the largest local tensor, as `autotp.graph.saved` measured it
            largest = max([out] + [local_bytes(m, lay, mesh.shape) for m, lay in zip(op.in_metas, strategy.ins)])
            extra = math.ceil(largest * op.saved_extra)
        return {"activations": int(out * kept + extra)}
    return {}


def kept_input_bytes(op, i: int, layout, mesh, training: bool, checkpointed: bool = False) -> int:
    """Bytes of input ``i`` of ``op``, in ``layout``, that autograd keeps for the backward pass, or 0.

    Counted where the input arrives through an all-gather (a buffer of its
    own, as a parameter gathered over the data-parallel axis): an op's own
    outputs are counted as its activations, and a local slice is a view.
    Kept when the op's backward reads it, and when the op's layer may be
    recomputed (``checkpointed``): the checkpointed stretch that starts with
    the op then saves what the all-gather returned (`autotp.lower.recompute`).
    """
    meta = op.in_metas[i]
    if not (training and op.requires_grad and meta.is_float) or not (i in op.saves_inputs or checkpointed):
        return 0
    return local_bytes(meta, layout, mesh.shape)


def kept_use_bytes(producer, consumer, i: int, src, dst, meta, mesh, training: bool, gathered: bool,
                   recomputable=frozenset()) -> int:
    """Bytes a redistribution of ``producer``'s output for input ``i`` of ``consumer`` leaves alive until backward.

    A sum of partial results (an all-reduce or reduce-scatter) returns the
    tensor every use of the sum reads: counted in its target layout, for the
    partial sum itself is not (`node_memory_bytes`) and a recomputed layer's
    checkpoint saves the sum (`autotp.solve.recompute`); a partial sum taken
    as it is (``mul(P, R) -> P``) counts where the consumer's backward reads
    it. An all-gathered
    input counts where the consumer's backward reads it or the consumer's
    layer is among the ``recomputable`` ones (`kept_input_bytes`).
    """
    if not training or consumer is None:
        return 0
    if producer.requires_grad and _partial(src, mesh.shape):  # the partial sum counts here, not on its producer
        if _sums(src, dst, mesh.shape) or (i in consumer.saves_inputs and consumer.requires_grad):
            return local_bytes(meta, dst, mesh.shape)
    if not gathered:
        return 0
    return kept_input_bytes(consumer, i, dst, mesh, training, layer_path(consumer) in recomputable)


def use_traits(producer, consumer, i: int, recomputable=frozenset()) -> tuple:
    """All that `kept_use_bytes` and `regather_saving` read of a use's two ops (``consumer`` None: an output),
    beside the layouts, the tensor and whether it is gathered: uses alike in these keep and free alike, so a
    costing prices each such use once (`autotp.solve.problem`)."""
    made = (producer.requires_grad, producer.kind == KIND_PARAM or producer.keeps_output)
    if consumer is None:
        return made
    return (*made, i in consumer.saves_inputs, consumer.requires_grad, layer_path(consumer) in recomputable)


def regather_saving(producer, src, meta, mesh, kept: int, gathered: bool) -> int:
    """Bytes regathering frees of a use that keeps ``kept`` bytes: the gathered input, less the shard it keeps.

    Only an all-gathered input of a tensor that is not a partial sum
    (`autotp.solve.regather`). The shard costs nothing more where it is kept
    anyway: a parameter's own shard, or an output its producer keeps.
    """
    if not (gathered and kept) or _partial(src, mesh.shape):
        return 0
    shard = 0 if producer.kind == KIND_PARAM or producer.keeps_output else local_bytes(meta, src, mesh.shape)
    return max(0, kept - shard)


def _sums(src, dst, shape) -> bool:
    return any(isinstance(p, Partial) and not isinstance(q, Partial) and n > 1 for p, q, n in zip(src, dst, shape))


def _partial(layout, shape) -> bool:
    return any(isinstance(p, Partial) and n > 1 for p, n in zip(layout, shape))


def most_bytes(graph, training: bool, precision: str = AUTO) -> int:
    """More than any plan of ``graph`` keeps on a device: every parameter's whole state and every buffer, and
    each op's tensors, inputs and outputs, twice over (kept for backward, gathered, in a collective's buffer),
    none of them sharded. From the graph alone, before any strategy: where a memory limit exceeds it, the limit
    cannot bind, and `autotp.plan` searches one micro-batch count, in its own process."""
    total = 0
    for op in graph.nodes():
        meta = op.out[0] if op.out else None
        if op.kind == KIND_PARAM and training and op.requires_grad:
            total += meta.numel * sum(state_bytes(meta.dtype.itemsize, precision))
        elif op.kind in (KIND_PARAM, KIND_BUFFER):
            total += meta.nbytes
        else:
            total += 2 * op.bytes
    return total


def memory_by_term(graph, chosen: dict, mesh, training: bool, precision: str = AUTO) -> dict[str, int]:
    """Bytes per device for ``chosen`` (node name -> Strategy), split into named terms."""
    terms = dict.fromkeys(TERMS, 0)
    for op in graph.nodes():
        for term, nbytes in node_memory_bytes(op, chosen[op.name], mesh, training, precision).items():
            terms[term] += nbytes
    terms["total"] = sum(terms.values())
    return terms


def working_bytes(op, strategy, mesh, state: frozenset = frozenset()) -> int:
    """Bytes one op of an inference program holds at once on a device: its inputs, as it takes them, and the
    outputs it makes, on local shapes.

    The tensors a forward pass without autograd has alive peak at the op
    with the largest such set: an attention's queries, keys, values and mask
    (its scores and their softmax, where it is decomposed), the MLP's widened
    activations, the LM head's logits. A tensor an op reads twice counts
    twice. Inputs that are
    ``state`` (parameters and buffers, counted on their own) and outputs
    that are views or in-place writes add nothing; a tensor alive across the
    op that it does not read (a residual stream) is not counted.
    """
    if op.kind != KIND_OP:
        return 0
    ins = sum(local_bytes(meta, layout, mesh.shape)
              for name, meta, layout in zip(op.inputs, op.in_metas, strategy.ins) if name not in state)
    if is_alias(op.target) or writes_in_place(op):
        return ins
    return ins + sum(local_bytes(meta, strategy.out, mesh.shape) for meta in op.out)
