"""Every script in benchmarks/ runs its own code path on a small case, so none of them rots unseen (issue 16).

Each test calls the script's ``main`` in this process, with the script's
small-case flag where it needs one (``--quick``, ``--layers 2``, ``--cases``,
``--sources``, ``--meshes``), reads the markdown tables it prints, and checks
what the benchmark claims of them: autotp's plan no slower than the plans it
is compared with, predicted and measured numbers finite and positive, memory
terms equal to the byte, the plans split. The figures of a small case mean
nothing; that the script gets to them, through the same planning, spawning
and measuring, is the point. About 80 s in all on 2 cores, most of it in the
five tests that start gloo processes or subprocesses.

What runs small, and what is left out:

- ``baselines.py``: one of tests/test_optimal.py's ten cases (that file plans
  and checks all ten); ``plan_time.py``: the GPT row (the 70B rows take minutes);
- ``big_plans.py`` and ``fit_70b.py``: the one-node case with 2 of the 80
  layers; their multi-node cases (30 s and more even at 2 layers) print
  through the same code;
- ``memory_fidelity.py``: the ZeRO-1 case of eight (every case is measured by
  the same code; tests/test_levers_combined.py runs each lever exact);
  ``materialize_memory.py``: the safetensors source of four, 2 ranks (each
  source is one more subprocess of the same worker);
- ``fuzz.py``: one seed on mesh 2 (tests/test_fuzz.py runs six on 2 and 3);
- ``report_pictures.py`` is left out as a run: it is one ``autotp plan --svg
  --chart`` command that takes about 20 s (a 4-layer Llama on 2x2 with its
  baselines), and tests/test_report.py runs that command's path on a small
  Llama. Here the CLI's own parser reads its command line, so a flag it
  passes that the CLI no longer takes fails;
- ``moe_plans.py``: Mixtral-8x7B with 1 of its 32 layers; ``decode_70b.py``:
  2 of the 80 layers, a 128-position cache, two of its three cases;
  ``runtime.py`` and ``decode_runtime.py``: ``--quick`` (2 processes, one
  small layer, one round);
- ``shapes.py`` is a helper, run here through big_plans, fit_70b and
  layer_scaling;
- ``gpu_check.py`` (for a machine with GPUs) runs on CPU under torchrun with
  2 gloo processes and the ``aot_eager`` backend, 20 s.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import baselines  # noqa: E402
import big_plans  # noqa: E402
import cost_fidelity  # noqa: E402
import decode_70b  # noqa: E402
import decode_runtime  # noqa: E402
import fit_70b  # noqa: E402
import fuzz  # noqa: E402
import hf_models  # noqa: E402  (examples/, on the path through conftest)
import layer_scaling  # noqa: E402
import materialize_memory  # noqa: E402
import memory_fidelity  # noqa: E402
import moe_plans  # noqa: E402
import plan_time  # noqa: E402
import report_pictures  # noqa: E402
import runtime  # noqa: E402
import transformers_plans  # noqa: E402
from autotp.calibrate.measure import COLLECTIVES  # noqa: E402
from autotp.cli import build_parser  # noqa: E402
from autotp.report.baselines import NAMES  # noqa: E402
from test_optimal import CASES, GPT2  # noqa: E402


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(out: str) -> list[list[dict]]:
    """Every markdown table printed in ``out``, in order, each a list of ``{column: cell}`` rows."""
    lines, found = out.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            head, rows = _cells(lines[i - 1]), []
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                assert len(_cells(row)) == len(head), (head, row)
                rows.append(dict(zip(head, _cells(row))))
            found.append(rows)
    return found


def number(cell: str) -> float:
    """The number a cell starts with: ``'1.23 ms'``, ``'**0.99**'``, ``'8,302'``."""
    return float(cell.strip("*").split()[0].replace(",", ""))


def positive(*cells: str) -> bool:
    return all(math.isfinite(number(c)) and number(c) > 0 for c in cells)


# ---- planning on the meta device ---------------------------------------------------------------------------------


def test_baselines_row_autotp_is_no_slower_than_any_baseline(capsys):
    case = next(c for c in CASES if c[0] is GPT2 and c[1] == "4")
    baselines.main([case])
    (rows,) = tables(capsys.readouterr().out)
    (row,) = rows
    assert row["case"] == "gpt2256-4-nvlink-h100-hgx"
    assert positive(row["autotp"], *(row[name] for name in NAMES if row[name] != "n/a"))
    assert number(row["autotp / best"]) <= 1.0
    assert abs(number(row["objective - total"])) < 1e-9


def test_plan_time_stages_add_up_to_the_plan(capsys):
    plan_time.main(["--only", "gpt", "--solvers", "highs"])
    (rows,) = tables(capsys.readouterr().out)
    (row,) = rows
    assert row["model"] == "gpt" and row["mesh"] == "4"
    assert positive(row["ops"], row["variables"], row["constraints"], row["objective ms"], row["total s"])
    stages = ("capture s", "strategies s", "costing s", "ILP build s", "solve s")
    assert all(number(row[s]) >= 0 for s in stages)
    assert sum(number(row[s]) for s in stages) <= number(row["total s"]) + 0.03  # 2 decimals each


def test_layer_scaling_shared_variables_same_optimum_and_plots(capsys, tmp_path):
    svg, plan_svg = tmp_path / "solve.svg", tmp_path / "plan.svg"
    layer_scaling.main(["--layers", "2", "--mesh", "2", "--svg", str(svg), "--plan-svg", str(plan_svg)])
    (rows,) = tables(capsys.readouterr().out)
    assert [(r["share_layers"], r["replay_layers"]) for r in rows] == [(str(s), str(r)) for s, r in
                                                                        layer_scaling.SETTINGS]
    assert len({r["ops"] for r in rows}) == 1 and len({r["objective ms"] for r in rows}) == 1
    shared = next(r for r in rows if r["share_layers"] == "True")
    unshared = next(r for r in rows if r["share_layers"] == "False")
    assert number(shared["variables"]) < number(unshared["variables"])
    assert all(positive(r["plan s"], r["objective ms"]) for r in rows)
    for path in (svg, plan_svg):
        lines = ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}polyline")
        assert len(list(lines)) == len(layer_scaling.SETTINGS)


def test_transformers_plans_every_family_planned_and_split(capsys):
    transformers_plans.main(["--mesh", "4"])
    (rows,) = tables(capsys.readouterr().out)
    assert len(rows) == len(hf_models.FAMILIES)
    for row in rows:
        assert positive(row["ops"], row["plan s"], row["step ms"]), row
        assert row["forward / layer"] != "none", row  # at these sizes every family splits over 4 H100s


def test_big_plans_70b_on_one_node_with_two_layers(capsys):
    big_plans.main(["--only", "70b-8", "--layers", "2"])
    out = capsys.readouterr().out
    assert "Error" not in out
    step = re.search(r"predicted step: ([\d.]+) ms = compute ([\d.]+) ms \+ communication ([\d.]+) ms", out)
    assert step and all(float(x) > 0 for x in step.groups())
    (rows,) = tables(out)
    layouts = {r["parameter"]: (r["axis0"], r["layers"]) for r in rows}
    assert layouts["model.layers.*.self_attn.q_proj.weight"] == ("S(0)", "2")  # Megatron's column, then row
    assert layouts["model.layers.*.self_attn.o_proj.weight"] == ("S(1)", "2")


def test_fit_70b_one_node_with_two_layers_against_megatron(capsys):
    fit_70b.main(["--only", "8-1", "--layers", "2"])
    out = capsys.readouterr().out
    mfu = [float(x) for x in re.findall(r"MFU ([\d.]+)%", out)]
    assert len(mfu) == 2 and all(0 < x <= 100 for x in mfu)  # autotp's and the Megatron-style baseline's
    assert "of 2 layers recomputed" in out
    ratio = re.search(r"autotp / megatron-sp = ([\d.]+)", out)
    assert ratio and float(ratio.group(1)) <= 1.0
    assert "FSDP (ZeRO-3 over every device, one micro-batch a step): n/a" in out  # a batch of 1 over 8 devices


def test_decode_70b_two_layers_no_slower_per_token_than_megatron(capsys):
    decode_70b.main(["--layers", "2", "--only", "8-1,2x4-1", "--prompt", "64", "--max-length", "128",
                     "--serving", "2"])
    rows, serving = tables(capsys.readouterr().out)
    assert [r["case"] for r in rows] == ["mesh 8 (nvlink), batch 1", "mesh 2x4 (infiniband,nvlink), batch 1"]
    for r in rows:
        assert float(r["autotp/megatron"]) <= 1.0 + 1e-9, r
        assert 0 < float(r["decode ms/token"]) < float(r["prefill ms"]), r
        assert r["cache layout"] != "whole", r  # the kv-heads divide: the cache is split
    chosen = {r["target"].strip("*"): r for r in serving if r["target"].startswith("**")}
    assert set(chosen) == {"latency", "throughput"}
    latency = [r for r in serving if r["target"].strip("*") == "latency"]
    throughput = [r for r in serving if r["target"].strip("*") == "throughput"]
    assert float(chosen["latency"]["ms/token"]) == min(float(r["ms/token"]) for r in latency)
    assert float(chosen["throughput"]["tokens/s/device"]) == max(float(r["tokens/s/device"]) for r in throughput)
    assert int(chosen["throughput"]["batch"]) > 1  # the largest batch that fits, not one row


def test_moe_plans_one_layer_the_ilp_no_slower_than_any_way_of_splitting_experts(capsys):
    moe_plans.main(["--layers", "1"])
    found = tables(capsys.readouterr().out)
    assert len(found) == 2  # mixed precision unlimited, bf16 under the default limit
    for rows in found:
        assert [r["experts"] for r in rows] == list(moe_plans.WAYS)
        steps = {r["experts"]: number(r["step (ms)"]) for r in rows if not r["step (ms)"].startswith("does not")}
        assert steps["ilp"] <= min(steps.values())
        routed = {r["experts"]: number(r["all-to-all"]) for r in rows}
        assert routed["expert-parallel"] > 0 and routed["tokens-split"] == routed["replicated"] == 0


def test_report_pictures_command_is_one_the_cli_accepts(tmp_path):
    args = build_parser().parse_args(report_pictures.command(tmp_path))
    assert (args.command, args.model, args.mesh) == ("plan", "hf:llama", "2x2")
    assert (args.layers, args.hidden, args.heads, args.kv_heads) == (4, 1024, 16, 4)
    assert (Path(args.svg), Path(args.chart)) == (tmp_path / "plan.svg", tmp_path / "baselines.svg")


# ---- on gloo processes --------------------------------------------------------------------------------------------


def test_cost_fidelity_quick(capsys):
    cost_fidelity.main(["--quick"])
    out = capsys.readouterr().out
    collectives, plans = tables(out)
    assert len(collectives) == len(COLLECTIVES) * len(cost_fidelity.QUICK["sizes"])
    assert all(positive(r["predicted ms"], r["measured ms"]) for r in collectives)
    assert [r["plan"] for r in plans] == ["autotp", "megatron", "data-parallel", "replicated", "row-only",
                                          "column-only"]
    assert all(positive(r["predicted ms"], r["measured ms"]) for r in plans)
    predicted = {r["plan"]: number(r["predicted ms"]) for r in plans}
    assert predicted["autotp"] == min(predicted.values())  # the others are points of its search space
    collectives_of = {r["plan"]: int(r["forward collectives"]) for r in plans}
    assert collectives_of["replicated"] == 0 and collectives_of["megatron"] > 0
    rho = re.search(r"Spearman rank correlation: (-?[\d.]+);", out)
    assert rho and -1 <= float(rho.group(1)) <= 1


def test_runtime_quick_every_way_steps(capsys):
    runtime.main(["--quick"])
    out = capsys.readouterr().out
    (rows,) = tables(out)
    by = {r["variant"]: r for r in rows}
    assert list(by) == [f"autotp ({runtime.PROFILE})", f"autotp ({runtime.PROFILE}), compiled", "autotp (calibrated)",
                        "autotp data-parallel plan", "DDP", "DTensor + HF tp_plan", "one process", "autotp, mesh of 1"]
    assert all(positive(r["step (ms, median)"]) for r in rows)
    assert number(by["DDP"]["× DDP"]) == 1.0
    assert all(positive(by[v]["predicted (ms)"]) for v in list(by)[:4])
    assert int(by["one process"]["collectives / step"]) == 0
    assert int(by["DTensor + HF tp_plan"]["collectives / step"]) > 0
    # the data-parallel plan sums the same gradients DDP does (and a loss of two numbers besides)
    assert positive(by["DDP"]["MiB moved / step"])
    assert by["autotp data-parallel plan"]["MiB moved / step"] == by["DDP"]["MiB moved / step"]


def test_decode_runtime_quick_every_way_generates_one_process_tokens(capsys):
    # non-zero when a way's tokens differ from one process's; GPT-2 has no tp_plan, so no DTensor ways
    assert decode_runtime.main(["--quick", "--families", "llama,gpt2"]) == 0
    llama, gpt2 = tables(capsys.readouterr().out)
    assert [r["way"] for r in llama] == [f"autotp ({runtime.PROFILE})", "autotp, HF tp_plan pinned",
                                         "DTensor + HF tp_plan", "one process", "autotp, mesh of 1"]
    assert [r["way"] for r in gpt2] == [f"autotp ({runtime.PROFILE})", "one process", "autotp, mesh of 1"]
    for rows in (llama, gpt2):
        assert all(r["tokens"] == "as one process" for r in rows)
        assert all(positive(r["prefill (ms, median)"]) and positive(r["per token (ms, median)"]) for r in rows)
    by = {r["way"]: r for r in llama}
    assert by["one process"]["collectives: prefill, per token"] == "0, 0"
    # the same split two ways: both send something every token
    for way in ("autotp, HF tp_plan pinned", "DTensor + HF tp_plan"):
        assert int(by[way]["collectives: prefill, per token"].split(",")[1]) > 0, way
    assert positive(by["autotp, HF tp_plan pinned"]["predicted per token (ms)"])


def test_memory_fidelity_terms_exact_and_peak_within_its_tolerance(capsys):
    memory_fidelity.main(["--cases", "ZeRO-1"])
    (total,), (terms,) = tables(capsys.readouterr().out)
    assert total["case"] == "ZeRO-1" and "states split" in total["levers"]
    assert total["within 15%"] == "yes", total
    for column in ("params MB pred / meas", "optimizer MB pred / meas", "grads MB pred / meas after backward"):
        predicted, measured = terms[column].split(" / ")
        assert predicted == measured and float(predicted) > 0, column  # exact, as its docstring says (to 10 kB here)
    # ZeRO-1 on dp=2: AdamW's two moments, split, are the size of the parameters, not twice it
    assert number(terms["optimizer MB pred / meas"]) < 2 * number(terms["params MB pred / meas"])


def test_materialize_memory_shards_are_the_expected_bytes(capsys):
    materialize_memory.main(["--ranks", "2", "--layers", "1", "--hidden", "64", "--sources", "safetensors"])
    out = capsys.readouterr().out
    expected = re.search(r"\+ replicated = (\d+) MB", out)
    (rows,) = tables(out)
    assert [(r["source"], r["rank"]) for r in rows] == [("safetensors", "0"), ("safetensors", "1")]
    for row in rows:
        assert row["shards MB"] == expected.group(1)
        assert positive(row["peak growth MB"], row["peak / expected"])


def test_fuzz_main_one_seed_on_mesh_2(capsys):
    fuzz.main(["--cases", "2", "--meshes", "2"])
    out = capsys.readouterr().out
    assert "mesh 2: 2 cases, 0 planning failures" in out
    assert re.search(r"^2 cases, 0 failures", out, re.M) and "FAIL" not in out


def test_gpu_check_runs_its_path_on_cpu_under_torchrun(tmp_path):
    """benchmarks/gpu_check.py, made for the first GPU machine, on 2 gloo processes: calibration, both plans
    compiled (``aot_eager``), exact, timed; the Megatron plan splits weights, so exactness is not a replicated
    plan's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path / "profile"),
           "--compile-backend", "aot_eager", "--max-size", "65536", "--repeats", "1"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list((tmp_path / "profile").glob("*.json")), "no calibrated profile written"
    split = dict(re.findall(r"^(\w+): (\d+) of \d+ parameters split", done.stdout, re.M))
    assert set(split) == {"autotp", "megatron"} and int(split["megatron"]) > 0, done.stdout
    (rows,) = tables(done.stdout)
    assert [r["step"] for r in rows] == ["one device", "autotp eager", "autotp compiled", "megatron eager",
                                         "megatron compiled"]
    assert all(positive(r["ms"]) for r in rows)
