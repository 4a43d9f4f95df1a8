"""Train a small Llama with autotp under torchrun: shards materialised from a file, AdamW, DCP checkpoints.

    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py --steps 5 --save-step 3 --save ckpt
    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py --steps 5 --resume ckpt --consolidate full.pt

Each rank builds the model with its parameters on ``meta`` (nothing
allocated) and reads only its own shards from a safetensors file of the
initial weights (rank 0 writes it from a fixed seed the first time). Rank 0
plans (Hugging Face's tensor-parallel plan as pins, the rest chosen by the
ILP) and broadcasts the plan. The rank module's parameters are DTensors, so
its checkpoints are PyTorch's own: ``torch.distributed.checkpoint`` saves
the model and AdamW state (``get_state_dict``: keyed by parameter name,
each rank writing its shards) in one directory per step, and a resumed run
loads them into whatever plan and mesh it runs (DCP reshards); the full
state dict for ``from_pretrained`` users is read out of the checkpoint
without a process group (``dcp_to_torch_save``). Every rank feeds the same
full batch, as `autotp.parallelize` expects. Uses gloo on CPU, NCCL when
there are GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

import autotp
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


def make_plan(rank: int, world: int) -> autotp.Plan:
    """Rank 0 plans and broadcasts (planning is deterministic, but once is enough)."""
    text = [None]
    if rank == 0:
        with empty_parameters():
            model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
        plan = autotp.plan(model, autotp.Mesh(str(world)), (ids,), {"labels": ids}, pin=hf_tp_plan_pins(model))
        text = [plan.to_json()]
    dist.broadcast_object_list(text, src=0)
    return autotp.Plan.from_dict(json.loads(text[0]))


LATEST = "latest"  # the file naming a checkpoint's last complete step


def save(directory: str, local, optimizer, step: int, rank: int) -> None:
    """Every rank saves its shards of the model and AdamW state; rank 0 then names the step complete."""
    model_state, optimizer_state = get_state_dict(local, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state, "step": step},
             checkpoint_id=Path(directory) / f"step-{step}")
    dist.barrier()
    if rank == 0:
        atomic_write_text(Path(directory) / LATEST, f"step-{step}\n")


def latest(directory: str) -> Path:
    return Path(directory) / (Path(directory) / LATEST).read_text().strip()


def load(directory: str, local, optimizer) -> int:
    """Load the last complete step into ``local`` and ``optimizer`` (resharded to this run's plan); its number."""
    model_state, optimizer_state = get_state_dict(local, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": 0}
    dcp.load(state, checkpoint_id=latest(directory))
    set_state_dict(local, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]


def consolidate(directory: str, out: str) -> None:
    """The model's full state dict from the last checkpoint, for ``from_pretrained`` users: no process group."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(latest(directory), Path(tmp) / "all.pt")
        torch.save(torch.load(Path(tmp) / "all.pt", weights_only=False)["model"], out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="train until this step (counted from 1)")
    p.add_argument("--weights", default="llama-init.safetensors", help="initial weights; written if missing")
    p.add_argument("--save", help="directory of the checkpoints (one DCP checkpoint per step saved)")
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
    plan = make_plan(rank, world)
    with empty_parameters():  # parameters on meta, rotary buffers computed for real
        meta_model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    local = autotp.parallelize(meta_model, plan, weights=SafetensorsSource(args.weights), device=device)
    optimizer = torch.optim.AdamW(local.parameters(), lr=LR)
    start = load(args.resume, local, optimizer) if args.resume else 0

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
            save(args.save, local, optimizer, step, rank)

    if rank == 0 and args.losses_out:
        atomic_write_text(args.losses_out, json.dumps(losses, indent=1) + "\n")
    if rank == 0 and args.consolidate:
        consolidate(args.save or args.resume, args.consolidate)
    # free the module (and the process groups it holds) while Python is whole: a gloo group left to
    # interpreter shutdown can abort the process ("terminate called without an active exception")
    del local, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
