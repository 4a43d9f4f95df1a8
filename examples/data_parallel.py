"""Data parallelism as DDP users run it: each rank reads only its own rows, gradients are summed in buckets.

    python examples/data_parallel.py

A transformers Llama (2 layers, random weights) is planned for 4 gloo
processes, restricted to pure data parallelism (weights whole, the batch
split on every tensor that carries it), under the shipped CPU profile. Each
rank then trains 3 AdamW steps on its own quarter of each global batch, cut
by `autotp.runtime.local_inputs` (a per-rank data loader would read just
those rows, as `DistributedSampler` does). The loss comes back as one scalar,
the mean over the whole global batch, on every rank; the gradients of all
ranks are summed in 25 MiB buckets during the backward pass. The script
compares every step's loss and every parameter after the steps with one
process training on the whole batches, and exits with an error when a loss
differs by more than 1e-5 or a parameter by more than 1e-4 (Adam divides by
the root of each gradient's running square, so rounding-level differences in
the summation order of near-zero gradients move a parameter by up to about
the learning rate times their relative size).
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autotp
from autotp.api import capture_model
from autotp.report.baselines import batch_split_only
from autotp.runtime import local_inputs, spawn

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0)
BATCH, SEQ, STEPS, LOSS_TOLERANCE, PARAMETER_TOLERANCE = 8, 16, 3, 1e-5, 1e-4


def model_and_batches():
    """The same weights and the same global batches on every call, so on every rank."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    batches = [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ)) for _ in range(STEPS)]
    return model, batches


def train(module, plan=None, rank=0) -> tuple[list[float], object]:
    """AdamW steps on the batches; with a plan, each rank feeds its own rows."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    _, batches = model_and_batches()
    losses = []
    for ids in batches:
        args, kwargs = (ids,), {"labels": ids.clone()}  # a tensor of its own: each rank cuts both
        if plan is not None:
            args, kwargs = local_inputs(plan, rank, args, kwargs)
        loss = module(*args, **kwargs)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, module


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A rank module's parameter as one tensor: its parameters are DTensors with the plan's placements."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


def run_rank(rank, world, plan):
    """This rank's losses and its errors against one process trained on the whole batches (here, alike)."""
    model, _ = model_and_batches()
    losses, local = train(autotp.parallelize(model, plan), plan, rank)
    reference_losses, reference = train(model_and_batches()[0])
    params = dict(reference.named_parameters())
    param_error = max(float((_whole(p) - params[name]).detach().abs().max()) for name, p in local.named_parameters())
    loss_error = max(abs(a - b) for a, b in zip(losses, reference_losses))
    return losses, reference_losses, loss_error, param_error


def main() -> int:
    model, batches = model_and_batches()
    ids = batches[0]
    mesh = autotp.Mesh("4", links="loopback")
    graph = capture_model(model, (ids,), {"labels": ids.clone()}).graph
    plan = autotp.plan(model, mesh, (ids,), {"labels": ids.clone()}, profile="cpu-2core-4proc",
                       allow=batch_split_only(BATCH, graph))
    print(f"inputs each rank may take: {plan.io['inputs']}; outputs: {plan.io['outputs']}")
    results = spawn(run_rank, mesh.size, plan)
    worst_loss = worst_param = 0.0
    for rank, (losses, reference_losses, loss_error, param_error) in enumerate(results):
        worst_loss, worst_param = max(worst_loss, loss_error), max(worst_param, param_error)
        print(f"rank {rank} ({BATCH // mesh.size} of {BATCH} rows a step): losses {[round(x, 5) for x in losses]}, "
              f"max loss error {loss_error:.1e}, max parameter error after {STEPS} steps {param_error:.1e}")
    print(f"one process, whole batches: losses {[round(x, 5) for x in results[0][1]]}")
    if worst_loss > LOSS_TOLERANCE or worst_param > PARAMETER_TOLERANCE:
        print(f"mismatch: loss {worst_loss:.2e} (tolerance {LOSS_TOLERANCE}), parameters {worst_param:.2e} "
              f"(tolerance {PARAMETER_TOLERANCE})", file=sys.stderr)
        return 1
    print(f"data parallel on {mesh.size} gloo processes: losses within {worst_loss:.1e}, parameters after "
          f"{STEPS} AdamW steps within {worst_param:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
