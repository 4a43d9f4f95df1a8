"""The rule of the opt-in batching pass (`autotp.lower.batching`): which collectives of the graph merge.

`parallelize(batch_collectives=True)` merges collectives of one kind on one
mesh axis that do not depend on each other. The cost model does not price
this pass (it prices each collective where it is used, and the gradient sums
of data parallelism in the reducer's buckets), so it is off by default.

A collective is an `Item`: it can start once its input exists (``ready``, a
position in program order) and must have finished before its first consumer
(``needed``). Collectives of the same kind on the same mesh axis merge into
one batch when one point lies after every input and before every consumer,
``max(ready) < min(needed)``; one that takes another's output as input
comes in a later round, ready where its producer's batch is waited for. A
batch holds at most ``cap_bytes``. A batch of ``k`` collectives pays one
latency instead of ``k``; the bandwidth terms add up.
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
