"""Capture through torch.export: meta models plan without weights, shapes and FLOPs per node."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.capture import capture
from autotp.errors import CaptureError
from autotp.graph import build_opgraph
from models import GPT, MLP


def test_meta_model_captures_with_shapes_flops_and_bytes():
    with torch.device("meta"):
        model = MLP(64, 256)
    graph = build_opgraph(capture(model, (torch.empty(8, 64, device="meta"),)))
    linear = graph.node("linear")
    assert linear.out[0].shape == (8, 256) and linear.out[0].dtype == torch.float32
    assert linear.flops == 2 * 8 * 64 * 256
    assert linear.bytes == 4 * (8 * 64 + 256 * 64 + 8 * 256)
    assert graph.node("fc1_weight").fqn == "fc1.weight"
    assert graph.outputs == ["add_tensor_1"]
    assert all(p.is_meta for p in model.parameters())  # nothing was materialised


def test_bias_is_split_off_the_linear():
    model = MLP(8, 16)
    gm = capture(model, (torch.randn(2, 8),))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == ["aten.linear.default", "aten.add.Tensor", "aten.gelu.default", "aten.linear.default",
                       "aten.add.Tensor"]
    x = torch.randn(2, 8)
    torch.testing.assert_close(gm(x), model(x))


def test_edges_keep_repeated_inputs():
    class Square(nn.Module):
        def forward(self, x):
            return x * x

    graph = build_opgraph(capture(Square(), (torch.randn(3),)))
    assert graph.node("mul").inputs == ("x", "x")
    assert graph.graph.edges["x", "mul"]["inputs"] == (0, 1)


def test_export_failure_names_the_line():
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x
            return -x

    with pytest.raises(CaptureError, match=r"DataDependent.*test_capture\.py:\d+"):
        capture(DataDependent(), (torch.randn(3),))


def test_wrong_example_inputs_fail_clearly():
    with pytest.raises(CaptureError, match=r"example inputs .* do not match GPT.forward\(idx, targets\): missing .*'targets'"):
        capture(GPT(), (torch.zeros(2, 8, dtype=torch.long),))


def test_the_captured_module_writes_its_code_when_first_run_and_keeps_its_state():
    """`autotp.capture.lazycode`: a capture leaves the module's code to be written when it is first needed; the
    first run gives the model's output (each of the module's hooks run once), its code is the normalized graph's,
    and its state is the model's, a non-persistent buffer left out as the model leaves it out."""
    from autotp.capture.lazycode import _stale

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

        def forward(self, x):
            return self.fc(x) * self.scale

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(3, 4)
    gm = capture(model, (x,))
    assert _stale(gm)
    torch.testing.assert_close(gm(x), model(x))
    assert not _stale(gm)
    assert gm.code == gm.graph.python_code("self").src
    assert set(gm.state_dict()) == set(model.state_dict()) == {"fc.weight", "fc.bias"}
    fresh = capture(model, (x,))  # its code read first, then printed
    assert _stale(fresh) and fresh.code == fresh.graph.python_code("self").src and not _stale(fresh)
    assert fresh.code in str(fresh)


def test_a_model_file_under_a_folder_named_autotp_keeps_its_line(tmp_path):
    """Frames are told apart by the packages' own folders, not by a name in the path: a user's file in a clone or
    a project folder named ``autotp`` is the user's, and the error names its line."""
    import importlib.util

    folder = tmp_path / "autotp" / "torch"
    folder.mkdir(parents=True)
    (folder / "user_model.py").write_text(
        "import torch\n\n\nclass DataDependent(torch.nn.Module):\n    def forward(self, x):\n"
        "        if x.sum() > 0:\n            return x\n        return -x\n")
    spec = importlib.util.spec_from_file_location("user_model", folder / "user_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(CaptureError, match=r"autotp/torch/user_model\.py:6 \(if x\.sum\(\) > 0:\)"):
        capture(module.DataDependent(), (torch.randn(3),))
