"""The CUDA path end to end, for the first machine with GPUs: NCCL calibration, then one compiled Llama step.

Run under torchrun, one process per GPU:

    torchrun --nproc-per-node 8 benchmarks/gpu_check.py --out gpu_profile

Each rank takes its GPU (``LOCAL_RANK``), joins an NCCL process group and

1. calibrates: `autotp.calibrate.calibrate` measures matmul throughput,
   memory bandwidth, launch overhead and every collective on the mesh of all
   ranks, and rank 0 writes the profile to ``--out`` (printed below);
2. plans a small transformers Llama (dropout off, float32, TF32 off) for
   that mesh under the measured profile, twice: the ILP's plan, and the
   Megatron-style baseline (which always splits the weights, so the check
   never rests on a replicated plan alone);
3. builds each rank module on the GPU (`autotp.parallelize(..., device=...)`),
   compiles it with ``torch.compile(fullgraph=True)``, runs one training
   step, compares the loss and every gradient with the whole model's step on
   the same GPU (one device), and times eager and compiled steps.

It prints one table and exits with status 1 when a loss or gradient is off
by more than ``--tolerance``. Without a GPU it runs the same on CPU with gloo
(``--compile-backend aot_eager`` keeps that quick; tests/test_benchmarks.py
runs it so on 2 processes), which checks the script, not the GPU path. The
suite never needs a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

import autotp
from autotp.calibrate import calibrate
from autotp.report.baselines import baseline_plans
from autotp.runtime.verify import scaled_error, worst_gradient_error

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=256, attention_dropout=0.0, tie_word_embeddings=False)
BATCH, SEQ = 8, 128


def build_llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device)


def step(module, ids):
    loss = module(ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def timed(module, ids, repeats: int, device) -> float:
    """Seconds per training step (forward and backward), after the calls already made."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        module.zero_grad(set_to_none=True)
        step(module, ids)
    sync()
    return (time.perf_counter() - started) / repeats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_profile", help="folder for the calibrated profile (default ./gpu_profile)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--max-size", type=int, default=64 << 20, help="largest collective message to calibrate, bytes")
    p.add_argument("--repeats", type=int, default=10, help="timed steps of each kind")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest loss and gradient error allowed")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 exactness
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    sizes = [s for s in (1 << 12, 1 << 16, 1 << 20, 16 << 20, 64 << 20, 256 << 20) if s <= args.max_size]
    mesh = autotp.Mesh(world, links="nvlink" if cuda else "loopback")
    profile = calibrate(mesh, sizes=sizes, out_dir=args.out, progress=rank == 0)

    whole = build_llama(device)
    cpu_ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids = cpu_ids.to(device)
    want = step(whole, ids)
    model = build_llama("cpu")  # planned, then cut into this rank's shards
    plans = {"autotp": autotp.plan(model, mesh, (cpu_ids,), {"labels": cpu_ids}, profile=profile)}
    megatron, = baseline_plans(model, mesh, (cpu_ids,), {"labels": cpu_ids}, names=["megatron"], profile=profile)
    plans["megatron"] = megatron.plan  # always splits: the check never rests on a replicated plan alone
    errors, seconds = {}, {"one device": timed(whole, ids, args.repeats, device)}
    for name, plan in plans.items():
        local = autotp.parallelize(build_llama("cpu"), plan, device=device)  # shards moved to this rank's device
        compiled = torch.compile(local, fullgraph=True, backend=args.compile_backend)
        got = step(compiled, ids)
        errors[name] = (scaled_error(got, want), worst_gradient_error(local, whole, plan, rank))
        seconds[f"{name} eager"] = timed(local, ids, args.repeats, device)
        seconds[f"{name} compiled"] = timed(compiled, ids, args.repeats, device)
        del compiled, local
    gathered = [None] * world
    dist.all_gather_object(gathered, errors)
    if rank == 0:
        print(f"\n{world} rank(s) on {device.type}; profile {profile['name']} written to {args.out}")
        print(f"matmul float32 {profile['device']['peak_flops']['float32'] / 1e12:.1f} TFLOP/s, "
              f"memory {profile['device']['memory_bandwidth_Bps'] / 1e9:.0f} GB/s")
        for name, plan in plans.items():
            split = sum(any(p.startswith("S(") for p in layout) for layout in plan.parameters.values())
            worst = [max(e[name][i] for e in gathered) for i in range(2)]
            print(f"{name}: {split} of {len(plan.parameters)} parameters split, predicted step "
                  f"{plan.predicted['total_s'] * 1e3:.2f} ms; worst over ranks: loss error {worst[0]:.2e}, "
                  f"gradient error {worst[1]:.2e} (tolerance {args.tolerance:g})")
        print("\n| step | ms |\n|---|---|")
        for name, s in seconds.items():
            print(f"| {name} | {s * 1e3:.2f} |")
    ok = all(error <= args.tolerance for e in gathered for pair in e.values() for error in pair)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
