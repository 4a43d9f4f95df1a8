"""Step time on the clock: autotp's own choice against one process, DDP and DTensor with Hugging Face's tp_plan.

    python benchmarks/runtime.py [--steps 12] [--warmup 3] [--worlds 2,4] [--layers 4 --hidden 512 --seq 256]
                                 [--compile-backend inductor] [--quick]

A transformers ``LlamaForCausalLM`` (random weights, fp32, loss inside the
model, global batch 4 × 256 tokens) runs one training step (forward,
backward, zeroing the gradients) several ways, for each number of gloo
processes in ``--worlds``:

- ``autotp (cpu-2core-4proc)``: `autotp.plan` free, under the shipped
  profile, on ``Mesh(W, links="loopback")``, run by `autotp.parallelize` with
  its defaults; each rank takes its own piece of the batch where the plan
  lets it (`autotp.runtime.local_inputs`), as a DDP rank would;
- ``autotp (cpu-2core-4proc), compiled``: that rank module under
  ``torch.compile(fullgraph=True)`` (``--compile-backend``, Inductor by
  default), compiled during the first warm-up round, which no figure counts;
- ``autotp (calibrated)``: the same, under a profile that `autotp.calibrate`
  measures on W processes of this machine at the start of the run;
- ``autotp data-parallel plan``: `autotp.plan` restricted to pure data
  parallelism (`batch_split_only`), the same runtime;
- ``DDP``: ``DistributedDataParallel`` over gloo, each rank its quarter (or half)
  of the batch, 25 MiB buckets;
- ``DTensor + HF tp_plan``: ``parallelize_module`` with the model's own
  Hugging Face ``tp_plan`` (column-parallel q/k/v/gate/up and ``lm_head``,
  row-parallel o/down, embedding by rows), every rank the whole batch;
- ``one process``: the eager model on the whole batch, in one process using
  every core (run on its own, after the others), and beside it
  ``autotp, mesh of 1``: the rank program of a plan for one device, which
  says what the captured graph itself costs against eager.

The multi-process rows run interleaved (ABCDE ABCDE ...) after a barrier, so
the load of this shared machine falls on all of them alike. A step's time is
the slowest rank's; the table gives the median over ``--steps`` steps after
``--warmup`` rounds. Collectives and bytes per step are counted from what each
way issues (autotp's `CommCounter`; DDP's buckets through a comm hook;
DTensor's functional collectives through a dispatch mode). The plans'
predicted step times are printed beside the measured ones.

``--quick`` checks that the script runs, as tests/test_benchmarks.py does: it
replaces the sizes above by 2 processes, one layer of hidden 128, sequence 16,
one step after one warm-up round, compiles with ``aot_eager``, and calibrates
at two message sizes with 3 repeats; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import autotp
from autotp.api import capture_model
from autotp.interop import hf_dtensor_plan
from autotp.lower.collectives import CommCounter
from autotp.report.baselines import batch_split_only
from autotp.runtime import local_inputs, spawn

PROFILE = "cpu-2core-4proc"
VOCAB = 8192
COMPILED = ", compiled"
QUICK = dict(steps=1, warmup=1, worlds="2", layers=1, hidden=128, seq=16,  # --quick: does the script run?
             compile_backend="aot_eager")  # traces as Inductor does, without its C++ build
QUICK_CALIBRATION = dict(sizes=(4096, 65536), repeats=3)


def build(layers: int, hidden: int, seq: int, batch: int = 4):
    """``(model, args, kwargs)``: the same weights and inputs on every call (and so on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=int(hidden * 2.6875) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=seq, attention_dropout=0.0)
    ids = torch.randint(0, VOCAB, (batch, seq))
    return LlamaForCausalLM(config), (ids,), {"labels": ids}


def _bytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_bytes(x) for x in t)
    return t.numel() * t.element_size()


class FunctionalCollectiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the functional collectives DTensor issues (forward and backward) and their message bytes."""

    def __init__(self, counter: CommCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        name = func._overloadpacket.__name__ if func.namespace == "_c10d_functional" else ""
        if name.startswith("all_reduce"):
            self.counter.record("all_reduce", "tp", _bytes(args[0]))
        elif name.startswith("all_gather_into_tensor"):
            self.counter.record("all_gather", "tp", _bytes(args[0]) * args[1])
        elif name.startswith("reduce_scatter_tensor"):
            self.counter.record("reduce_scatter", "tp", _bytes(args[0]))
        return func(*args, **(kwargs or {}))


def counting_allreduce_hook(counter: CommCounter, bucket):
    """DDP comm hook: count the bucket, then DDP's default all-reduce (which averages)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    counter.record("all_reduce", "dp", _bytes(bucket.buffer()))
    return default_hooks.allreduce_hook(None, bucket)


class Variant:
    """One way to run the model: its module, its inputs on this rank, and how it counts collectives."""

    def __init__(self, name, module, args, kwargs, counter, mode=None):
        self.name, self.module, self.args, self.kwargs = name, module, args, kwargs
        self.counter, self.mode = counter, mode
        self.times: list[float] = []

    def step(self):
        out = self.module(*self.args, **self.kwargs)
        (out["loss"] if isinstance(out, dict) else out.loss).backward()
        for p in self.module.parameters():
            p.grad = None
            p.autotp_gradient_slice = None  # ZeRO-2's slice of the summed gradient, which an optimizer would take

    def counted_step(self) -> tuple[int, int]:
        self.counter.clear()
        if self.mode is not None:
            with self.mode:
                self.step()
        else:
            self.step()
        return self.counter.count, self.counter.bytes


def _autotp(label, plan, rank, sizes):
    model, args, kwargs = build(*sizes)
    counter = CommCounter()
    local = autotp.parallelize(model, plan, rank=rank, counter=counter)
    if local.autotp_reducer is not None:  # ZeRO-2 sums stay sliced, as under `shard_optimizer`: the step as priced
        local.autotp_reducer.keep_slices = True
    args, kwargs = local_inputs(plan, rank, args, kwargs)
    return Variant(label, local, args, kwargs, counter)


def _compiled(variant: Variant, backend: str) -> Variant:
    """The same rank module under ``torch.compile(fullgraph=True)``: one graph, compiled at the first warm-up."""
    compiled = torch.compile(variant.module, fullgraph=True, backend=backend)
    return Variant(variant.name + COMPILED, compiled, variant.args, variant.kwargs, variant.counter)


def _ddp(rank, world, sizes):
    model, args, kwargs = build(*sizes)
    rows = args[0].shape[0] // world
    mine = slice(rank * rows, (rank + 1) * rows)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    counter = CommCounter()
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    return Variant("DDP", ddp, tuple(a[mine] for a in args), {k: v[mine] for k, v in kwargs.items()}, counter)


def hf_tp_parallelize(model, world: int):
    """``model`` under DTensor's ``parallelize_module`` with the styles of its own Hugging Face ``tp_plan``
    (`autotp.interop.hf_dtensor_plan`), on a mesh of ``world`` CPU processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, init_device_mesh("cpu", (world,)), hf_dtensor_plan(model))


def _dtensor(world, sizes):
    model, args, kwargs = build(*sizes)
    hf_tp_parallelize(model, world)
    counter = CommCounter()
    return Variant("DTensor + HF tp_plan", model, args, kwargs, counter, FunctionalCollectiveBytes(counter))


def measure(variants, steps: int, warmup: int, barrier: bool = True) -> dict:
    for _ in range(warmup):
        for v in variants:
            v.step()
    for _ in range(steps):
        for v in variants:  # interleaved: ABCDE ABCDE ...
            if barrier:
                dist.barrier()
            started = time.perf_counter()
            v.step()
            v.times.append(time.perf_counter() - started)
    out = {}
    for v in variants:
        count, nbytes = v.counted_step()
        out[v.name] = {"times": v.times, "count": count, "bytes": nbytes}
    return out


def _run_parallel(rank, world, plans, sizes, steps, warmup, backend):
    variants = [_autotp(label, plan, rank, sizes) for label, plan in plans.items()]
    variants.insert(1, _compiled(_autotp(*next(iter(plans.items())), rank, sizes), backend))
    variants += [_ddp(rank, world, sizes), _dtensor(world, sizes)]
    return measure(variants, steps, warmup)


def _run_single(rank, world, one, sizes, steps, warmup):
    model, args, kwargs = build(*sizes)
    compiled = autotp.parallelize(build(*sizes)[0], one, rank=0)
    variants = [Variant("one process", model, args, kwargs, CommCounter()),
                Variant("autotp, mesh of 1", compiled, args, kwargs, CommCounter())]
    return measure(variants, steps, warmup, barrier=False)


def _calibrate(rank, world, out_dir, options):
    from autotp.calibrate import calibrate

    return calibrate(autotp.Mesh(str(world), links="loopback"), name=f"this-machine-{world}proc", out_dir=out_dir,
                     progress=False, **options)


def step_time_s(per_rank: list[dict], variant: str) -> float:
    """Median over steps of the slowest rank's time."""
    times = per_rank[0][variant]["times"]
    return statistics.median(max(r[variant]["times"][i] for r in per_rank) for i in range(len(times)))


def report(world: int, per_rank: list[dict], single: list[dict], plans: dict) -> None:
    measured = {v: step_time_s(per_rank, v) for v in per_rank[0]}
    measured |= {v: step_time_s(single, v) for v in single[0]}
    best = min(measured[v] for v in ("one process", "DDP", "DTensor + HF tp_plan"))
    print(f"\n### {world} gloo processes\n")
    print("| variant | step (ms, median) | × best of one process, DDP, DTensor | × DDP | predicted (ms) | "
          "collectives / step | MiB moved / step |")
    print("|---|---|---|---|---|---|---|")
    for v, t in measured.items():
        rows = single if v in single[0] else per_rank
        counted = v.removesuffix(COMPILED)  # a compiled module counts nothing: it issues its eager twin's collectives
        predicted = f"{plans[counted].predicted['total_s'] * 1e3:.1f}" if counted in plans else ""
        print(f"| {v} | {t * 1e3:.1f} | {t / best:.2f} | {t / measured['DDP']:.2f} | {predicted} | "
              f"{rows[0][counted]['count']} | {rows[0][counted]['bytes'] / 2**20:.2f} |")
    for label, plan in plans.items():
        split = sum(1 for layout in plan.parameters.values() if any(p != "R" for p in layout))
        print(f"\n{label}: {split} of {len(plan.parameters)} parameters split; inputs {plan.io['inputs']}; "
              f"predicted {({k: round(v * 1e3, 2) for k, v in plan.predicted.items()})} ms")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled row")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: does the script run? (overrides the rest)")
    opts = parser.parse_args(argv)
    if opts.quick:
        vars(opts).update(QUICK)
    sizes = (opts.layers, opts.hidden, opts.seq)
    started = time.perf_counter()
    model, args, kwargs = build(*sizes)
    print(f"Llama {opts.layers} layers x {opts.hidden}, vocabulary {VOCAB}, global batch {tuple(args[0].shape)}; "
          f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory() as out_dir:
        for world in (int(w) for w in opts.worlds.split(",")):
            calibrated = spawn(_calibrate, world, out_dir, QUICK_CALIBRATION if opts.quick else {}, timeout_s=900)[0]
            mesh = autotp.Mesh(str(world), links="loopback")
            data_parallel = batch_split_only(args[0].shape[0], capture_model(model, args, kwargs).graph)
            plans = {f"autotp ({PROFILE})": autotp.plan(model, mesh, args, kwargs, profile=PROFILE),
                     "autotp (calibrated)": autotp.plan(model, mesh, args, kwargs, profile=calibrated),
                     "autotp data-parallel plan": autotp.plan(model, mesh, args, kwargs, profile=PROFILE,
                                                              allow=data_parallel)}
            per_rank = spawn(_run_parallel, world, plans, sizes, opts.steps, opts.warmup,
                             opts.compile_backend, timeout_s=3600)
            one = autotp.plan(model, autotp.Mesh("1", links="loopback"), args, kwargs, profile=PROFILE)
            single = spawn(_run_single, 1, one, sizes, opts.steps, opts.warmup, timeout_s=3600)
            report(world, per_rank, single, plans)
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    sys.exit(main())
