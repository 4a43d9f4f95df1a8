"""A wheel that installs: built from pyproject.toml, installed into a fresh virtual environment, and used from a
directory outside the checkout, it loads its shipped profiles by name, runs as ``python -m autotp``, and plans.

The environment sees the packages of the interpreter running the suite (its site-packages listed in a ``.pth``
file: torch is not downloaded), whether that is a virtual environment or the system's; the wheel's own autotp
comes first on its path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).parents[1]
CHECK = """
import autotp, torch
from autotp.cost.profile import PROFILE_DIR, available_profiles, load_profile
assert "site-packages" in autotp.__file__, autotp.__file__
assert set(available_profiles()) >= {"h100-hgx", "a100-hgx", "cpu-2core-4proc"}, available_profiles()
assert load_profile("h100-hgx").name == "h100-hgx"
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
plan = autotp.plan(model, autotp.Mesh("2"), (torch.randn(8, 64),))
print("ok", PROFILE_DIR, plan.predicted["total_s"] > 0)
"""


def test_the_wheel_installs_and_finds_its_profiles(tmp_path):
    source = tmp_path / "source"  # a copy: the build leaves nothing in the checkout, and finds nothing stale there
    for part in ("autotp", "cost_models"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels)], check=True, capture_output=True)
    wheel = next(wheels.glob("autotp-*.whl"))
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    _see_running_packages(python)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([str(python), "-c", CHECK], cwd=elsewhere, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok ") and "share/autotp/cost_models" in run.stdout and run.stdout.endswith("True\n")
    module = subprocess.run([str(python), "-m", "autotp", "--help"], cwd=elsewhere, capture_output=True, text=True)
    assert module.returncode == 0 and "calibrate" in module.stdout, module.stderr[-2000:]


def _see_running_packages(python: Path) -> None:
    """Put the running interpreter's site-packages on ``python``'s path, after its own (``--system-site-packages``
    would give the base interpreter's instead, which lacks torch when the suite runs in a virtual environment).
    Listed as plain path entries, their ``.pth`` files are not read, so an editable autotp there stays hidden."""
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    running = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(own) / "_running_packages.pth").write_text("".join(f"{d}\n" for d in running))
