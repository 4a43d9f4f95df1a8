"""Train a small Llama with autotp under torchrun: shards materialised from a file, AdamW, sharded checkpoints.

    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py --steps 5 --save-step 3 --save ckpt
    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py --steps 5 --resume ckpt --consolidate full.pt

Each rank builds the model with its parameters on ``meta`` (nothing
allocated) and reads only its own shards from a safetensors file of the
initial weights (rank 0 writes it from a fixed seed the first time). Rank 0
plans (Hugging Face's tensor-parallel plan as pins, the rest chosen by the
ILP) and broadcasts the plan; a resumed run takes the plan saved with the
checkpoint. Every rank feeds the same full batch, as `autotp.parallelize`
expects. Uses gloo on CPU, NCCL when there are GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import autotp
from autotp.checkpoint import checkpoint_plan, consolidate, load_sharded, save_sharded
from autotp.fileio import atomic_write_text
from autotp.interop import hf_tp_plan_pins
from autotp.materialize import SafetensorsSource, empty_parameters, save_safetensors

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)
BATCH, SEQ, SEED, LR = 4, 16, 0, 1e-2


def build_model() -> LlamaForCausalLM:
    """The model with random weights from a fixed seed (the same on every call)."""
    torch.manual_seed(SEED)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def batch(step: int) -> torch.Tensor:
    """Token ids of one step, ``[BATCH, SEQ]``, two batches in turn: the same on every rank and in every run."""
    return torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(step % 2))


def make_plan(rank: int, world: int, resume: str | None) -> autotp.Plan:
    """Rank 0 plans and broadcasts (planning is deterministic, but once is enough); a resume reuses the saved plan."""
    if resume:
        return checkpoint_plan(resume)
    text = [None]
    if rank == 0:
        with empty_parameters():
            model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
        plan = autotp.plan(model, autotp.Mesh(str(world)), (ids,), {"labels": ids}, pin=hf_tp_plan_pins(model))
        text = [plan.to_json()]
    dist.broadcast_object_list(text, src=0)
    return autotp.Plan.from_dict(json.loads(text[0]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="train until this step (counted from 1)")
    p.add_argument("--weights", default="llama-init.safetensors", help="initial weights; written if missing")
    p.add_argument("--save", help="directory of the sharded checkpoint")
    p.add_argument("--save-step", type=int, help="save after this step (default: the last)")
    p.add_argument("--resume", help="continue from this checkpoint directory")
    p.add_argument("--consolidate", help="write the full state dict of the last checkpoint here (rank 0)")
    p.add_argument("--losses-out", help="write {step: loss} as JSON here (rank 0)")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)  # NCCL and every tensor made without a device go to this rank's GPU
    torch.set_num_threads(1)
    # a bounded timeout: a rank that dies ends the others instead of hanging them
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))

    if rank == 0 and not Path(args.weights).exists():
        save_safetensors(build_model().state_dict(), args.weights)
    dist.barrier()
    plan = make_plan(rank, world, args.resume)
    with empty_parameters():  # parameters on meta, rotary buffers computed for real
        meta_model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    local = autotp.parallelize(meta_model, plan, weights=SafetensorsSource(args.weights), device=device)
    optimizer = torch.optim.AdamW(local.parameters(), lr=LR)
    start = load_sharded(args.resume, local, optimizer, plan, rank) if args.resume else 0

    losses = {}
    for step in range(start + 1, args.steps + 1):
        ids = batch(step).to(device)
        loss = local(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
        if rank == 0:
            print(f"step {step}: loss {losses[step]:.6f}", flush=True)
        if args.save and step == (args.save_step or args.steps):
            save_sharded(args.save, local, optimizer, plan, rank, step)

    if rank == 0 and args.losses_out:
        atomic_write_text(args.losses_out, json.dumps(losses, indent=1) + "\n")
    if rank == 0 and args.consolidate:
        torch.save(consolidate(args.save or args.resume), args.consolidate)
    # free the module (and the process groups it holds) while Python is whole: a gloo group left to
    # interpreter shutdown can abort the process ("terminate called without an active exception")
    del local, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
