"""autotp on the user's torch ``DeviceMesh`` (issue 17): planned for it, run on its groups, a sub-mesh included.

On 4 gloo processes each rank builds ``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("dp", "tp"))``, plans the test GPT for that DeviceMesh
(``autotp.plan`` takes it as the mesh) and runs the plan with
``parallelize(..., device_mesh=...)``; then it plans and runs the GPT on its
``tp`` sub-mesh alone, a mesh of 2 inside a world of 4 (two independent
copies). Both plans really split, and each rank's loss and every gradient
match the single device's to 1e-5. A DeviceMesh of another shape than the
plan's is refused with a `MeshError` that names both.
"""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

import autotp
from autotp.errors import MeshError
from autotp.runtime import spawn
from autotp.runtime.verify import scaled_error, worst_gradient_error
from conftest import compute_bound_profile
from helpers import make_model

TOLERANCE = 1e-5


def _check(plan, device_mesh, rank_in_mesh: int) -> dict:
    model, inputs = make_model("gpt")
    reference = make_model("gpt")[0]
    want = reference(*inputs)
    want.backward()
    local = autotp.parallelize(model, plan, device_mesh=device_mesh)
    got = local(*inputs)
    got.backward()
    split = any(p.startswith("S(") for layout in plan.parameters.values() for p in layout)
    return {"output": scaled_error(got, want), "gradient": worst_gradient_error(local, reference, plan, rank_in_mesh),
            "split": split, "mesh": plan.mesh.to_dict()}


def _run(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, inputs = make_model("gpt")
    whole = autotp.plan(model, mesh, inputs, profile=compute_bound_profile())
    tp = mesh["tp"]
    alone = autotp.plan(model, tp, inputs, profile=compute_bound_profile())
    try:
        autotp.parallelize(model, alone, device_mesh=mesh)
        refused = ""
    except MeshError as exc:
        refused = str(exc)
    return {"whole": _check(whole, mesh, rank), "sub_mesh": _check(alone, tp, tp.get_local_rank()),
            "refused": refused}


@pytest.fixture(scope="module")
def results():
    return spawn(_run, 4)


def test_plans_for_a_device_mesh_and_a_sub_mesh_run_exactly_on_its_groups(results):
    for rank, by_mesh in enumerate(results):
        assert by_mesh["whole"]["mesh"]["shape"] == [2, 2] and by_mesh["whole"]["mesh"]["names"] == ["dp", "tp"]
        assert by_mesh["sub_mesh"]["mesh"]["shape"] == [2] and by_mesh["sub_mesh"]["mesh"]["names"] == ["tp"]
        for name, e in by_mesh.items():
            if name == "refused":
                continue
            assert e["split"], f"{name}: the plan splits nothing: the check would prove little"
            assert e["output"] <= TOLERANCE and e["gradient"] <= TOLERANCE, (rank, name, e)


def test_a_device_mesh_of_another_shape_is_refused(results):
    for by_mesh in results:
        assert "device mesh has shape (2, 2) but the plan is for Mesh(tp=2" in by_mesh["refused"], by_mesh["refused"]
