"""Collective matmuls (overlapped tensor parallelism): priced as the ring hides them, lowered as rings, exactly.

* The rule: a matmul runs chunk by chunk of a dim of its first input's rows
  by a whole 2-D weight (``linear``'s and ``matmul``'s leading dims, ``mm``'s
  first), never of the contracted one.
* One ring for several matmuls (q, k, v) is credited use by use, never more
  than it hides for any set of the uses, and all of it when all need it.
* Planning (`DropoutNet` on mesh 4 over NVLink, Megatron's split with
  sequence parallelism, H100 profile): the same plan priced with and without
  ``overlap_tp`` differs by exactly ``predicted["overlap_hidden_s"]``, which
  is positive and no more than the all-gathers and reduce-scatters on the
  axis; compute plus collectives less all that is hidden is the step. A GPT
  regathered under a limit: the gathers run again cost less with the rings,
  by what their backward hides.
* Lowering (4 gloo ranks, on 2x2 with every weight stored split on dp too,
  and on 4, a ring of four; the same split on tp): the rank program runs ring gather-matmuls and
  matmul-scatters in place of the activations' all-gathers and
  reduce-scatters, and outputs and every gradient match the single device,
  with the gathered inputs kept, regathered (by the ring of backward itself,
  never rebuilt before it) and recomputed; with dropout on,
  from the same seed, regathering and recomputation give what the rings
  alone give.
* A transformers Llama under Megatron's sequence parallelism on 4 gloo
  ranks runs its all-gathers and reduce-scatters as rings, exactly.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.cost.collective_matmul import Ring, fused_shares, splits_rows
from autotp.lower.collective_matmul import GatherMatmul, MatmulScatter
from autotp.lower.recompute import Recomputed
from autotp.lower.regather import Regathered
from autotp.model_spec import ModelSpec, build
from autotp.report.baselines import baseline_plans, sequence_parallel_only
from autotp.runtime import spawn
from autotp.runtime.verify import max_errors, scaled_error, worst_gradient_error
from autotp.solve.constraints import same_as
from helpers import activation_bound_gpt, check_exact_with_dropout, dropout_net, planned_and_run

aten = torch.ops.aten
TOLERANCE = 1e-5
HIDDEN = 16  # dropout_net's


def test_a_matmul_runs_by_chunks_of_its_rows_never_of_the_contracted_dim():
    assert splits_rows(aten.linear.default, 3, 2, 0) and splits_rows(aten.linear.default, 3, 2, 1)
    assert not splits_rows(aten.linear.default, 3, 2, 2)  # the contracted dim
    assert splits_rows(aten.mm.default, 2, 2, 0) and not splits_rows(aten.mm.default, 2, 2, 1)
    assert splits_rows(aten.matmul.default, 3, 2, 1)
    assert not splits_rows(aten.matmul.default, 3, 3, 1)  # a batched second input: its rows go with the first's
    assert not splits_rows(aten.bmm.default, 3, 3, 1)
    assert not splits_rows(aten.add.Tensor, 3, 3, 0)


@pytest.mark.parametrize("seed", range(20))
def test_one_rings_credit_use_by_use_never_exceeds_what_it_hides_and_is_all_of_it_when_every_use_needs_it(seed):
    """q, k and v read one gathered tensor through one ring: each use's credit is a share of its matmul's time,
    so the ILP can add it pair by pair; whichever uses need the gather, the credits sum to at most
    ``min(collective, their matmuls)``, forward and backward, with the gather run again (regathered) or not,
    and to exactly that when all of them do."""
    gen = torch.Generator().manual_seed(seed)
    forward, backward, again = (float(v) for v in torch.rand(3, generator=gen))
    n = 1 + seed % 4
    ahead, behind = torch.rand(n, generator=gen).tolist(), (torch.rand(n, generator=gen) * 2).tolist()
    uses = [Ring(forward, a, backward, b, True) for a, b in zip(ahead, behind)]
    share_f, share_b, share_r = fused_shares(uses, again)
    for mask in range(1, 2 ** n):
        subset = [u for k, u in enumerate(uses) if mask >> k & 1]
        cover_f, cover_b = sum(u.ahead for u in subset), sum(u.behind for u in subset)
        every = len(subset) == n
        for credit, bound in ((share_f * cover_f, min(forward, cover_f)), (share_b * cover_b, min(backward, cover_b)),
                              (share_r * cover_b, min(backward + again, cover_b))):
            assert credit <= bound * (1 + 1e-12)
            if every:
                assert credit == pytest.approx(bound, rel=1e-12)


def _pins(mesh) -> dict:
    """Megatron's column and row split on the last axis; on a 2-D mesh each weight split on the first too."""
    two = mesh.ndim == 2
    pins = {}
    for i in range(2):
        pins |= {f"blocks.{i}.up.weight": ("S(1)", "S(0)") if two else ("S(0)",),
                 f"blocks.{i}.up.bias": ("S(0)", "S(0)") if two else ("S(0)",),
                 f"blocks.{i}.down.weight": ("S(0)", "S(1)") if two else ("S(1)",)}
    return pins


def _plan(mesh, allow=None, **options):
    model, inputs = dropout_net(0.0, seq=8)
    return autotp.plan(model, mesh, inputs, profile="h100-hgx", pin=_pins(mesh),
                       allow=allow or sequence_parallel_only(HIDDEN, mesh.ndim - 1), memory_limit=None,
                       micro_batches=1, **options)


def test_the_same_plan_is_faster_by_exactly_what_the_matmuls_hide():
    mesh = autotp.Mesh("4", links="nvlink")
    overlapped = _plan(mesh)
    whole = _plan(mesh, allow=same_as(overlapped), overlap_tp=False)
    assert overlapped.nodes == whole.nodes  # the same strategies: only the pricing differs
    assert _plan(mesh, overlap_tp=False).predicted["total_s"] >= overlapped.predicted["total_s"]
    p, q = overlapped.predicted, whole.predicted
    assert p["overlap_hidden_s"] > 0 and q["overlap_hidden_s"] == 0
    assert q["total_s"] - p["total_s"] == pytest.approx(p["overlap_hidden_s"], rel=1e-9)
    assert p["compute_s"] + p["comm_s"] - p["hidden_s"] == pytest.approx(p["total_s"], rel=1e-9)
    tp = sum(c["time_s"] for c in overlapped.collectives if c["kind"] in ("all_gather", "reduce_scatter"))
    assert p["overlap_hidden_s"] <= tp * (1 + 1e-12)
    assert overlapped.runtime["overlap_tp"] and not whole.runtime["overlap_tp"]


def test_a_regathered_input_costs_what_the_rings_backward_cannot_hide():
    """The same strategies under a limit only regathering meets: with collective matmuls the gathers run again
    in backward cost less (their matmuls' backward rings carry them), and the whole difference between the two
    pricings is what the rings hide, forward, backward and regathered."""
    model, inputs = activation_bound_gpt()
    mesh = autotp.Mesh("4", links="nvlink")
    options = dict(profile="h100-hgx", micro_batches=1, recompute=False, optimizer_sharding=False)
    free = autotp.plan(model, mesh, inputs, allow=sequence_parallel_only(32, 0), **options)
    limit = int(free.memory["total"]) - 1
    rings = autotp.plan(model, mesh, inputs, memory_limit=limit, allow=same_as(free), **options)
    whole = autotp.plan(model, mesh, inputs, memory_limit=limit, allow=same_as(free), overlap_tp=False, **options)
    assert rings.nodes == whole.nodes == free.nodes and rings.regather == whole.regather == ["activations"]
    p, q = rings.predicted, whole.predicted
    assert 0 < p["regather_s"] < q["regather_s"]
    assert q["total_s"] - p["total_s"] == pytest.approx(p["overlap_hidden_s"] + q["regather_s"] - p["regather_s"],
                                                        rel=1e-9)
    assert p["compute_s"] + p["comm_s"] - p["hidden_s"] == pytest.approx(p["total_s"], rel=1e-9)


def _plans(mesh) -> dict:
    base = _plan(mesh)
    out = {}
    for name, overlap, regather, recompute in (
            ("kept", True, [], []), ("kept, whole collectives", False, [], []),
            ("regathered", True, ["weights", "activations"], []),
            ("regathered, recomputed", True, ["weights", "activations"], ["blocks.0", "blocks.1"]),
            ("kept, recomputed", True, [], ["blocks.0", "blocks.1"])):
        data = base.to_dict()
        out[name] = autotp.Plan.from_dict({**data, "regather": regather, "recompute": recompute,
                                           "runtime": {**data["runtime"], "overlap_tp": overlap}})
    return out


def _run(rank, world, plans):
    out, noisy, rebuilt = {}, {}, []
    rebuild = Regathered.rebuild
    Regathered.rebuild = lambda record: rebuilt.append(record.module) or rebuild(record)  # a spy: it still runs
    for name, plan in plans.items():
        model, inputs = dropout_net(0.0, seq=8)
        reference = dropout_net(0.0, seq=8)[0]
        local = autotp.parallelize(model, plan)
        want, got = reference(*inputs), local(*inputs)
        want.backward()
        rebuilt.clear()
        got.backward()
        rings = [m for m in local.modules() if isinstance(m, GatherMatmul)]
        dropped = autotp.parallelize(dropout_net(0.3, seq=8)[0], plan)
        torch.manual_seed(7)
        loss = dropped(*inputs)
        loss.backward()
        noisy[name] = loss.detach(), {n: p.grad.clone() for n, p in dropped.named_parameters()}
        out[name] = {"output": scaled_error(got, want), "gradient": worst_gradient_error(local, reference, plan, rank),
                     "gather_matmuls": sum(isinstance(m, GatherMatmul) for m in local.modules()),
                     "matmul_scatters": sum(isinstance(m, MatmulScatter) for m in local.modules()),
                     "regathering_rings": sum(m.gather.regather for m in rings),
                     "rings_rebuilt": sum(any(g is m.gather for m in rings) for g in rebuilt),
                     "recomputed_rings": sum(isinstance(m, (GatherMatmul, MatmulScatter)) for r in local.modules()
                                             if isinstance(r, Recomputed) for m in r.modules()),
                     "dropout_drew": abs(float(loss.detach()) - float(got.detach())) > 1e-3}
    # the ring programs against each other: a reduce-scatter's output is a strided view where a ring's is
    # contiguous, and dropout lays its mask out in memory order, so only programs with rings alike draw alike
    plain_loss, plain_grads = noisy["kept"]
    for name, (loss, grads) in noisy.items():
        out[name]["dropout"] = max([scaled_error(loss, plain_loss)]
                                   + [scaled_error(g, plain_grads[n]) for n, g in grads.items()])
    return out


@pytest.fixture(scope="module", params=["2x2", "4"])
def results(request):
    """On 2x2 (each weight split on dp too) and on 4 (a ring of four: direction and chunk order matter)."""
    return planned_and_run(_run, _plans, autotp.Mesh(request.param))


def test_rings_replace_the_activations_collectives_and_stay_exact(results):
    plans, per_rank = results
    assert plans["kept"].parameters["blocks.0.up.weight"] in (("S(1)", "S(0)"), ("S(0)",))
    for rank, by_plan in enumerate(per_rank):
        for name, e in by_plan.items():
            where = f"{name}, rank {rank}"
            check_exact_with_dropout(e, where, TOLERANCE)
            if name != "kept, whole collectives":
                assert e["dropout"] <= TOLERANCE, f"{where}: with dropout, {e['dropout']:.2e} from the rings alone"
            rings = (e["gather_matmuls"], e["matmul_scatters"])
            if name == "kept, whole collectives":
                assert rings == (0, 0), where
            else:  # gathered into each block's up and into the head; each block's down product scattered
                assert rings == (3, 2), f"{where}: {rings}"
            if name == "regathered":  # the rings' inputs, read by nothing else, come round again in their backward
                assert e["regathering_rings"] == 3 and e["rings_rebuilt"] == 0, f"{where}: {e}"
            # in a recomputed block the rings join its checkpointed stretches, and run again in backward
            assert (e["recomputed_rings"] == 4) == name.endswith("recomputed"), f"{where}: {e['recomputed_rings']}"


def _llama():
    spec = ModelSpec("hf:llama", {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128},
                     batch=2, seq=8)
    torch.manual_seed(0)
    return build(spec, meta=False, training=True)


def _llama_errors(rank, world, plan):
    model, args, kwargs = _llama()
    local = autotp.parallelize(_llama()[0], plan)
    rings = [m for m in local.modules() if isinstance(m, (GatherMatmul, MatmulScatter))]
    matmuls = sum(len(m.targets) for m in rings if isinstance(m, GatherMatmul))
    shared = sum(m.shared for m in rings if isinstance(m, GatherMatmul))
    again = sum(m.gather.regather for m in rings if isinstance(m, GatherMatmul))
    return len(rings), matmuls, shared, again, max_errors(model, plan, args, rank, kwargs=kwargs)


@pytest.mark.parametrize("regather", [[], ["activations"]])
def test_a_transformers_llama_under_megatrons_sequence_parallelism_runs_rings_exactly(regather):
    """Each layer: the norms' outputs gathered by one ring into q, k and v, and by one into gate and up; o's and
    down's products scattered; the head's input gathered too. Regathered, each gathers its input again in
    backward, as the ring of the matmuls' backward."""
    model, args, kwargs = _llama()
    mesh = autotp.Mesh("4", links="nvlink")
    megatron = baseline_plans(model, mesh, args, kwargs, names=("megatron-sp",), profile="h100-hgx",
                              memory_limit=None)[0].plan
    assert megatron.predicted["overlap_hidden_s"] > 0
    megatron = autotp.Plan.from_dict({**megatron.to_dict(), "regather": regather})
    for rank, (rings, matmuls, shared, again, errors) in enumerate(spawn(_llama_errors, mesh.size, megatron)):
        assert (rings, matmuls, shared) == (2 * 4 + 1, 2 * 5 + 1, 0), f"rank {rank}: {rings, matmuls, shared}"
        assert again == (2 * 2 + 1 if regather else 0), f"rank {rank}: {again} rings gather again in backward"
        assert errors["output"] <= TOLERANCE and errors["gradient"] <= TOLERANCE, f"rank {rank}: {errors}"
