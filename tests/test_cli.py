"""The CLI: `autotp plan file.py:factory --mesh 4` prints the plan; bad input is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FACTORY = '''
import torch
from models import MLP

def make():
    with torch.device("meta"):
        model = MLP(4096, 16384)
    return model, (torch.empty(8, 512, 4096, device="meta"),)
'''


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "autotp.cli", *args], capture_output=True, text=True, cwd=cwd)


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "factory.py"
    examples = Path(__file__).parents[1] / "examples"
    path.write_text(f"import sys\nsys.path.insert(0, {str(examples)!r})\n" + FACTORY)
    return path


def test_plan_prints_summary_and_writes_json(factory_file, tmp_path):
    out = run("plan", f"{factory_file}:make", "--mesh", "4", "--json", str(tmp_path / "p.json"))
    assert out.returncode == 0, out.stderr
    assert "fc1.weight   S(0)" in out.stdout and "fc2.weight   S(1)" in out.stdout
    assert "forward  all_reduce" in out.stdout
    assert (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args, message", [
    (["plan", "nowhere.py:make", "--mesh", "4"], "model file 'nowhere.py' does not exist"),
    (["plan", "{factory}:missing", "--mesh", "4"], "has no function 'missing'"),
    (["plan", "{factory}:make", "--mesh", "4y"], "is not of the form '4' or '2x4'"),
    (["plan", "{factory}:make", "--mesh", "4", "--profile", "nope"], "unknown profile 'nope'"),
    (["plan", "{factory}:make", "--mesh", "4", "--links", "warp"], "unknown link class 'warp'"),
    (["plan", "{factory}:make", "--mesh", "4", "--memory-limit", "1MB"], "no plan fits 976.6 KiB per device"),
])
def test_bad_input_is_one_line_and_exit_2(factory_file, args, message):
    out = run(*[a.format(factory=factory_file) for a in args])
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
