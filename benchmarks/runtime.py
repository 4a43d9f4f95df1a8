"""Step time, bytes moved and memory: autotp's compiled module against hand-written parallelism.

    python benchmarks/runtime.py [--steps 20] [--warmup 3] [--models llama,gpt]

On 4 gloo processes, the same model and the same global batch run as:

- ``autotp``: `autotp.plan` with the layer projections pinned to Megatron's
  column/row split (Hugging Face's ``tp_plan`` for Llama; the same styles for
  the GPT of examples/models.py) and every other parameter replicated, the
  rest chosen by the ILP; `autotp.parallelize` with batching and overlap;
- ``autotp, no batch/overlap``: the same plan, ``batch_collectives=False, overlap=False``;
- ``DTensor``: ``parallelize_module`` with `autotp.interop.dtensor_plan(plan)`;
  the placements of every parameter are checked equal to the plan's;
- ``DDP``: ``DistributedDataParallel`` over gloo, each rank a quarter of the batch;
- ``autotp data-parallel plan``: `autotp.plan(..., allow=data_parallel_only)`, with
  batching and overlap on and off: where they matter (dozens of gradient reductions).

The variants run interleaved (ABCDEF ABCDEF ...) so machine load hits them alike.
A step is forward + backward + zeroing the gradients; its time is the
slowest rank's, and the table gives the median over ``--steps`` steps after
``--warmup``. Bytes per step are counted from the collectives issued (nccl-tests'
message sizes: the all-reduce buffer, the gathered output, the reduce-scatter
input): autotp with its `CommCounter`, DTensor with a dispatch mode over the
functional collectives it issues (cross-checked against ``CommDebugMode``'s
counts), DDP with a comm hook that counts each bucket and then runs the
default all-reduce hook. Memory is the growth of the resident set's high-water
mark (``VmHWM``, reset through ``/proc/self/clear_refs``) during one step,
on top of the resident parameters, which are listed separately.

Then on one process (mesh of 1) the compiled module against the eager model.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import autotp  # noqa: E402
from autotp.interop import dtensor_plan, pins_from_styles  # noqa: E402
from autotp.lower.collectives import CommCounter  # noqa: E402
from autotp.runtime import spawn  # noqa: E402
from autotp.solve.constraints import data_parallel_only  # noqa: E402

PROFILE = "cpu-2core-4proc"
GPT_STYLES = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise", "blocks.*.proj": "rowwise",
              "blocks.*.up": "colwise", "blocks.*.down": "rowwise", "tok": "rowwise", "head": "colwise"}


# --- models -------------------------------------------------------------------------------------------------

def build(name: str, batch: int = 4, seq: int = 128):
    """``(model, args, kwargs)``: the same weights and inputs on every call (and so on every rank)."""
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq,
                             attention_dropout=0.0)
        ids = torch.randint(0, 1024, (batch, seq))
        return LlamaForCausalLM(config), (ids,), {"labels": ids}
    if name == "gpt":
        from models import GPT

        ids = torch.randint(0, 1024, (batch, seq))
        return GPT(vocab=1024, hidden=256, heads=8, layers=2, seq=seq), (ids, torch.roll(ids, -1, 1)), {}
    raise ValueError(name)


def styles(name: str, model) -> dict[str, str]:
    """Hugging Face's own tp_plan for Llama; the same Megatron styles for the GPT (vocabulary-split embedding
    and head, column-parallel q/k/v and up, row-parallel proj and down)."""
    if name == "llama":
        prefix = f"{model.base_model_prefix}."
        out = {prefix + k: v for k, v in model.config.base_model_tp_plan.items()}
        out.update(model._tp_plan)
        return out
    return GPT_STYLES


def hand_written(plan, model):
    """`dtensor_plan(plan)`, with what a hand-written plan adds around the loss, as HF's tp_plan does:
    an embedding split by rows takes replicated token ids, and the LM head gathers its output."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = dtensor_plan(plan, model)
    for path, style in out.items():
        module = model.get_submodule(path)
        if isinstance(module, torch.nn.Embedding) and isinstance(style, RowwiseParallel):
            out[path] = RowwiseParallel(input_layouts=Replicate())
        elif path.rsplit(".", 1)[-1] in ("head", "lm_head") and isinstance(style, ColwiseParallel):
            out[path] = ColwiseParallel(output_layouts=Replicate())
    return out


def loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "loss"):
        return out.loss
    if isinstance(out, dict):
        return out["loss"]
    return next(t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0)


def _local_heads_attention(self, x):
    """The GPT block's attention with the head count read from the local width (hand-written TP needs this)."""
    import torch.nn.functional as F

    b, s, h = x.shape
    q, k, v = (lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, s, -1))


def slow_device(name: str, factor: float = 1000.0) -> dict:
    """The profile with a device ``factor`` times slower: under it the ILP splits the batch everywhere, so the
    data-parallel rows really are data parallel (on the real profile this small model stays replicated)."""
    profile = autotp.load_profile(name).to_dict()
    profile["device"] = dict(profile["device"], peak_flops={k: v / factor for k, v in
                                                            profile["device"]["peak_flops"].items()})
    profile["name"] = f"{name}, device {factor:g}x slower"
    return profile


# --- counting collectives outside autotp --------------------------------------------------------------------

class FunctionalCollectiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the functional collectives DTensor issues (forward and backward) and their message bytes."""

    def __init__(self, counter: CommCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__ if func.namespace == "_c10d_functional" else ""
        if name.startswith("all_reduce"):
            self.counter.record("all_reduce", "tp", _bytes(args[0]))
        elif name.startswith("all_gather_into_tensor"):
            self.counter.record("all_gather", "tp", _bytes(args[0]) * args[1])
        elif name.startswith("reduce_scatter_tensor"):
            self.counter.record("reduce_scatter", "tp", _bytes(args[0]))
        elif name.startswith("all_to_all"):
            self.counter.record("all_to_all", "tp", _bytes(args[0]))
        return func(*args, **kwargs)


def _bytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_bytes(x) for x in t)
    return t.numel() * t.element_size()


class DistCalls:
    """Counts calls of torch.distributed's collectives while active (this process only): a cross-check of
    autotp's own counter that also sees a collective issued outside it (the vocabulary-parallel loss's max)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor", "broadcast")

    def __init__(self):
        self.calls, self._saved = 0, {}

    def __enter__(self):
        for name in self.NAMES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(self._saved[name]))
        return self

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def counting_allreduce_hook(counter: CommCounter, bucket):
    """DDP comm hook: count the bucket, then DDP's default all-reduce (which averages)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    counter.record("all_reduce", "dp", _bytes(bucket.buffer()))
    return default_hooks.allreduce_hook(None, bucket)


# --- memory -------------------------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def peak_growth_bytes(step) -> int:
    """Growth of the resident high-water mark while ``step()`` runs (Linux: VmHWM reset by clear_refs).

    ``malloc_trim`` first hands the heap's free pages back, so the pages an
    earlier variant touched and freed do not hide this step's growth.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kb("VmRSS")
    step()
    return (_status_kb("VmHWM") - base) * 1024


# --- the variants -------------------------------------------------------------------------------------------

class Variant:
    """One way to run the model: a step function, its input split and how it counts collectives."""

    def __init__(self, name, module, args, kwargs, counter, mode=None):
        self.name, self.module, self.args, self.kwargs = name, module, args, kwargs
        self.counter, self.mode = counter, mode
        self.times: list[float] = []

    def step(self):
        loss_of(self.module(*self.args, **self.kwargs)).backward()
        for p in self.module.parameters():
            p.grad = None

    def counted_step(self):
        self.counter.clear()
        calls = DistCalls()
        with self.mode if self.mode is not None else calls:
            self.step()
        kinds = self.counter.by_kind()
        if calls.calls:
            kinds["torch.distributed calls"] = calls.calls
        return self.counter.count, self.counter.bytes, kinds

    def param_bytes(self) -> int:
        return sum(_bytes(p.to_local() if hasattr(p, "to_local") else p) for p in self.module.parameters())


def _dtensor_variant(name, plan, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model, args, kwargs = build(name)
    if name == "gpt":
        for block in model.blocks:
            block.head_dim = block.q.out_features // block.heads
            block.attention = types.MethodType(_local_heads_attention, block)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, hand_written(plan, model))
    check_same_placements(model, plan)
    counter = CommCounter()
    return Variant("DTensor parallelize_module", model, args, kwargs, counter, FunctionalCollectiveBytes(counter))


def check_same_placements(model, plan) -> None:
    """Every parameter's DTensor placement is the plan's (a plain tensor counts as replicated)."""
    for fqn, param in model.named_parameters():
        got = tuple(f"S({p.dim})" if p.is_shard() else "R" if p.is_replicate() else "P"
                    for p in param.placements) if hasattr(param, "placements") else ("R",)
        if got != tuple(plan.parameters[fqn]):
            raise SystemExit(f"{fqn}: DTensor placement {got} but the plan has {plan.parameters[fqn]}")


def _ddp_variant(name, rank, world):
    model, args, kwargs = build(name)
    rows = args[0].shape[0] // world
    local = slice(rank * rows, (rank + 1) * rows)
    args = tuple(a[local] for a in args)
    kwargs = {k: v[local] for k, v in kwargs.items()}
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    counter = CommCounter()
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    return Variant("DDP (gloo)", ddp, args, kwargs, counter)


def _autotp_variant(label, name, plan, rank, batch, overlap):
    model, args, kwargs = build(name)
    counter = CommCounter()
    local = autotp.parallelize(model, plan, rank=rank, batch_collectives=batch, overlap=overlap, counter=counter)
    return Variant(label, local, args, kwargs, counter)


def measure(variants, steps: int, warmup: int) -> dict:
    for _ in range(warmup):
        for v in variants:
            v.step()
    for _ in range(steps):
        for v in variants:  # interleaved: ABCDEF ABCDEF ...
            dist.barrier()
            started = time.perf_counter()
            v.step()
            v.times.append(time.perf_counter() - started)
    out = {}
    for v in variants:
        dist.barrier()
        count, nbytes, kinds = v.counted_step()
        dist.barrier()
        memory = peak_growth_bytes(v.step)
        out[v.name] = {"times": v.times, "count": count, "bytes": nbytes, "kinds": kinds,
                       "peak_growth": memory, "params": v.param_bytes()}
    return out


def _run_parallel(rank, world, name, plan, dp_plan, steps, warmup):
    torch.manual_seed(1 + rank)
    variants = [_autotp_variant("autotp", name, plan, rank, True, True),
                _autotp_variant("autotp, no batch/overlap", name, plan, rank, False, False),
                _dtensor_variant(name, plan, rank, world),
                _ddp_variant(name, rank, world),
                _autotp_variant("autotp data-parallel plan", name, dp_plan, rank, True, True),
                _autotp_variant("autotp data-parallel plan, no batch/overlap", name, dp_plan, rank, False, False)]
    return measure(variants, steps, warmup)


def _run_single(rank, world, name, plan, steps, warmup):
    model, args, kwargs = build(name)
    compiled = autotp.parallelize(copy.deepcopy(model), plan, rank=0)
    variants = [Variant("autotp, mesh of 1", compiled, args, kwargs, CommCounter()),
                Variant("eager", model, args, kwargs, CommCounter())]
    return measure(variants, steps, warmup)


# --- report -------------------------------------------------------------------------------------------------

def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def step_times(per_rank: list[dict], variant: str) -> float:
    """Median over steps of the slowest rank's time."""
    slowest = [max(r[variant]["times"][i] for r in per_rank) for i in range(len(per_rank[0][variant]["times"]))]
    return statistics.median(slowest)


def table(title: str, per_rank: list[dict], reference: str) -> str:
    lines = [f"\n{title}\n", "| variant | step (ms, median) | × " + reference + " | collectives / step | "
             "MiB moved / step | peak growth (MiB, max rank) | parameters (MiB / rank) |", "|---|---|---|---|---|---|---|"]
    ref = step_times(per_rank, reference)
    for variant in per_rank[0]:
        t = step_times(per_rank, variant)
        r0 = per_rank[0][variant]
        peak = max(r[variant]["peak_growth"] for r in per_rank)
        lines.append(f"| {variant} | {t * 1e3:.1f} | {t / ref:.2f} | {r0['count']} | {_mib(r0['bytes'])} | "
                     f"{_mib(peak)} | {_mib(r0['params'])} |")
    kinds = {variant: per_rank[0][variant]["kinds"] for variant in per_rank[0]}
    lines.append("\ncollectives by kind (rank 0): " + "; ".join(f"{k}: {v}" for k, v in kinds.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default="llama,gpt")
    opts = parser.parse_args()
    started = time.perf_counter()
    for name in opts.models.split(","):
        model, args, kwargs = build(name)
        pins = pins_from_styles(model, styles(name, model))
        mesh = autotp.Mesh("4", links="loopback")
        plan = autotp.plan(model, mesh, args, kwargs, profile=PROFILE, pin=pins)
        dp_plan = autotp.plan(model, mesh, args, kwargs, profile=slow_device(PROFILE), allow=data_parallel_only)
        per_rank = spawn(_run_parallel, 4, name, plan, dp_plan, opts.steps, opts.warmup, timeout_s=1800)
        print(table(f"### {name}, 4 gloo processes (global batch {args[0].shape[0]} × {args[0].shape[1]} tokens)",
                    per_rank, "DTensor parallelize_module"))
        for label, p in (("autotp", plan), ("autotp data-parallel plan", dp_plan)):
            print(f"\n{label} predicted (ms): {({k: round(v * 1e3, 3) for k, v in p.predicted.items()})}")
        one = autotp.plan(model, autotp.Mesh("1", links="loopback"), args, kwargs, profile=PROFILE)
        print(table(f"### {name}, one process (mesh of 1)", spawn(_run_single, 1, name, one, opts.steps,
                                                                  opts.warmup, timeout_s=1800), "eager"))
    print(f"\n{time.perf_counter() - started:.0f} s in all; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads in this process, one per spawned process")


if __name__ == "__main__":
    main()
