"""Training under torchrun and sharded checkpoints.

The torchrun test launches ``examples/train_torchrun.py`` twice on 2 gloo
processes: 5 steps saving at step 3, then a resume from step 3 that saves
step 5 and consolidates it. The single-device run it is checked against is
computed here, with plain PyTorch. The other tests save and load in this
process, for 4 ranks at once (no process group is needed to save or load).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autotp
import train_torchrun as example
from autotp.checkpoint import INDEX, assemble, consolidate, load_sharded, read_index, save_sharded
from autotp.errors import CheckpointError
from autotp.capture import capture
from autotp.lower import lower, shard_tensor
from autotp.placement import parse_layout
from helpers import forced_plan, make_model

ROOT = Path(__file__).parents[1]
STEPS, SAVE_AT = 5, 3


def _torchrun(tmp_path, *args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_torchrun.py"), "--weights", str(tmp_path / "init.safetensors"),
           "--steps", str(STEPS), "--losses-out", str(tmp_path / "losses.json"), *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {int(k): v for k, v in json.loads((tmp_path / "losses.json").read_text()).items()}


def _single_device(steps: int):
    """The same training on one device, without autotp: the reference."""
    model = example.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=example.LR)
    losses = {}
    for step in range(1, steps + 1):
        ids = example.batch(step)
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
    return model, losses


def test_torchrun_training_matches_one_device_and_resumes_exactly(tmp_path):
    ckpt, full = tmp_path / "ckpt", tmp_path / "full.pt"
    straight = _torchrun(tmp_path, "--save", str(ckpt), "--save-step", str(SAVE_AT))
    resumed = _torchrun(tmp_path, "--resume", str(ckpt), "--save", str(ckpt), "--consolidate", str(full))
    reference, want = _single_device(STEPS)
    assert sorted(straight) == list(range(1, STEPS + 1)) and sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in straight.items():
        assert abs(loss - want[step]) <= 1e-4, f"step {step}: {loss} on 4 ranks, {want[step]} on one device"
    assert want[STEPS] < want[1]  # it trains: the two batches are being learned
    for step, loss in resumed.items():
        assert loss == straight[step], f"step {step} after resuming: {loss}, uninterrupted {straight[step]}"
    fresh = example.build_model()
    fresh.load_state_dict(torch.load(full), strict=True)
    ids = example.batch(0)
    with torch.no_grad():
        err = (fresh(ids).logits - reference(ids).logits).abs().max().item()
    assert err <= 1e-4, f"consolidated model's logits differ from the single-device model by {err:.2e}"


def _lowered(plan):
    """Each rank's lowered GPT (no process group: saved and loaded, never run), captured once."""
    model, inputs = make_model("gpt")
    gm = capture(model, inputs)
    return [lower(copy.deepcopy(gm), plan, rank) for rank in range(plan.mesh.size)]


def _locals(pristine):
    """Copies of each rank's module with an AdamW that took one step.

    The gradient is the weight itself: replicas stay equal, and every piece moves differently.
    """
    out = []
    for module in pristine:
        local = copy.deepcopy(module)
        optimizer = torch.optim.AdamW(local.parameters(), lr=0.1)
        for p in local.parameters():
            p.grad = p.detach().clone()
        optimizer.step()
        out.append((local, optimizer))
    return out


def _save_all(directory, ranks, plan, step):
    for rank in reversed(range(len(ranks))):  # rank 0 last: it writes the index
        save_sharded(directory, *ranks[rank], plan, rank, step)


def _state(local, optimizer):
    return ({k: v.clone() for k, v in local.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()})


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def plan():
    """Megatron's split on the tp axis, replicated on the dp axis: pieces to place and replicas to skip."""
    return forced_plan("megatron", "gpt", autotp.Mesh("2x2"))


@pytest.fixture(scope="module")
def pristine(plan):
    return _lowered(plan)


def test_save_load_and_consolidate(tmp_path, plan, pristine):
    ranks = _locals(pristine)
    _save_all(tmp_path, ranks, plan, step=7)
    fresh = _locals(pristine)
    for rank, (local, optimizer) in enumerate(fresh):
        assert load_sharded(tmp_path, local, optimizer, plan, rank) == 7
        assert _same(_state(local, optimizer), _state(*ranks[rank]))
    model, _ = make_model("gpt")
    full = consolidate(tmp_path)
    model.load_state_dict(full, strict=True)
    for rank, (local, _) in enumerate(ranks):  # cut up again, the full weights give back every rank's pieces
        for name, param in local.named_parameters():
            layout = parse_layout(plan.parameters[name])
            assert torch.equal(shard_tensor(full[name], layout, plan.mesh.shape, plan.mesh.coords(rank)), param)


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, plan, pristine, monkeypatch):
    ranks = _locals(pristine)
    _save_all(tmp_path, ranks, plan, step=1)
    before = [_state(*r) for r in ranks]
    for local, optimizer in ranks:  # move on, so step 2 differs from step 1
        optimizer.step()
    real_save = torch.save

    def dying_save(obj, path):
        if "rank-00000" in str(path):
            Path(path).write_bytes(b"half a file")
            raise RuntimeError("disk full")
        real_save(obj, path)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(RuntimeError, match="disk full"):
        _save_all(tmp_path, ranks, plan, step=2)
    monkeypatch.undo()
    assert read_index(tmp_path)["step"] == 1
    assert not (tmp_path / "step-00000002" / "rank-00000.pt").exists()
    fresh = _locals(pristine)
    for rank, (local, optimizer) in enumerate(fresh):
        assert load_sharded(tmp_path, local, optimizer, plan, rank) == 1
        assert _same(_state(local, optimizer), before[rank])


def test_loading_under_another_plan_or_nothing_is_a_clear_error(tmp_path, plan, pristine):
    ranks = _locals(pristine)
    _save_all(tmp_path, ranks, plan, step=1)
    other = forced_plan("replicated", "gpt", autotp.Mesh("2x2"))
    with pytest.raises(CheckpointError, match=r"was saved for plan \w+ on mesh Mesh\(axis0=2.*but this run uses plan"):
        load_sharded(tmp_path, *ranks[0], other, 0)
    with pytest.raises(CheckpointError, match=f"{INDEX} is missing"):
        load_sharded(tmp_path / "nothing", *ranks[0], plan, 0)


@pytest.mark.parametrize("texts", [("S(0)", "S(0)"), ("S(1)", "S(0)"), ("R", "S(1)"), ("S(0)", "R")])
def test_consolidate_places_pieces_split_on_both_axes(texts):
    mesh, full = autotp.Mesh("2x2"), torch.arange(8 * 6.0).reshape(8, 6)
    pieces = [shard_tensor(full, parse_layout(texts), mesh.shape, mesh.coords(r)) for r in range(mesh.size)]
    assert torch.equal(assemble("w", texts, mesh, pieces), full)
