"""The plan as something people read: folded tables, baselines, re-costing, explanations, SVG graph and chart.

One small Llama (2 layers, hidden 64) built from its config on the meta
device is planned once through the command line (module fixture) under the
compute-bound profile, so its weights really are split; the tests then read
what that run wrote.
"""

from __future__ import annotations

import io
import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch

from autotp.cli import main
from autotp.cost.profile import load_profile
from autotp.model_spec import ModelSpec, build
from autotp.progress import Stages
from autotp.report.chart import TIME_COLORS
from autotp.report.collapse import collapse
from autotp.report.explain import ExplainError, explain_node, resolve
from autotp.report.rebuild import all_strategies, chosen_strategies, rebuild_graph
from autotp.solve.plan import Plan
from conftest import weights_bound_profile

LLAMA = ["hf:llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
         "--vocab", "128", "--batch", "4", "--seq", "8"]


def test_identical_layers_fold_and_odd_ones_are_named():
    items = [(f"layers.{i}.q.weight", ("S(0)",)) for i in range(4)]
    items += [(f"layers.{i}.o.weight", ("S(1)",) if i < 3 else ("R",)) for i in range(4)] + [("head.weight", ("R",))]
    rows = [(r.name, r.values, r.count) for r in collapse(items)]
    assert rows == [("layers.*.q.weight", ("S(0)",), 4), ("layers.[0-2].o.weight", ("S(1)",), 3),
                    ("layers.3.o.weight", ("R",), 1), ("head.weight", ("R",), 1)]


def test_stages_report_on_the_stream_given_and_nothing_when_disabled():
    stream = io.StringIO()
    with Stages(stream=stream).stage("solving ILP") as stage:
        stage.detail = "42 variables"
    assert stream.getvalue().startswith("solving ILP… 42 variables, ") and stream.getvalue().endswith(" s\n")
    quiet = io.StringIO()
    with Stages(enabled=False, stream=quiet).stage("capturing"):
        pass
    assert quiet.getvalue() == ""


def test_hf_models_build_the_same_real_weights_in_every_process_and_meta_when_planning():
    spec = ModelSpec("hf:gpt2", {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64}, batch=2, seq=8)
    (a, args, kwargs), (b, _, _) = build(spec, meta=False), build(spec, meta=False)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert args[0].shape == (2, 8) and torch.equal(kwargs["labels"], args[0])
    assert a.config.n_positions >= 8 and a.config.resid_pdrop == 0.1  # the config's dropout: verify checks it
    meta, _, _ = build(spec, meta=True, training=False)
    assert all(p.is_meta for p in meta.parameters()) and not meta.training


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One CLI run writing the plan, the SVG graph and chart and an HF tp_plan; its stdout."""
    tmp = tmp_path_factory.mktemp("report")
    profile = tmp / "weights-bound.json"
    profile.write_text(json.dumps(weights_bound_profile()))
    paths = {k: tmp / name for k, name in (("json", "p.json"), ("svg", "p.svg"), ("chart", "chart.svg"), ("tp", "tp.json"))}
    out = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out):
        rc = main(["plan", *LLAMA, "--mesh", "2", "--profile", str(profile), "--json", str(paths["json"]),
                   "--svg", str(paths["svg"]), "--chart", str(paths["chart"]), "--export-tp-plan", str(paths["tp"]),
                   "--quiet"])
    assert rc == 0
    return dict(paths, stdout=out.getvalue(), profile=profile, tmp=tmp)


def _run(capsys, *argv):
    rc = main([*argv, "--quiet"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_report_folds_layers_and_compares_baselines(planned):
    out = planned["stdout"]
    plan = Plan.load(planned["json"])
    q = plan.parameters["model.layers.0.self_attn.q_proj.weight"]
    assert plan.parameters["model.layers.1.self_attn.q_proj.weight"] == q
    # the layout on each axis, then where the optimizer state is split (if it is, for any parameter), then the count
    assert any(line.split()[:len(q) + 1] == ["model.layers.*.self_attn.q_proj.weight", *q]
               and line.split()[-1] == "×2" for line in out.splitlines())
    assert any(p != "R" for layout in plan.parameters.values() for p in layout)  # really split
    header = next(line for line in out.splitlines() if "replicated" in line and "megatron" in line)
    assert header.split() == ["autotp", "replicated", "data-parallel", "megatron", "megatron-sp", "fsdp"]
    verdict = next(line for line in out.splitlines() if line.startswith("autotp: "))
    assert "x the best baseline (" in verdict and float(verdict.split(", ")[1].split("x")[0]) <= 1.0
    assert plan.source == {"model": "hf:llama", "batch": 4, "seq": 8,
                           "config": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                      "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 128}}


def test_saved_plan_is_recosted_with_the_same_placements(planned, capsys, tmp_path):
    assert Plan.load(planned["json"]).to_json() == planned["json"].read_text()  # canonical, source included
    recosted = tmp_path / "recosted.json"
    rc, out, _ = _run(capsys, "plan", str(planned["json"]), "--profile", "h100-hgx", "--json", str(recosted),
                      "--no-baselines")
    assert rc == 0 and "under profile 'h100-hgx'" in out
    old, new = Plan.load(planned["json"]), Plan.load(recosted)
    assert new.nodes == old.nodes and new.parameters == old.parameters and new.source == old.source
    assert new.predicted["total_s"] != old.predicted["total_s"]  # other hardware, other time


def test_tp_plan_round_trips_through_the_command_line(planned, capsys, tmp_path):
    styles = json.loads(planned["tp"].read_text())
    assert styles  # the split Linear layers, named the Hugging Face way
    imported = tmp_path / "imported.json"
    rc, _, _ = _run(capsys, "plan", *LLAMA, "--mesh", "2", "--profile", str(planned["profile"]), "--tp-plan",
                    str(planned["tp"]), "--json", str(imported), "--no-baselines")
    assert rc == 0
    old, new = Plan.load(planned["json"]), Plan.load(imported)
    for pattern in styles:
        for fqn in old.parameters:
            if fqn.endswith(".weight") and fqn.replace(".0.", ".*.").replace(".1.", ".*.") == pattern + ".weight":
                assert new.parameters[fqn] == old.parameters[fqn]


def test_explain_uses_the_costs_the_plan_was_made_with(planned, capsys):
    plan = Plan.load(planned["json"])
    model, args, kwargs = build(ModelSpec.from_source(plan.source), meta=True)
    graph = rebuild_graph(model, args, kwargs)
    strategies = all_strategies(graph, plan.mesh, training=plan.training)
    chosen = chosen_strategies(graph, strategies, plan)
    assert set(chosen) == set(plan.nodes)
    profile = load_profile(str(planned["profile"]))
    compute = 0.0
    for op in graph.nodes():
        options = explain_node(graph, strategies, chosen, op.name, plan.mesh, profile, plan.training)
        assert sum(o.chosen for o in options) == 1
        compute += next(o.compute_s for o in options if o.chosen)
    assert math.isclose(compute, plan.predicted["compute_s"], rel_tol=1e-9)
    assert resolve(graph, plan, "model.layers.1.mlp.down_proj.weight") == [
        c for c, _ in graph.consumers(next(op.name for op in graph.nodes()
                                           if op.fqn == "model.layers.1.mlp.down_proj.weight"))]
    with pytest.raises(ExplainError, match="'nothing_here' is neither an op nor a parameter"):
        resolve(graph, plan, "nothing_here")


def test_explain_on_the_command_line(planned, capsys):
    rc, out, _ = _run(capsys, "explain", str(planned["json"]), "model.layers.1.mlp.down_proj.weight",
                      "--profile", str(planned["profile"]))
    assert rc == 0 and "in model.layers.1.mlp.down_proj" in out
    assert sum(line.startswith("* ") for line in out.splitlines()) == 1


def test_pictures_are_valid_files(planned):
    svg = ET.parse(planned["svg"]).getroot()
    assert svg.tag.endswith("svg")
    labels = [t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert any("model.layers.* ×2" in t for t in labels)
    chart = ET.parse(planned["chart"]).getroot()
    bars = [r for r in chart.iter("{http://www.w3.org/2000/svg}rect") if r.get("fill") == TIME_COLORS["compute"]]
    assert len(bars) >= 2 and all(float(r.get("height")) > 0 for r in bars)  # autotp's and a baseline's compute
    words = {t.text for t in chart.iter("{http://www.w3.org/2000/svg}text")}
    assert {"autotp", "step time (ms)", "memory per device (GiB)"} <= words


@pytest.mark.parametrize("argv, message", [
    (["plan", "hf:llamaa", "--mesh", "2"], "unknown transformers architecture 'llamaa'"),
    (["plan", "hf:gpt2", "--kv-heads", "2", "--mesh", "2"], "hf:gpt2 has no --kv-heads"),
    (["plan", "hf:bert", "--config", "nope=1", "--mesh", "2"], "unknown config override 'nope=1'"),
    (["plan", "hf:llama"], "--mesh is required unless MODEL is a saved plan.json"),
    (["plan", "model.py", "--mesh", "2"], "is not of the form path/to/file.py:factory, hf:ARCH or plan.json"),
    (["plan", "hf:llama", "--mesh", "2", "--profile", "nope"], "unknown profile 'nope'"),
    (["plan", "{nosource}"], "does not say which model it was made from"),
])
def test_bad_input_is_one_line_and_exit_2(planned, capsys, argv, message):
    data = json.loads(planned["json"].read_text())
    data["source"] = None
    nosource = planned["tmp"] / "nosource.json"
    nosource.write_text(json.dumps(data))
    rc, _, err = _run(capsys, *[a.format(plan=planned["json"], nosource=nosource) for a in argv])
    assert rc == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("autotp: error: ")
