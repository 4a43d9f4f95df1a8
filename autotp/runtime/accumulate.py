"""One optimizer step's forward and backward, run as the plan's micro-batches, gradients summed once.

A plan made with micro-batches (``plan.micro_batches`` = k > 1) was captured
at the micro-batch shape: the rank program takes batch/k rows. `accumulate`
cuts the step's batch into k pieces along dim 0 (every tensor input whose
dim 0 is the batch, `autotp.capture.micro`), runs forward and backward on
each, and lets the gradient reducer sum over ranks only after the last
(`GradientReducer.no_sync`), as DDP's ``no_sync`` does, except ZeRO-2's
gradients, reduce-scattered after each so only their slices accumulate
(DeepSpeed's ZeRO-2). Each micro-batch's
loss is scaled by 1/k, so the gradients are those of the mean of the k
losses: the step's mean loss whenever every micro-batch's loss is a mean
over as many elements (no ignored targets or padding that differ between
micro-batches), as Megatron-LM and torchtitan assume.

    local = autotp.parallelize(model, plan)
    loss = autotp.runtime.accumulate(local, plan, ids, labels=ids)   # the whole step's batch
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from autotp.capture.micro import batch_size, micro_batch
from autotp.errors import PlanError


def accumulate(local, plan, *args, loss_fn=None, **kwargs) -> torch.Tensor:
    """Forward and backward of one step's batch in ``plan.micro_batches`` pieces; returns the mean loss (detached).

    ``loss_fn(outputs)`` picks the scalar to differentiate; by default the
    output itself when it is one number, else its ``"loss"`` entry
    (transformers' outputs). Gradients must be zero when it starts.
    """
    k = plan.micro_batches
    batch = batch_size(args, kwargs)
    if k > 1 and (batch is None or batch % k):
        raise PlanError(f"the plan runs {k} micro-batches a step, but the batch given has {batch} rows: pass a "
                        f"multiple of {k} rows (the step's whole batch, or this rank's rows of it)")
    reducer = getattr(local, "autotp_reducer", None)
    total = torch.zeros(())
    for index in range(k):
        quiet = reducer is not None and index < k - 1
        with reducer.no_sync() if quiet else nullcontext():
            piece_args, piece_kwargs = micro_batch(args, kwargs, k, index, batch, leaves=False)
            loss = _loss(local(*piece_args, **piece_kwargs), loss_fn)
            (loss / k).backward()
        total = total + loss.detach().to(total.dtype) / k
    return total


def _loss(outputs, loss_fn) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(outputs)
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return outputs
    try:
        return outputs["loss"]
    except (KeyError, TypeError, IndexError):
        raise PlanError("the rank module returns no single loss: pass loss_fn=lambda outputs: ... to "
                        "autotp.runtime.accumulate") from None
