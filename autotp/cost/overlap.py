"""Batched and overlapped collectives: which collectives merge, and what they cost once merged.

Pure functions, shared by the lowering (`autotp/lower/batching.py`, which does
the merging) and the plan's predicted totals (`autotp/solve/assemble.py`), so
what is predicted is what runs.

A collective is an `Item`: it can start once its input exists (``ready``, a
position in program order) and must have finished before its first consumer
(``needed``). Collectives of the same kind on the same mesh axis merge into
one batch when one point lies after every input and before every consumer,
``max(ready) < min(needed)``; one that takes another's output as input
comes in a later round, ready where its producer's batch is waited for. A
batch holds at most ``cap_bytes``, so the gradients of late layers are
reduced while earlier layers still compute backward (DDP's buckets).

Cost of a batch of ``k`` collectives (alpha-beta): one latency instead of
``k``; the bandwidth terms add up. Overlap: a batch is started as soon as
its inputs exist and waited for just before its first consumer, so the
compute between the two (``window_s``) hides up to as much communication:

    exposed(batch) = max(0, latency + Σ bandwidth terms - window_s)
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CAP_BYTES = 4 * 2**20  # per batch: large enough to merge norms and biases, small enough to overlap


@dataclass(frozen=True)
class Item:
    """One collective as the batching rule sees it."""

    key: tuple  # (kind, mesh axis): only equal keys merge
    nbytes: int  # size of the tensor it moves (caps a batch)
    ready: float  # program position of its input
    needed: float  # program position of its first consumer
    depends_on: int | None = None  # index of the item whose output is this one's input


def batch_groups(items: list[Item], cap_bytes: int = DEFAULT_CAP_BYTES) -> list[list[int]]:
    """Indices of ``items`` grouped into batches, greedily in program order; every item is in one group.

    Items are taken in rounds by depth (a collective that takes another's
    output comes in the round after it, ready where its producer's batch
    finishes); within a round, by ``needed`` then ``ready``. Each joins the
    open batch of its key if the batch still has a common point with it and
    stays under ``cap_bytes``; otherwise it opens a new batch for its key.
    """
    depth = [_depth(items, i) for i in range(len(items))]
    ready = [item.ready for item in items]
    groups: list[list[int]] = []
    group_of: dict[int, int] = {}
    for d in range(max(depth, default=-1) + 1):
        for i in (i for i in range(len(items)) if depth[i] == d and items[i].depends_on is not None):
            producer = groups[group_of[items[i].depends_on]]
            ready[i] = min(items[m].needed for m in producer) - 0.5  # where the producer's batch is waited for
        layer = sorted((i for i in range(len(items)) if depth[i] == d), key=lambda i: (items[i].needed, ready[i], i))
        open_group: dict[tuple, int] = {}  # key -> index in groups
        for i in layer:
            g = open_group.get(items[i].key)
            if g is not None and _fits(items, ready, groups[g], i, cap_bytes):
                groups[g].append(i)
            else:
                open_group[items[i].key] = g = len(groups)
                groups.append([i])
            group_of[i] = g
    return groups


def _depth(items: list[Item], i: int) -> int:
    d = 0
    while items[i].depends_on is not None:
        i, d = items[i].depends_on, d + 1
    return d


def _fits(items: list[Item], ready: list[float], members: list[int], i: int, cap_bytes: int) -> bool:
    latest = max(max(ready[m] for m in members), ready[i])
    earliest = min(min(items[m].needed for m in members), items[i].needed)
    size = sum(items[m].nbytes for m in members) + items[i].nbytes
    return latest < earliest and size <= cap_bytes


def batched_time_s(latency_s: float, times_s: list[float]) -> float:
    """Seconds of one batch whose members alone would take ``times_s``: one latency, not ``len`` of them."""
    paid = [t for t in times_s if t > 0]  # a local slice or a 1-device axis costs nothing to merge
    return sum(paid) - latency_s * max(0, len(paid) - 1)


def exposed_time_s(comm_s: float, window_s: float) -> float:
    """Communication left on the critical path when ``window_s`` of compute runs between start and wait."""
    return max(0.0, comm_s - max(0.0, window_s))


def collective_savings_s(collectives: list[dict], position: dict[str, int], forward_s: list[float],
                         backward_s: list[float], latency_s: dict[str, float], already_hidden=lambda c: False,
                         cap_bytes: int = DEFAULT_CAP_BYTES) -> tuple[float, float]:
    """``(batching_saved_s, overlap_hidden_s)`` for a plan's collectives, as the lowering batches and overlaps them.

    ``collectives`` are `Plan.collectives` records (node, producer, input,
    phase, kind, axis, bytes, time_s); ``position`` is each op's place in
    program order (``"output"`` last); ``forward_s``/``backward_s`` the
    compute at each position; ``latency_s`` the latency per axis name.
    Records of one edge and phase form a chain (each depends on the one
    before); backward records are batched as their forward steps are. Records
    for which ``already_hidden`` holds (gradient reductions the ILP's
    ``overlap_gradients`` hides) save their latency but hide nothing more.
    """
    items, chains = [], {}
    for i, c in enumerate(collectives):
        edge = (c["node"], c["input"], c["producer"], c["phase"])
        previous = chains.get(edge)
        chains[edge] = i
        items.append(Item(key=(c["phase"], c["kind"], c["axis"]), nbytes=c["bytes"],
                          ready=position[c["producer"]], needed=position[c["node"]], depends_on=previous))
    saved = hidden = 0.0
    for group in batch_groups(items, cap_bytes):
        members = [collectives[i] for i in group]
        latency = latency_s[members[0]["axis"]]
        alone = [c["time_s"] for c in members]
        batched = batched_time_s(latency, alone)
        saved += sum(alone) - batched
        compute = forward_s if members[0]["phase"] == "forward" else backward_s
        start, end = max(it.ready for it in (items[i] for i in group)), min(items[i].needed for i in group)
        window = sum(compute[p] for p in range(int(start) + 1, int(end)))  # compute between start and wait
        share = sum(c["time_s"] for c in members if not already_hidden(c)) / sum(alone) if sum(alone) else 0.0
        visible = batched * share
        hidden += visible - exposed_time_s(visible, window)
    return saved, hidden
