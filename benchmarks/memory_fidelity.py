"""Memory per device, predicted against measured: a small Llama on 4 gloo ranks, with each memory lever (issue 15).

Model: transformers' `LlamaForCausalLM` built from its config with random
weights (4 layers, hidden 256, 8 heads, FFN 688, vocabulary 1024; fp32, so
16 bytes a trained parameter), a step's batch of 8 x 128 tokens, AdamW, on
mesh 2x2 (``dp`` x ``tp``). Every plan keeps the op layouts of one base plan,
Megatron-style tensor and sequence parallelism on ``tp`` (the column/row
split of Hugging Face's names pinned, no activation of the residual stream's
width whole on ``tp``, so activations are all-gathered and can be
regathered) with the batch split on ``dp`` (the ILP's own choice there), and
forces levers on top, as tests/test_levers_combined.py does: parameter pins
and a filter on the parameters' strategies for ZeRO; recomputation and
regathering by offering them and lowering ``memory_limit`` below each plan's
total until the plan takes them, so ``plan.memory`` is the model's own
figure for the plan that runs (setting ``plan.recompute`` or
``plan.regather`` on a plan does not change its ``plan.memory``):

1. none; 2. ZeRO-1: every trained parameter's optimizer state split over the
axes where it is whole; 3. ZeRO-2: its gradient split with it where the ILP
can; 4. ZeRO-3: every matrix stored split on ``dp`` too and regathered in
backward; 5. every layer recomputed; 6. gathered activations regathered;
7. four micro-batches (`autotp.runtime.accumulate`); 8. all of them.

Prediction: ``plan.memory`` (docs/cost-model.md, "Memory per device"): its
terms, and its peak (``total``): with one micro-batch the larger of what is
alive as backward starts (every term but the gradients) and as it ends
(every term but the activations); with several, every term. Measurement, per rank: one unprofiled training step (forward,
backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``), then the
second under ``torch.profiler`` with ``profile_memory=True``. The running
sum of its ``[memory]`` events (every allocation and free of the CPU
allocator) peaks at the bytes allocated beyond what was live when the step
began; what was live then (parameters, optimizer state, buffers, any
gradient: storages counted once) is added to give the measured peak.
Markers in the profile give the running sum at the end of the first forward
pass and the phase of the peak; the gradient bytes are counted after the
last backward pass. Each column is the largest over the 4 ranks.

What it showed on this project's 2-core machine (docs/cost-model.md, "Memory
per device, predicted against measured", has the table and the causes): the
parameter, gradient and optimizer terms are exact in every case (to the byte,
ZeRO's slices included); each lever alone is within 3% of the measured peak
(0.97 to 1.03); every lever at once is 1.38, its peak in backward made of
one op's transient buffers (the LM head's ring backward, gloo's copy of a
reduce-scatter's input) that the model does not hold.

Run: ``python benchmarks/memory_fidelity.py [--cases none,ZeRO-1]`` (about 1.5 minutes on 2 cores: 20 s of
planning, 4 ranks x 8 plans; ``--cases``: only the cases named, comma-separated, as tests/test_benchmarks.py does)
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import autotp
from autotp.errors import MemoryLimitError
from autotp.graph.opgraph import KIND_PARAM
from autotp.interop import pins_from_styles
from autotp.model_spec import ModelSpec, build
from autotp.report.baselines import megatron_styles, sequence_parallel_only
from autotp.runtime import accumulate, local_tensor, shard_optimizer, spawn, wait_parameters
from autotp.solve.constraints import same_as

SPEC = ModelSpec("hf:llama", {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                              "intermediate_size": 688, "vocab_size": 1024}, batch=8, seq=128)
MESH = autotp.Mesh("2x2", names=("dp", "tp"))  # the roles its plans give the axes: the batch, the weights
HIDDEN, LAYERS = 256, [f"model.layers.{i}" for i in range(4)]
ADAMW = dict(lr=1e-3, weight_decay=0.1)
TERMS = ("parameters", "gradients", "optimizer", "buffers", "activations")
MB = 1e6
# how far below a plan's total the next limit goes (a step of bytes, not one: fewer plans to try)
LIMIT_STEP = 4096


# ----------------------------------------------------------------------------------------------- the plans


def whole_axes(strategy) -> tuple[int, ...]:
    """The mesh axes (of size > 1) on which a parameter's layout is whole."""
    return tuple(a for a, p in enumerate(strategy.out) if isinstance(p, autotp.Replicate) and MESH.shape[a] > 1)


def state_whole(op, strategy) -> bool:
    return not strategy.optimizer_axes


def zero(gradients: bool):
    """Optimizer state split over every axis where the parameter is whole; the gradient with it only if
    ``gradients`` (and then where the ILP can: it is cheaper, so it does)."""

    def allow(op, strategy) -> bool:
        if not op.requires_grad:
            return True
        return strategy.optimizer_axes == whole_axes(strategy) and (gradients or not strategy.gradient_split)

    return allow


def stored_split(pins: dict) -> dict:
    """ZeRO-3's pins: each matrix split on dp as well, on the dim tp leaves whole; the norms stay whole."""
    out = {}
    for fqn, (dp, tp) in pins.items():
        matrix = "norm" not in fqn
        out[fqn] = ("S(1)" if tp == "S(0)" else "S(0)", tp) if matrix else (dp, tp)
    return out


def make_plans(names=None) -> dict:
    """The plans of the cases ``names`` (default: all eight), by case name."""
    model, args, kwargs = build(SPEC, meta=True)
    pins = pins_from_styles(model, megatron_styles(model), MESH.ndim)
    none = autotp.plan(model, MESH, args, kwargs, pin=pins, allow=sequence_parallel_only(HIDDEN, 1),
                       memory_limit=None, micro_batches=1, optimizer_sharding=False, recompute=False,
                       regather=False)
    assert none.nodes["embedding"].out[0] == "S(0)", "the base plan does not split the batch on dp"
    layouts = same_as(none)

    def lever(pin, parameters, micro_batches=1, until=None, **offered):
        """The base plan's layout for every op, ``pin`` and the filter ``parameters`` on the parameters. With
        ``until``: ``offered`` levers (recompute, regather) are offered and the memory limit lowered below each
        plan's total until ``until(plan)`` holds, or no plan fits (then the last one that did)."""
        def allow(op, strategy) -> bool:
            return parameters(op, strategy) if op.kind == KIND_PARAM else layouts(op, strategy)

        allow.strict = True
        options = dict(recompute=False, regather=False) | offered
        made, limit = None, None
        while made is None or (until is not None and not until(made)):
            try:
                made = autotp.plan(model, MESH, args, kwargs, pin=pin, allow=allow, micro_batches=micro_batches,
                                   memory_limit=limit, **options)
            except MemoryLimitError:
                break
            limit = made.memory["total"] - LIMIT_STEP
        return made

    def every(plan) -> bool:
        return plan.recompute == LAYERS and set(plan.regather) == {"weights", "activations"}

    split = stored_split(pins)
    cases = {
        "none": lambda: none,
        "ZeRO-1": lambda: lever(pins, zero(False)),
        "ZeRO-2": lambda: lever(pins, zero(True)),
        "ZeRO-3": lambda: lever(split, state_whole, until=lambda p: "weights" in p.regather, regather=True),
        "recompute": lambda: lever(pins, state_whole, until=lambda p: p.recompute == LAYERS, recompute=True),
        "regather activations": lambda: lever(pins, state_whole, until=lambda p: p.regather, regather=True),
        "4 micro-batches": lambda: lever(pins, state_whole, 4),
        "all": lambda: lever(split, zero(True), 4, until=every, recompute=True, regather=True),
    }
    return {name: cases[name]() for name in names or cases}


def levers(plan) -> str:
    """What the plan's own fields say it does."""
    shown = [f"{len(plan.optimizer_sharding)} states split" if plan.optimizer_sharding else "",
             f"{len(plan.gradient_sharding)} grads split" if plan.gradient_sharding else "",
             f"{sum(p[0] != 'R' for p in plan.parameters.values())} stored split on dp"
             if any(p[0] != "R" for p in plan.parameters.values()) else "",
             f"regather {'+'.join(plan.regather)}" if plan.regather else "",
             f"{len(plan.recompute)} layers recomputed" if plan.recompute else "",
             f"{plan.micro_batches} micro-batches" if plan.micro_batches > 1 else ""]
    return ", ".join(s for s in shown if s) or "-"


# ----------------------------------------------------------------------------------------------- measuring


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (a DTensor's: its local shard's), each storage once (a view or a
    slice shares its base's)."""
    seen = {}
    for t in map(local_tensor, tensors):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def gradients(local) -> list[torch.Tensor]:
    """Whole gradients and ZeRO-2's slices of them."""
    out = []
    for p in local.parameters():
        out += [g for g in (p.grad, getattr(p, "autotp_gradient_slice", None)) if g is not None]
    return out


def optimizer_state(optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def live_bytes(local, optimizer) -> dict:
    """What the rank holds between steps, by term; ``all`` counts a storage shared by two terms once."""
    terms = {"parameters": list(local.parameters()), "gradients": gradients(local),
             "optimizer": optimizer_state(optimizer), "buffers": list(local.buffers())}
    out = {term: storage_bytes(tensors) for term, tensors in terms.items()}
    out["all"] = storage_bytes([t for tensors in terms.values() for t in tensors])
    return out


def mark(name: str) -> None:
    """A zero-length event in the profile: where the step is."""
    with record_function(name):
        pass


def train_step(local, plan, optimizer, args, kwargs, grads_out: dict | None = None) -> None:
    accumulate(local, plan, *args, **kwargs)
    mark("step")
    if grads_out is not None:
        grads_out["bytes"] = storage_bytes(gradients(local))
    optimizer.step()
    mark("zero_grad")
    optimizer.zero_grad(set_to_none=True)


def timeline(prof) -> tuple[list, list]:
    """``([(ns, bytes)] of the memory events, [(ns, name)] of the markers)``, each in time order."""
    memory, marks = [], []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            memory.append((e.start_ns(), e.nbytes()))
        elif e.name() in ("forward", "backward", "step", "zero_grad"):
            marks.append((e.start_ns(), e.name()))
    return sorted(memory), sorted(marks)


def peak_of(memory: list, marks: list) -> dict:
    """The running sum's peak and the phase it falls in, and its value at the first forward pass's end."""
    running, peak, at = 0, 0, 0
    first_backward = next(ns for ns, name in marks if name == "backward")
    after_forward = None
    for ns, nbytes in memory:
        if after_forward is None and ns >= first_backward:
            after_forward = running
        running += nbytes
        if running > peak:
            peak, at = running, ns
    phase = [name for ns, name in marks if ns <= at][-1] if at else "start"
    return {"peak": peak, "phase": phase, "after_forward": after_forward}


def _measure(rank, world, plans):
    faulthandler.enable()  # a rank that crashes says where
    out = {}
    for name, plan in plans.items():
        model, args, kwargs = build(SPEC, meta=False)
        local = autotp.parallelize(model, plan)
        del model
        local.register_forward_pre_hook(lambda *_: mark("forward"))
        local.register_forward_hook(lambda *_: mark("backward"))
        optimizer = shard_optimizer(local, torch.optim.AdamW, **ADAMW)
        train_step(local, plan, optimizer, args, kwargs)  # the optimizer's state exists from here on
        wait_parameters(local)  # ZeRO's all-gathers after the first step landed: nothing pending at the start
        gc.collect()
        start, grads = live_bytes(local, optimizer), {}
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            train_step(local, plan, optimizer, args, kwargs, grads)
            # the all-gathers the step left pending land under the profiler that saw them start: waited after
            # it stops, or dropped with the case, they crash the process (SIGSEGV) now and then
            wait_parameters(local)
        out[name] = {"start": start, "gradients": grads["bytes"], **peak_of(*timeline(prof))}
    return out


# ----------------------------------------------------------------------------------------------- the table


def worst(per_rank: list, name: str, key: str) -> int:
    return max(r[name][key] for r in per_rank)


def measured_peak(per_rank: list, name: str) -> tuple[int, str]:
    """The largest peak over the ranks (live at the start + the most allocated beyond it), and its phase."""
    return max((r[name]["start"]["all"] + r[name]["peak"], r[name]["phase"]) for r in per_rank)


def totals(plans: dict, per_rank: list) -> None:
    print("| case | levers | predicted MB: parameters, gradients, optimizer, buffers, activations; peak | "
          "measured peak MB | measured / predicted | within 15% | peak in |")
    print("|---|---|---|---|---|---|---|")
    for name, plan in plans.items():
        m = plan.memory
        peak, phase = measured_peak(per_rank, name)
        ratio = peak / m["total"]
        terms = ", ".join(f"{m[t] / MB:.2f}" for t in TERMS)
        print(f"| {name} | {levers(plan)} | {terms}; **{m['total'] / MB:.2f}** | {peak / MB:.2f} | {ratio:.3f} | "
              f"{'yes' if abs(ratio - 1) <= 0.15 else 'NO'} | {phase} |")


def by_term(plans: dict, per_rank: list) -> None:
    print("| case | live at start MB, measured / predicted params + grads + optimizer + buffers | "
          "params MB pred / meas | optimizer MB pred / meas | grads MB pred / meas after backward | "
          "activations MB pred / meas after 1st forward | peak above start MB | peak - grads - after forward MB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, plan in plans.items():
        m = plan.memory
        start = {t: max(r[name]["start"][t] for r in per_rank) for t in ("parameters", "optimizer", "all")}
        persistent = sum(m[t] for t in ("parameters", "gradients", "optimizer", "buffers"))
        grads, forward, above = (worst(per_rank, name, k) for k in ("gradients", "after_forward", "peak"))
        beyond = max(r[name]["peak"] - r[name]["gradients"] - r[name]["after_forward"] for r in per_rank)
        print(f"| {name} | {start['all'] / MB:.2f} / {persistent / MB:.2f} | "
              f"{m['parameters'] / MB:.2f} / {start['parameters'] / MB:.2f} | "
              f"{m['optimizer'] / MB:.2f} / {start['optimizer'] / MB:.2f} | "
              f"{m['gradients'] / MB:.2f} / {grads / MB:.2f} | {m['activations'] / MB:.2f} / {forward / MB:.2f} | "
              f"{above / MB:.2f} | {beyond / MB:+.2f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all eight)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    plans = make_plans(args.cases.split(",") if args.cases else None)
    planned = time.perf_counter()
    per_rank = spawn(_measure, MESH.size, plans, timeout_s=600.0)
    print(f"Llama (4 layers, hidden 256, FFN 688, vocabulary 1024), batch 8 x 128, fp32, AdamW, mesh {MESH}; "
          f"MB = 10^6 bytes; measured: the largest over the {MESH.size} ranks\n")
    totals(plans, per_rank)
    print("\nBy term. Live at the start of the step: parameters, optimizer state and buffers (no gradients after "
          "zero_grad); the predicted column adds the gradients term. Gradients: counted after the last backward "
          "pass. After 1st forward: what the step allocated by the end of its first forward pass (what autograd "
          "keeps for backward, the logits and the loss; one micro-batch's). Last "
          "column: what the peak holds beyond the gradients and that forward's allocations (negative: "
          "activations freed before the gradients were all there)\n")
    by_term(plans, per_rank)
    print(f"\nplanned in {planned - started:.0f} s, measured in {time.perf_counter() - planned:.0f} s")


if __name__ == "__main__":
    main()
