"""Serving Llama-2-70B: predicted prefill time, time per decoded token, cache memory and the placements chosen.

Llama-2-70B (bf16, 80 layers, 64 heads and 8 kv-heads) on the meta device,
its prefill and decode steps planned together by
`autotp.decoding.plan_decoding` under `h100-hgx` and the default memory
limit (80 GB less 5%: weights and the key/value cache must fit), for a
context of ``--max-length`` positions of which ``--prompt`` are the prompt.
Per case: the predicted prefill and per-token decode times, the weights and
the cache per device, the cache's layout, layer 0's weight layouts, the
planning time, and the same steps with Megatron's split of every layer
pinned (heads and MLP split over every device), costed in the same model,
with autotp's per-token time over it.

Then the serving plans on ``--serving`` (mesh 8 unless given) of
`autotp.serving.plan_serving`: the latency-optimal one (the fastest token
at batch 1) and the throughput-optimal one (the most generated tokens per
second per device, the prefill counted, at the largest batch that fits, on
as many devices per replica as pays), each with every option it weighed.

Run: ``python benchmarks/decode_70b.py [--only 8-1,8-64,2x4-1] [--serving 8] [--layers N] [--prompt P]
[--max-length L]`` (``--layers 2``: a quick check that the script runs, as tests/test_benchmarks.py does;
``--serving none``: no serving plans)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import autotp  # noqa: E402
import shapes  # noqa: E402
from autotp.decoding import plan_decoding  # noqa: E402
from autotp.serving import plan_serving  # noqa: E402
from autotp.units import format_bytes  # noqa: E402

CASES = {  # name -> (mesh, links, batch)
    "8-1": ("8", "nvlink", 1),
    "8-64": ("8", "nvlink", 64),
    "2x4-1": ("2x4", "infiniband,nvlink", 1),  # two 4-GPU hosts: the slower axis may be split less
}
MEGATRON = {"self_attn.q_proj": "S(0)", "self_attn.k_proj": "S(0)", "self_attn.v_proj": "S(0)",
            "self_attn.o_proj": "S(1)", "mlp.gate_proj": "S(0)", "mlp.up_proj": "S(0)", "mlp.down_proj": "S(1)"}
COLUMNS = ("case", "prefill ms", "decode ms/token", "weights/device", "cache/device", "prefill peak activations",
           "memory/device", "cache layout",
           "layer 0 (q k v o gate up down)", "planned in s", "megatron ms/token", "autotp/megatron")


def megatron_pin(mesh: autotp.Mesh, layers: int) -> dict:
    """Megatron's split of every layer over every device (one axis: that axis; several: all of them at once is
    not a layout, so the last, fastest axis, with the others whole)."""
    whole = ("R",) * (len(mesh.shape) - 1)
    return {f"model.model.layers.{i}.{m}.weight": whole + (layout,) for i in range(layers)
            for m, layout in MEGATRON.items()}


def layer0(plan) -> str:
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    layouts = {fqn.split(".")[-2]: "/".join(v) for fqn, v in plan.parameters.items() if ".layers.0." in fqn}
    return " ".join(layouts[n] for n in names)


def row(name: str, layers: int, prompt: int, max_length: int) -> dict:
    mesh_shape, links, batch = CASES[name]
    mesh = autotp.Mesh(mesh_shape, links=links)
    model, _, _ = shapes.llama2_70b(layers=layers, batch=batch)
    started = time.perf_counter()
    plans = plan_decoding(model, mesh, batch, prompt, max_length, profile="h100-hgx")
    planned = time.perf_counter() - started
    megatron = plan_decoding(model, mesh, batch, prompt, max_length, profile="h100-hgx",
                             pin=megatron_pin(mesh, layers))
    decode, prefill = plans.decode, plans.prefill
    cache = sorted({" ".join(v) for k, v in decode.buffers.items() if k.startswith("cache_")}) or ["whole"]
    per_token, reference = decode.predicted["total_s"], megatron.decode.predicted["total_s"]
    return {"case": f"mesh {mesh_shape} ({links}), batch {batch}",
            "prefill ms": f"{prefill.predicted['total_s'] * 1e3:.2f}",
            "decode ms/token": f"{per_token * 1e3:.3f}",
            "weights/device": format_bytes(decode.memory["parameters"]),
            "cache/device": format_bytes(decode.memory["buffers"]),
            "prefill peak activations": format_bytes(prefill.memory["activations"]),
            "memory/device": format_bytes(plans.peak_bytes),
            "cache layout": ", ".join(cache), "layer 0 (q k v o gate up down)": layer0(decode),
            "planned in s": f"{planned:.1f}", "megatron ms/token": f"{reference * 1e3:.3f}",
            "autotp/megatron": f"{per_token / reference:.3f}"}


SERVING_COLUMNS = ("target", "devices per replica", "replicas", "batch", "ms/token", "tokens/s/device",
                   "memory/device", "prefill peak activations", "planned in s")


def serving_rows(mesh_shape: str, layers: int, prompt: int, max_length: int) -> list[dict]:
    """The latency-optimal and the throughput-optimal serving plans, with every option each weighed."""
    model, _, _ = shapes.llama2_70b(layers=layers, batch=1)
    mesh = autotp.Mesh(mesh_shape, links="nvlink" if "x" not in mesh_shape else "infiniband,nvlink")
    rows = []
    for target in ("latency", "throughput"):
        started = time.perf_counter()
        serving = plan_serving(model, mesh, prompt, max_length, target=target, profile="h100-hgx")
        planned = time.perf_counter() - started
        for option in serving.options:
            chosen = option is serving.chosen
            row = {"target": f"**{target}**" if chosen else target, "devices per replica": str(option.devices),
                   "replicas": str(option.replicas), "batch": str(option.batch)}
            if option.plans is None:
                row.update(dict.fromkeys(SERVING_COLUMNS[4:], ""), **{"ms/token": option.note})
            else:
                row.update({"ms/token": f"{option.latency_s * 1e3:.3f}",
                            "tokens/s/device": f"{option.tokens_per_s:.1f}",
                            "memory/device": format_bytes(option.memory_bytes),
                            "prefill peak activations": format_bytes(option.plans.prefill.memory["activations"]),
                            "planned in s": f"{planned:.1f}" if chosen else ""})
            rows.append(row)
    return rows


def _table(columns, rows) -> None:
    """``rows`` (dicts keyed by ``columns``) as a Markdown table."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(r[c] for c in columns) + " |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--layers", type=int, default=80, help="decoder layers (fewer: a quick check)")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens a row")
    parser.add_argument("--max-length", type=int, default=4096, help="cache positions: prompt and new tokens")
    parser.add_argument("--serving", default="8", help="the mesh of the serving plans ('none': no serving plans)")
    args = parser.parse_args(argv)
    print(f"\nLlama-2-{'70B' if args.layers == 80 else f'70B-shaped ({args.layers} layers)'}, h100-hgx, prompt "
          f"{args.prompt}, cache {args.max_length} positions\n")
    _table(COLUMNS, [row(name, args.layers, args.prompt, args.max_length) for name in args.only.split(",")])
    if args.serving != "none":
        print(f"\nServing on mesh {args.serving}: the latency-optimal and the throughput-optimal plan (in bold), "
              "beside every option each weighed\n")
        _table(SERVING_COLUMNS, serving_rows(args.serving, args.layers, args.prompt, args.max_length))


if __name__ == "__main__":
    main()
