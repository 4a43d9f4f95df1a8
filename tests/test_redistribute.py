"""Redistribution steps: the collectives, their order on nested splits, and their backward."""

from __future__ import annotations

import pytest
import torch

from autotp.graph.opgraph import TensorMeta
from autotp.placement import P, R, Shard
from autotp.redistribute import Unsupported, plan_steps, replay_steps, step_options, step_units

META = TensorMeta((8, 8), torch.float32)


def kinds(steps):
    return [(s.kind, s.axis) for s in steps]


def test_single_axis_transitions():
    assert kinds(plan_steps((P,), (R,), META, (4,))) == [("all_reduce", 0)]
    assert kinds(plan_steps((P,), (Shard(1),), META, (4,))) == [("reduce_scatter", 0)]
    assert kinds(plan_steps((Shard(0),), (R,), META, (4,))) == [("all_gather", 0)]
    assert kinds(plan_steps((R,), (Shard(0),), META, (4,))) == [("slice", 0)]
    assert kinds(plan_steps((Shard(0),), (Shard(1),), META, (4,))) == [("all_gather", 0), ("slice", 0)]
    assert plan_steps((Shard(0),), (Shard(0),), META, (4,)) == []
    with pytest.raises(Unsupported):
        plan_steps((R,), (P,), META, (4,))


def test_backward_duals():
    [gather] = plan_steps((Shard(0),), (R,), META, (4,))
    assert gather.backward_kind is None  # the slice of a replicated gradient
    [slice_] = plan_steps((R,), (Shard(0),), META, (4,))
    assert slice_.backward_kind == "all_gather"
    [f] = plan_steps((R,), (R,), META, (4,), grad_axes=(0,))
    assert (f.kind, f.forward_kind, f.backward_kind) == ("grad_all_reduce", None, "all_reduce")
    [gather_rs] = plan_steps((Shard(0),), (R,), META, (4,), grad_axes=(0,))
    assert (gather_rs.forward_kind, gather_rs.backward_kind) == ("all_gather", "reduce_scatter")


def test_nested_split_is_undone_innermost_first():
    steps = plan_steps((Shard(0), Shard(0)), (R, Shard(0)), META, (2, 2))
    assert kinds(steps) == [("all_gather", 1), ("all_gather", 0), ("slice", 1)]


def test_message_bytes_follow_nccl_tests():
    [gather] = plan_steps((Shard(0),), (R,), META, (4,))
    assert gather.message_bytes == 8 * 8 * 4  # the gathered output
    [reduce] = plan_steps((P,), (R,), META, (4,))
    assert reduce.message_bytes == 8 * 8 * 4


def test_hierarchical_sum_steps_and_message_bytes():
    options = step_options((P, P), (R, R), META, (2, 4))
    forms = [{s.form for s in steps} for steps in options]
    assert forms[0] == {""}  # one all-reduce per axis comes first
    flat = next(o for o in options if o[0].form.startswith("flat"))
    assert [(s.kind, s.span, s.message_bytes) for s in flat] == [("all_reduce", (0, 1), 256)]
    hier = next(o for o in options if o[0].form == "hierarchical 0+1 outer 0 dim 0")
    assert kinds(hier) == [("reduce_scatter", 1), ("all_reduce", 0), ("all_gather", 1)]
    assert [s.message_bytes for s in hier] == [256, 256 // 4, 256]  # nccl-tests: full input, the piece, full output
    assert [s.backward_kind for s in hier] == ["all_gather", None, None]


def test_hierarchical_gradient_sum_runs_backward_as_one_unit():
    options = step_options((R, R), (R, R), META, (2, 4), grad_axes=(0, 1))
    hier = next(o for o in options if o[0].form.startswith("grad hierarchical"))
    assert [s.forward_kind for s in hier] == [None, None, None]
    assert [(s.backward_kind, s.axis) for s in reversed(hier)] == [
        ("reduce_scatter", 1), ("all_reduce", 0), ("all_gather", 1)]
    assert step_units(hier) == [hier]
    assert step_units(options[0]) == [[s] for s in options[0]]  # per-axis: one module per step


def test_three_axes_scatter_innermost_first_and_no_flat_without_a_whole_mesh_group():
    meta = TensorMeta((16, 4), torch.float32)
    options = step_options((P, R, P, P), (R, R, R, R), meta, (2, 3, 2, 2))
    assert not any(s.form.startswith("flat") for o in options for s in o)  # axis 1 is not summed
    hier = next(o for o in options if o[0].form.startswith("hierarchical 0+2+3 outer 0"))
    assert kinds(hier) == [("reduce_scatter", 3), ("reduce_scatter", 2), ("all_reduce", 0),
                           ("all_gather", 2), ("all_gather", 3)]
    assert [s.message_bytes for s in hier] == [256, 128, 64, 128, 256]


def test_no_hierarchical_form_when_no_dim_divides_and_replay_needs_an_offered_form():
    odd = TensorMeta((3, 5), torch.float32)
    options = step_options((P, P), (R, R), odd, (2, 2))
    assert [o[0].form for o in options] == ["", "flat 0+1"]
    steps = replay_steps((P, P), (R, R), META, (2, 4), forms={"hierarchical 0+1 outer 0 dim 0"})
    assert kinds(steps) == [("reduce_scatter", 1), ("all_reduce", 0), ("all_gather", 1)]
    assert replay_steps((P, P), (R, R), META, (2, 4)) == plan_steps((P, P), (R, R), META, (2, 4))
    with pytest.raises(Unsupported):
        replay_steps((P, P), (R, R), odd, (2, 2), forms={"hierarchical 0+1 outer 0 dim 0"})


def _options_worked_out(src, dst, meta, mesh_shape, grad_axes):
    """`step_options` computed directly, each option by `plan_steps` for one pair of sum forms: what its
    recipes, worked out once per layouts and shape key and read for each tensor, must give."""
    from autotp.placement import local_shape
    from autotp.redistribute import _layout_steps, _serve_grad_axes, reduction_options, summed_axes

    options = []
    for reduction in [None] + reduction_options(summed_axes(src, dst), local_shape(meta.shape, src, mesh_shape),
                                                mesh_shape):
        _, rest = _serve_grad_axes(_layout_steps(src, dst, meta, mesh_shape, reduction), grad_axes)
        grads = reduction_options(rest, local_shape(meta.shape, dst, mesh_shape), mesh_shape, grad=True)
        options += [plan_steps(src, dst, meta, mesh_shape, grad_axes, reduction, g) for g in [None] + grads]
    return options


def test_step_options_read_off_recipes_match_the_steps_worked_out_for_every_tensor():
    """The same layouts on tensors whose dims split differently (the hierarchical forms pick another dim, or
    none) and of other sizes and dtypes: each asked after the others filled the recipes, on 2-, 3- and 4-axis
    meshes, forward sums, gradient sums and plain moves alike."""
    import itertools
    import random

    rng = random.Random(0)
    metas = [TensorMeta(shape, dtype) for shape in [(8, 8), (3, 16), (16, 3), (3, 5), (24, 6, 4), (2, 12, 8)]
             for dtype in (torch.float32, torch.bfloat16)]
    checked = 0
    for mesh_shape in [(2, 4), (4, 2), (2, 3, 2), (2, 2, 2, 2), (1, 4)]:
        places = [P, R, Shard(0), Shard(1)]
        for _ in range(150):
            src = tuple(rng.choice(places) for _ in mesh_shape)
            dst = tuple(rng.choice(places[1:]) for _ in mesh_shape)
            grad_axes = tuple(a for a in range(len(mesh_shape)) if rng.random() < 0.5)
            for meta in rng.sample(metas, 6):
                try:
                    expected = _options_worked_out(src, dst, meta, mesh_shape, grad_axes)
                except Unsupported:
                    with pytest.raises(Unsupported):
                        step_options(src, dst, meta, mesh_shape, grad_axes)
                    continue
                assert step_options(src, dst, meta, mesh_shape, grad_axes) == expected, (src, dst, meta, mesh_shape)
                checked += 1
    assert checked > 1000
    forms = {s.form for options in itertools.chain([step_options((P, P), (R, R), m, (2, 4)) for m in metas])
             for steps in options for s in steps}
    assert "hierarchical 0+1 outer 0 dim 0" in forms and "hierarchical 0+1 outer 0 dim 1" in forms


def test_tensors_of_one_options_key_get_the_same_steps():
    """`options_key` stands for a tensor in `autotp.cost.reshard.edge_cost`'s memo: two tensors with one key must
    get equal steps (or both be refused), and tensors of other sizes, or whose dims split otherwise, other keys."""
    import random

    from autotp.redistribute import options_key

    rng = random.Random(1)
    metas = [TensorMeta(shape, dtype) for shape in [(8, 8), (4, 16), (16, 4), (3, 16), (16, 3), (24, 6, 4),
                                                    (2, 12, 8), (12, 2, 8)]
             for dtype in (torch.float32, torch.bfloat16)]
    places = [P, R, Shard(0), Shard(1)]
    by_key, cases = {}, 0
    for mesh_shape in [(2, 4), (2, 2, 2)]:
        for _ in range(200):
            src = tuple(rng.choice(places) for _ in mesh_shape)
            dst = tuple(rng.choice(places[1:]) for _ in mesh_shape)
            grad_axes = tuple(a for a in range(len(mesh_shape)) if rng.random() < 0.5)
            for meta in metas:
                try:
                    steps = step_options(src, dst, meta, mesh_shape, grad_axes)
                except Unsupported as exc:
                    steps = str(exc)
                key = options_key(src, dst, meta, mesh_shape, grad_axes)
                assert by_key.setdefault(key, steps) == steps, (src, dst, meta, mesh_shape, grad_axes)
                cases += 1
    assert len(by_key) < cases * 3 / 4  # tensors of equal bytes share a key
    wide, tall, large = (TensorMeta(shape, torch.float32) for shape in [(8, 16), (16, 8), (16, 16)])
    gather = (Shard(0), R), (R, R), (2, 4)
    assert options_key(gather[0], gather[1], wide, gather[2]) == options_key(gather[0], gather[1], tall, gather[2])
    assert options_key(gather[0], gather[1], wide, gather[2]) != options_key(gather[0], gather[1], large, gather[2])
