"""The README's set-up command ends by running examples/quickstart.py: it must run, and its models must match.

It plans an MLP and a GPT at scale on the meta device, replays each plan on
a small copy over 4 gloo processes, and exits non-zero if an output or a
gradient differs from the single-device model's by more than 1e-5.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_quickstart_runs_and_matches_one_device():
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    errors = re.findall(r"^(\w+): max output error (\S+), max gradient error (\S+)", run.stdout, re.M)
    assert [name for name, _, _ in errors] == ["mlp", "gpt"], run.stdout[-2000:]
    assert all(float(out) <= 1e-5 and float(grad) <= 1e-5 for _, out, grad in errors)
    assert "S(0)" in run.stdout and "S(1)" in run.stdout  # the plans at scale really split
