"""Peak memory of materialising one rank's shards, per weight source: is it about total/N + replicated?

    python benchmarks/materialize_memory.py [--ranks 4] [--layers 4] [--hidden 1024] [--sources safetensors,mmap]

Writes a Llama's initial weights (random, fixed seed; about 530 MB in float32
at the defaults) as a ``torch.save`` file and a ``.safetensors`` file, plans
it for ``Mesh(N)`` (Hugging Face's tensor-parallel plan as pins, the rest by
the ILP under the H100 profile), then, in a fresh process per rank and per
source, builds the model with its parameters on ``meta`` and calls
``autotp.parallelize(..., weights=source)``. No process group is needed to
materialise, so the ranks run one after another.

Measured per process: the resident-set peak (``VmHWM``) minus the resident
set just before the weights are opened (the peak is reset there through
``/proc/self/clear_refs``), and what is still resident after. The sources:

- ``state dict``: ``torch.load`` of the whole file, then shards cut from it;
- ``mmap``: ``torch.load(..., mmap=True)``; file pages a read touches count as resident;
- ``safetensors``: `autotp.materialize.SafetensorsSource`, the file mapped for each block read (``safe_open``, ``get_slice``);
- ``none``: no weights (the shards stay on ``meta``): what capturing and lowering cost on their own.

``--sources`` measures only the sources named (default: all four).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCES = ("none", "state dict", "mmap", "safetensors")
MB = 1e6


def config(args) -> dict:
    return dict(vocab_size=32000, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                max_position_embeddings=64)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(workdir: Path, source_name: str, rank: int) -> dict:
    """One rank, one source, in this fresh process: peak and retained growth of the resident set, in bytes."""
    import autotp
    from autotp.materialize import SafetensorsSource, StateDictSource, empty_parameters
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((workdir / "config.json").read_text())
    plan = autotp.Plan.load(workdir / "plan.json")
    with empty_parameters():
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status_kb("VmRSS")
    if source_name == "none":
        source = None
    elif source_name == "safetensors":
        source = SafetensorsSource(workdir / "model.safetensors")
    else:
        source = StateDictSource(torch.load(workdir / "model.pt", mmap=source_name == "mmap", weights_only=True))
    local = autotp.parallelize(model, plan, rank=rank, groups={}, weights=source)
    peak, after = _status_kb("VmHWM"), _status_kb("VmRSS")
    held = sum(p.numel() * p.element_size() for p in local.parameters() if p.device.type != "meta")
    return {"peak": (peak - before) * 1024, "after": (after - before) * 1024, "shards": held}


def prepare(workdir: Path, args) -> dict:
    """Write the weights in both formats and the plan; return the model's byte counts."""
    import autotp
    from autotp.interop import hf_tp_plan_pins
    from autotp.materialize import save_safetensors
    from autotp.placement import local_shape, parse_layout
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = config(args)
    (workdir / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    state = model.state_dict()
    torch.save(state, workdir / "model.pt")
    save_safetensors(state, workdir / "model.safetensors")
    ids = torch.empty(1, 64, dtype=torch.long, device="meta")
    plan = autotp.plan(model, autotp.Mesh(str(args.ranks)), (ids,), {"labels": ids}, pin=hf_tp_plan_pins(model))
    plan.save(workdir / "plan.json")
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    replicated = sum(params[n].numel() * params[n].element_size() for n, layout in plan.parameters.items()
                     if all(x == "R" for x in layout))
    expected = sum(torch.Size(local_shape(params[n].shape, parse_layout(layout), plan.mesh.shape)).numel()
                   * params[n].element_size() for n, layout in plan.parameters.items())
    return {"total": total, "replicated": replicated, "expected": expected}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated, of: " + ", ".join(SOURCES))
    p.add_argument("--worker", nargs=3, metavar=("DIR", "SOURCE", "RANK"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        workdir, source, rank = args.worker
        print(json.dumps(worker(Path(workdir), source, int(rank))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        sizes = prepare(workdir, args)
        print(f"model {sizes['total'] / MB:.0f} MB, replicated {sizes['replicated'] / MB:.0f} MB, N = {args.ranks}: "
              f"expected per rank (total - replicated) / N + replicated = {sizes['expected'] / MB:.0f} MB\n")
        print("| source | rank | peak growth MB | retained MB | shards MB | peak / expected |")
        print("|---|---|---|---|---|---|")
        for source in args.sources.split(","):
            for rank in range(1 if source == "none" else args.ranks):
                out = subprocess.run([sys.executable, __file__, "--worker", str(workdir), source, str(rank)],
                                     capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"| {source} | {rank} | {r['peak'] / MB:.0f} | {r['after'] / MB:.0f} | {r['shards'] / MB:.0f} | "
                      f"{r['peak'] / sizes['expected']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
