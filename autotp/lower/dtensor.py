"""The rank module's parameters as DTensors: torch's type for a tensor split over a ``DeviceMesh``.

Each parameter of a rank program run on a ``DeviceMesh`` is an
``nn.Parameter(DTensor)`` whose placements are the plan's and whose local
tensor is this rank's shard (the chunk `autotp.placement.shard_cuts` cuts,
which is DTensor's own ``Shard`` order). So ``torch.optim`` (foreach
included), ``clip_grad_norm_`` (the global norm, as a replicated DTensor),
``state_dict()`` and ``torch.distributed.checkpoint`` (saved under one plan,
loaded under another, resharded by DCP) see what they see under FSDP2 or
``parallelize_module``.

The program still computes on local tensors, with the collectives the plan
chose: right after each read of a parameter, the lowering puts a
``to_local`` (`local_parameter`), which is differentiable, so each
parameter's gradient arrives as a DTensor of the parameter's placements.
The machinery that works on gradients and parameters in place (the
gradient reducer, ZeRO's optimizer slices, checkpoints) reads and writes
their local tensors (`local_tensor`, `set_local_grad`). A plan's layouts are
even splits, so global shapes are the local ones times the pieces.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from autotp.placement import Partial, Shard, shard_factor


@functools.cache
def _dtensor_class():  # imported once, on first use: the gradient reducer asks for it on every gradient
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t) -> bool:
    return isinstance(t, _dtensor_class())


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's tensor of ``t``: its local shard if a DTensor (sharing memory, outside autograd), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The local tensor of ``param.grad`` (None when there is none)."""
    return local_tensor(param.grad)


def like_parameter(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a tensor of ``param``'s local shape, kept, not copied) as ``param`` holds it: a DTensor of
    its mesh, placements and global shape when ``param`` is one, else ``local`` itself."""
    if not is_dtensor(param):
        return local
    return _dtensor_class().from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                       stride=param.stride())


def set_local_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Set ``param.grad`` from a local tensor (kept, not copied), as a DTensor of ``param``'s placements if
    ``param`` is one."""
    param.grad = None if grad is None else like_parameter(param, grad)


def torch_placements(layout) -> tuple:
    """An autotp layout (``(S(0), R)``) as DTensor placements."""
    from torch.distributed.tensor import Partial as TorchPartial, Replicate as TorchReplicate, Shard as TorchShard

    return tuple(TorchShard(p.dim) if isinstance(p, Shard) else TorchPartial() if isinstance(p, Partial)
                 else TorchReplicate() for p in layout)


def global_shape(local_shape, layout, mesh_shape) -> tuple[int, ...]:
    """The whole tensor's shape from one device's piece under ``layout`` (even splits)."""
    return tuple(s * shard_factor(layout, d, mesh_shape) for d, s in enumerate(local_shape))


def as_dtensor_parameter(local: torch.nn.Parameter, layout, device_mesh, mesh_shape) -> torch.nn.Parameter:
    """``local`` (this rank's shard) as an ``nn.Parameter(DTensor)`` of ``layout`` on ``device_mesh``, sharing
    its memory."""
    shape = global_shape(local.shape, layout, mesh_shape)
    stride = tuple(torch.empty(shape, device="meta").stride())
    dtensor = _dtensor_class().from_local(local.detach(), device_mesh, torch_placements(layout), shape=shape,
                                          stride=stride)
    return torch.nn.Parameter(dtensor, requires_grad=local.requires_grad)


def local_parameter(param: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter, differentiable: its gradient reaches ``param`` as a DTensor."""
    return param.to_local() if is_dtensor(param) else param


def read_parameters_locally(gm: fx.GraphModule) -> int:
    """Put a `local_parameter` after every read of a DTensor parameter in ``gm``'s graph; returns how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or not node.users:
            continue
        try:
            value = gm.get_parameter(node.target)
        except AttributeError:
            continue  # a buffer or a submodule
        if not is_dtensor(value):
            continue
        with gm.graph.inserting_after(node):
            local = gm.graph.call_function(local_parameter, (node,))
        node.replace_all_uses_with(local, delete_user_cb=lambda user, local=local: user is not local)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done

