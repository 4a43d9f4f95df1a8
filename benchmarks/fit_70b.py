"""Plans that fit: Llama-2-70B under the default memory limit, with the ILP's memory levers, and its MFU.

Llama-2-70B (bf16, mixed-precision training: 18 bytes a parameter; 80
layers, sequence 4096) on the meta device, planned with `autotp.plan`'s
defaults (memory limit: the profile's 80 GB less 5%; optimizer state
splitting, recomputation, regathering, micro-batches and collective matmuls
all allowed) under `h100-hgx`.
Per case: the predicted step, the levers the plan took, memory per device by
term, planning time, the Megatron-style baseline costed in the same model
(`autotp.report.baselines`, ``megatron-sp`` under the same limit), the FSDP
one (``fsdp``: ZeRO-3 over every device, where the batch splits over all of
them), and the model FLOPs utilisation

    MFU = 6 * parameters * tokens / (step * devices * 989 TFLOP/s)

(the dense bf16 peak of an H100 SXM, as the issue that asked for it counts).

Run: ``python benchmarks/fit_70b.py [--only 4x8-8,4x8-64,8-1] [--recompute-layers] [--micro-batches K]
[--layers N]`` (the second: any number of the layers recomputed, `plan(recompute="layers")`; the Megatron-style
baseline keeps all or none; the third fixes the micro-batch count instead of searching it, which is quicker; the
last plans N of the 80 layers, a quick check that the script runs, as tests/test_benchmarks.py does)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import autotp  # noqa: E402
import shapes  # noqa: E402
from autotp.capture.micro import micro_batch  # noqa: E402
from autotp.report.baselines import baseline_plans  # noqa: E402
from autotp.units import format_bytes  # noqa: E402

PEAK_FLOPS = 989e12  # H100 SXM dense bf16, the MFU convention of the issue
CASES = {  # name -> (mesh, links, global batch)
    "4x8-8": ("4x8", "infiniband,nvlink", 8),
    "4x8-64": ("4x8", "infiniband,nvlink", 64),
    "8-1": ("8", "nvlink", 1),
}


def report(name: str, recompute=True, micro_batches="auto", layers: int = 80) -> None:
    mesh_shape, links, batch = CASES[name]
    model, args, kwargs = shapes.llama2_70b(layers=layers, batch=batch)
    params = sum(t.numel() for t in model.parameters())
    mesh = autotp.Mesh(mesh_shape, links=links)
    started = time.perf_counter()
    print(f"\n### Llama-2-70B, mesh {mesh}, global batch {batch} x 4096")
    try:
        plan = autotp.plan(model, mesh, args, kwargs, profile="h100-hgx", recompute=recompute,
                           micro_batches=micro_batches)
    except autotp.AutotpError as exc:
        print(f"\n{type(exc).__name__} after {time.perf_counter() - started:.1f} s: {exc}")
        return
    p = plan.predicted
    tokens = batch * 4096
    mfu = 6 * params * tokens / (p["total_s"] * mesh.size * PEAK_FLOPS)
    print(f"\nplanned in {plan.stats['plan_s']:.1f} s; predicted step {p['total_s'] * 1e3:.1f} ms (compute "
          f"{p['compute_s'] * 1e3:.1f} of which recompute {p['recompute_s'] * 1e3:.1f}, communication "
          f"{p['comm_s'] * 1e3:.1f}, hidden {p['hidden_s'] * 1e3:.1f}: gradient sums {p['gradient_hidden_s'] * 1e3:.1f}, "
          f"ZeRO all-gathers {p['gather_hidden_s'] * 1e3:.1f}, tensor-parallel collectives behind their matmuls "
          f"{p['overlap_hidden_s'] * 1e3:.1f}); MFU {mfu:.1%}")
    print(f"levers: {plan.micro_batches} micro-batches of {batch // plan.micro_batches}; "
          f"{len(plan.recompute)} of {layers} layers recomputed; optimizer state split for "
          f"{len(plan.optimizer_sharding)} of {len(plan.parameters)} parameters "
          f"({', '.join(sorted({'+'.join(a) for a in plan.optimizer_sharding.values()})) or 'none'}), "
          f"the gradient too for {len(plan.gradient_sharding)} (ZeRO-2); gathered again in backward: "
          f"{', '.join(plan.regather) or 'nothing'}")
    print("memory per device: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.memory.items()))
    layouts = sorted({(fqn.split(".")[-2], tuple(layout)) for fqn, layout in plan.parameters.items()
                      if ".layers.0." in fqn})
    print("layer 0 weights: " + ", ".join(f"{m} {'/'.join(l)}" for m, l in layouts))
    compare(model, mesh, args, kwargs, params, tokens, p["total_s"])


def compare(model, mesh, args, kwargs, params: int, tokens: int, autotp_s: float) -> None:
    """Megatron-LM's recipe costed in the same model: TP + SP on the fast axis, its distributed optimizer and
    recomputation as the limit needs them; the step as one micro-batch, and as micro-batches of one sequence
    per data-parallel rank (Megatron's usual micro-batch size). Then FSDP, one micro-batch a step."""
    for k in dict.fromkeys((1, max(1, args[0].shape[0] // mesh.shape[0]))):
        margs, mkwargs = micro_batch(args, kwargs, k)
        baseline, = baseline_plans(model, mesh, margs, mkwargs, names=("megatron-sp",), profile="h100-hgx",
                                   micro_batches=k)
        show(f"megatron-style (TP+SP on tp, ZeRO and recomputation as needed, {k} micro-batch(es) a step)",
             baseline, mesh, params, tokens, autotp_s)
    baseline, = baseline_plans(model, mesh, args, kwargs, names=("fsdp",), profile="h100-hgx", micro_batches=1)
    show("FSDP (ZeRO-3 over every device, one micro-batch a step)", baseline, mesh, params, tokens, autotp_s)


def show(what: str, baseline, mesh, params: int, tokens: int, autotp_s: float) -> None:
    """One baseline's line: its step, MFU and levers, and autotp's step over it; or why there is none."""
    if baseline.plan is None:
        print(f"{what}: n/a, {baseline.reason.splitlines()[0]}")
        return
    p = baseline.plan
    mfu = 6 * params * tokens / (p.predicted["total_s"] * mesh.size * PEAK_FLOPS)
    print(f"{what}: {p.predicted['total_s'] * 1e3:.1f} ms, MFU {mfu:.1%}, {len(p.recompute)} layers recomputed, "
          f"optimizer state split for {len(p.optimizer_sharding)} parameters, gathered again in backward: "
          f"{', '.join(p.regather) or 'nothing'}; autotp / {baseline.name} = {autotp_s / p.predicted['total_s']:.3f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--recompute-layers", dest="recompute", action="store_const", const="layers", default=True,
                        help="let autotp recompute any number of the 80 layers, not only all or none")
    parser.add_argument("--micro-batches", dest="micro_batches", default="auto",
                        type=lambda v: v if v == "auto" else int(v),
                        help="fix the number of micro-batches (default: the planner searches them)")
    parser.add_argument("--layers", type=int, default=80, help="decoder layers (fewer: a quick check)")
    args = parser.parse_args(argv)
    for name in args.only.split(","):
        report(name, args.recompute, args.micro_batches, args.layers)


if __name__ == "__main__":
    main()
