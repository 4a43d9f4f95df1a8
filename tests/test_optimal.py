"""autotp's plan is the best of its own search space: never slower than a baseline, and its objective is its step.

For transformers models (Llama, Mistral with grouped-query attention, GPT-2)
on 1-D and 2-D meshes under the CPU and the H100 profiles, planned on the
meta device:

* the ILP's objective is the step time the plan reports, exactly;
* the step time splits into compute, collectives and the gradient time the
  backward pass does not hide, as the report prints it;
* autotp is predicted no slower than any baseline (replicated, data-parallel,
  megatron, megatron with sequence parallelism), each a point of its search
  space costed by the same model. The first six cases are the table of the
  issue that asked for this (Llama 4x512 and Mistral 4x1024, batch 8x128);
* layer sharing and layer replay change nothing: the same optimum without
  them (without sharing on the mesh of 4 only: on 2x2 the unshared ILP takes
  a minute to solve on this machine).
"""

from __future__ import annotations

import functools

import pytest

import autotp
from autotp.model_spec import ModelSpec, build
from autotp.report.baselines import NAMES, baseline_plans

LLAMA_512 = ModelSpec("hf:llama", {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
                                   "num_key_value_heads": 8, "intermediate_size": 1376, "vocab_size": 32000}, 8, 128)
MISTRAL_1K = ModelSpec("hf:mistral", {"num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
                                      "num_key_value_heads": 4, "intermediate_size": 2816, "vocab_size": 32000}, 8, 128)
GPT2 = ModelSpec("hf:gpt2", {"n_layer": 4, "n_embd": 256, "n_head": 8, "vocab_size": 8192}, 8, 64)
LLAMA_DEEP = ModelSpec("hf:llama", {"num_hidden_layers": 5, "hidden_size": 256, "num_attention_heads": 8,
                                    "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 4096}, 4, 64)

CASES = [  # (model, mesh, links, profile)
    (LLAMA_512, "2", "loopback", "cpu-2core-4proc"),
    (LLAMA_512, "4", "loopback", "cpu-2core-4proc"),
    (MISTRAL_1K, "4", "loopback", "cpu-2core-4proc"),
    (LLAMA_512, "8", "nvlink", "h100-hgx"),
    (MISTRAL_1K, "8", "nvlink", "h100-hgx"),
    (MISTRAL_1K, "2x4", "nvlink,nvlink", "h100-hgx"),
    (LLAMA_512, "2x2", "loopback,loopback", "cpu-2core-4proc"),
    (GPT2, "4", "nvlink", "h100-hgx"),
    (GPT2, "2x2", "loopback,loopback", "cpu-2core-4proc"),
    (MISTRAL_1K, "2x4", "infiniband,nvlink", "h100-hgx"),
]


def _name(case) -> str:
    spec, mesh, links, profile = case
    return f"{spec.model[3:]}{spec.config.get('hidden_size', spec.config.get('n_embd'))}-{mesh}-{links}-{profile}"


@functools.lru_cache(maxsize=None)
def _model(model: str, config: tuple, batch: int, seq: int):
    return build(ModelSpec(model, dict(config), batch, seq), meta=True)


def _built(spec: ModelSpec):
    return _model(spec.model, tuple(sorted(spec.config.items())), spec.batch, spec.seq)


@functools.lru_cache(maxsize=None)
def _planned(index: int):
    spec, mesh, links, profile = CASES[index]
    model, args, kwargs = _built(spec)
    mesh = autotp.Mesh(mesh, links=links)
    plan = autotp.plan(model, mesh, args, kwargs, profile=profile)
    return plan, baseline_plans(model, mesh, args, kwargs, profile=profile)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_name(c) for c in CASES])
def test_the_objective_is_the_step_time_and_its_parts_add_up(case):
    plan, baselines = _planned(case)
    for p in [plan] + [b.plan for b in baselines if b.plan is not None]:
        predicted = p.predicted
        assert predicted["objective_s"] == pytest.approx(predicted["total_s"], rel=1e-9, abs=1e-15)
        assert predicted["compute_s"] + predicted["comm_s"] - predicted["hidden_s"] == pytest.approx(
            predicted["total_s"], rel=1e-9)
        assert 0 <= predicted["gradient_hidden_s"] <= predicted["gradient_s"] * (1 + 1e-12)
        assert 0 <= predicted["gather_hidden_s"] <= predicted["gather_s"] * (1 + 1e-12)
        assert 0 <= predicted["overlap_hidden_s"] <= predicted["comm_s"]
        assert predicted["hidden_s"] == pytest.approx(predicted["gradient_hidden_s"] + predicted["gather_hidden_s"]
                                                      + predicted["overlap_hidden_s"])


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_name(c) for c in CASES])
def test_autotp_is_no_slower_than_any_baseline(case):
    plan, baselines = _planned(case)
    costed = {b.name: b.plan.predicted["total_s"] for b in baselines if b.plan is not None}
    assert set(costed) >= {"replicated", "megatron"}, [(b.name, b.reason) for b in baselines]
    assert {b.name for b in baselines} == set(NAMES)
    for name, seconds in costed.items():
        assert plan.predicted["total_s"] <= seconds * (1 + 1e-9), (name, plan.predicted["total_s"], seconds)


# the unshared ILP of the 2x2 mesh (176,000 variables) takes a minute to solve here: on 2x2 only replay is checked
@pytest.mark.parametrize("mesh, links, ways", [("4", "nvlink", ((True, True), (False, True), (True, False))),
                                               ("2x2", "nvlink,nvlink", ((True, True), (True, False)))])
def test_layer_sharing_and_replay_keep_the_optimum(mesh, links, ways):
    model, args, kwargs = _built(LLAMA_DEEP)
    mesh = autotp.Mesh(mesh, links=links)
    plans = {(share, replay): autotp.plan(model, mesh, args, kwargs, profile="h100-hgx", share_layers=share,
                                          replay_layers=replay)
             for share, replay in ways}
    best = plans[True, True].predicted["objective_s"]
    assert plans[True, True].stats["capture"]["replayed"]  # 5 layers: traced 4 deep, the fifth replayed
    assert plans[True, True].ilp["shared_layers"] == 5
    for key, p in plans.items():
        assert p.predicted["objective_s"] == pytest.approx(best, rel=1e-9), key
