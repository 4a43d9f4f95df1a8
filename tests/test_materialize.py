"""Materialising from weights: sources read exactly `shard_tensor`'s pieces; a meta model runs exactly.

The gloo test builds transformers' Llama twice: for real on one device (the
reference) and under `empty_parameters` with its shards read from a
safetensors file, on a 2x2 mesh.
"""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch

import autotp
from autotp.interop import pins_from_styles
import hf_models
from autotp.errors import MaterializeError
from autotp.lower import shard_tensor
from autotp.lower.rewrite import parameter_aliases
from autotp.materialize import (SafetensorsSource, StateDictSource, empty_parameters, load_shard, save_safetensors,
                                shard_ranges)
from autotp.placement import parse_layout
from autotp.runtime import spawn
from autotp.runtime.verify import scaled_error
from conftest import compute_bound_profile

LAYOUTS = {  # mesh -> layouts, including two axes on one dim and the two axes on different dims
    (4,): [("R",), ("S(0)",), ("S(1)",), ("S(2)",)],
    (2, 2): [("S(0)", "R"), ("R", "S(1)"), ("S(0)", "S(0)"), ("S(1)", "S(0)"), ("S(2)", "S(1)")],
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    torch.manual_seed(0)
    tensors = {"w3": torch.randn(8, 12, 4), "bf": torch.randn(4, 8, 4).to(torch.bfloat16),
               "ints": torch.arange(4 * 8 * 4).reshape(4, 8, 4)}
    path = tmp_path_factory.mktemp("st") / "w.safetensors"
    save_safetensors(tensors, path)
    torch.save(tensors, path.with_suffix(".pt"))
    return tensors, path


def test_sources_read_exactly_the_shards_shard_tensor_cuts(weights):
    tensors, path = weights
    mapped = torch.load(path.with_suffix(".pt"), mmap=True)
    sources = [StateDictSource(tensors), StateDictSource(mapped), SafetensorsSource(path)]
    for mesh_shape, layouts in LAYOUTS.items():
        mesh = autotp.Mesh("x".join(map(str, mesh_shape)))
        for texts in layouts:
            layout = parse_layout(texts)
            for rank in range(mesh.size):
                coords = mesh.coords(rank)
                for name, full in tensors.items():
                    want = shard_tensor(full, layout, mesh_shape, coords)
                    for source in sources:
                        got = source.read(name, shard_ranges(full.shape, layout, mesh_shape, coords))
                        where = f"{type(source).__name__} {name} {texts} rank {rank}"
                        assert got.dtype == full.dtype and torch.equal(got, want), where


def test_safetensors_file_is_the_standard_format(weights):
    tensors, path = weights
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])  # read by hand: an 8-byte length, a JSON header, the data
    header, data_start = json.loads(raw[8:8 + length]), 8 + length
    assert data_start % 8 == 0
    begin, end = header["bf"].pop("data_offsets")
    assert header["bf"] == {"dtype": "BF16", "shape": [4, 8, 4]} and end - begin == 256
    begin, end = header["w3"]["data_offsets"]
    w3 = torch.frombuffer(bytearray(raw[data_start + begin:data_start + end]), dtype=torch.float32)
    assert torch.equal(w3.reshape(8, 12, 4), tensors["w3"])


def test_tied_tensors_are_saved_under_each_name(tmp_path):
    weight = torch.randn(6, 4)
    save_safetensors({"embed.weight": weight, "head.weight": weight, "head.t": weight.t()}, tmp_path / "t.safetensors")
    source = SafetensorsSource(tmp_path / "t.safetensors")
    assert source.spec("head.t") == ((4, 6), torch.float32)
    for name, want in (("embed.weight", weight), ("head.weight", weight), ("head.t", weight.t())):
        assert torch.equal(source.read(name, [(0, s) for s in want.shape]), want), name


def test_broken_safetensors_files_name_the_file_and_the_way_out(weights, tmp_path):
    _, path = weights
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    broken = {"short": b"abc", "header": raw[:8] + b"{" * length + raw[8 + length:], "truncated": raw[:-10]}
    for what, content in broken.items():
        bad = tmp_path / f"{what}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(MaterializeError, match=re.escape(f"{bad} is not a readable safetensors file (")
                           + r".*\): re-write it, or pass the right path"):
            SafetensorsSource(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MaterializeError, match="no .safetensors files in"):
        SafetensorsSource(tmp_path / "empty")


def test_bad_weights_name_the_tensor(weights):
    tensors, _ = weights
    source = StateDictSource(tensors)
    with pytest.raises(MaterializeError, match="'missing' is not in the weights"):
        load_shard(source, "missing", torch.empty(8, 12, 4, device="meta"), parse_layout(("R",)), (4,), (0,))
    with pytest.raises(MaterializeError, match=r"'w3' has shape \[8, 12, 4\] in the weights but \[8, 12\]"):
        load_shard(source, "w3", torch.empty(8, 12, device="meta"), parse_layout(("R",)), (4,), (0,))


def test_empty_parameters_keeps_buffers_real_and_parameters_unallocated():
    with empty_parameters():
        model, _, _ = hf_models.llama()
    assert all(p.device.type == "meta" for p in model.parameters())
    reference, _, _ = hf_models.llama()
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone after the block


def _errors(local, reference, plan, rank, out, ref_out) -> dict:
    """Output and every gradient error, this rank's slice against the single-device model."""
    coords = plan.mesh.coords(rank)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    grads = []
    for names, param in parameter_aliases(local):
        name = next(n for n in names if n in plan.parameters)
        want = shard_tensor(ref_params[name].grad, parse_layout(plan.parameters[name]), plan.mesh.shape, coords)
        grads.append(scaled_error(param.grad, want) if param.grad is not None else float("inf"))
    return {"output": scaled_error(out, ref_out), "gradient": max(grads), "parameters": len(grads)}


def _llama_from_safetensors(rank, world, plan, path):
    reference, args, kwargs = hf_models.build("llama")
    ref_loss = reference(*args, **kwargs).loss
    ref_loss.backward()
    with empty_parameters():
        meta_model, _, _ = hf_models.build("llama")
    local = autotp.parallelize(meta_model, plan, weights=SafetensorsSource(path))
    loss = local(*args, **kwargs).loss
    loss.backward()
    return _errors(local, reference, plan, rank, loss, ref_loss)


def test_meta_model_with_weights_is_exact_on_gloo(tmp_path):
    llama, args, kwargs = hf_models.build("llama")
    save_safetensors(llama.state_dict(), tmp_path / "llama.safetensors")
    # Megatron's attention on tp, the MLP's weights split on both axes, the rest replicated; the ILP chooses the
    # activations
    pin = pins_from_styles(llama, {"model.layers.*.self_attn.q_proj": "colwise",
                                   "model.layers.*.self_attn.o_proj": "rowwise"}, 2)
    pin |= {f"model.layers.{i}.mlp.{name}.weight": split for i in range(2)
            for name, split in (("gate_proj", ("S(1)", "S(0)")), ("up_proj", ("S(1)", "S(0)")),
                                ("down_proj", ("S(0)", "S(1)")))}
    plan = autotp.plan(llama, autotp.Mesh("2x2"), args, kwargs, profile=compute_bound_profile(), pin=pin)
    assert any(p[0] != "R" for p in plan.parameters.values()) and any(p[1] != "R" for p in plan.parameters.values())
    for rank, err in enumerate(spawn(_llama_from_safetensors, 4, plan, tmp_path / "llama.safetensors")):
        assert err["output"] <= 1e-5 and err["gradient"] <= 1e-5, f"rank {rank}: {err}"
        assert err["parameters"] == len(plan.parameters)


def _meta_buffer(rank, plan, path):
    with torch.device("meta"):
        meta_model, _, _ = hf_models.build("llama")
    try:
        autotp.parallelize(meta_model, plan, rank=rank, groups={}, weights=SafetensorsSource(path))
    except MaterializeError as exc:
        return str(exc)
    return "no error"


def test_a_buffer_left_on_meta_is_an_error(tmp_path):
    llama, args, kwargs = hf_models.build("llama")
    save_safetensors(llama.state_dict(), tmp_path / "llama.safetensors")
    plan = autotp.plan(llama, autotp.Mesh("1"), args, kwargs, profile=compute_bound_profile())
    message = _meta_buffer(0, plan, tmp_path / "llama.safetensors")
    assert "buffer 'model.rotary_emb.inv_freq' is on the meta device" in message
