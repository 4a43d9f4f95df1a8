"""Parameters whose ZeRO all-gather is still running: the forward pass waits for each at its first use.

After the optimizer step, `autotp.runtime.shard_optimizer` starts the
all-gather that puts each split parameter back together and leaves, on the
parameter, how to finish it (``autotp_pending``). The lowering puts a call
to `landed` just before each such parameter's first use in the program
(`wait_at_first_use`), so the gathers run behind the forward compute that
comes first, as the cost model's prefetch chain prices them
(`autotp.solve.prefetch`). Anything else that reads the parameters between
the step and the next forward pass (a checkpoint, a weight norm) must call
`wait_parameters` first; `autotp.checkpoint` and ``state_dict()`` do.
"""

from __future__ import annotations

import torch
import torch.fx as fx


def landed(param: torch.Tensor) -> torch.Tensor:
    """``param``, once its pending all-gather (if any) has landed in it."""
    finish = getattr(param, "autotp_pending", None)
    if finish is not None:
        param.autotp_pending = None
        finish()
    return param


def wait_parameters(module: torch.nn.Module) -> None:
    """Land every pending all-gather of ``module``'s parameters: call before reading them outside a forward pass."""
    for param in module.parameters():
        landed(param)


def wait_at_first_use(gm: fx.GraphModule, params: list[torch.nn.Parameter]) -> dict[int, int]:
    """Insert `landed` before the first use of each of ``params`` in ``gm``; ``{id(param): that use's position}``."""
    wanted = {id(p) for p in params}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    first: dict[int, int] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or not node.users:
            continue
        param = _parameter(gm, node.target)
        if param is None or id(param) not in wanted:
            continue
        user = min(node.users, key=order.get)
        with gm.graph.inserting_before(user):
            ready = gm.graph.call_function(landed, (node,))
        node.replace_all_uses_with(ready, delete_user_cb=lambda u, ready=ready: u is not ready)
        first[id(param)] = min(first.get(id(param), order[user]), order[user])  # tied: each name's first use
    return first


def _parameter(gm: fx.GraphModule, target: str) -> torch.nn.Parameter | None:
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return None  # a buffer or a submodule
