"""The CLI: `autotp plan file.py:factory --mesh 4` prints the plan; bad input is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from autotp.cli import main

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


def run_here(capsys, *args) -> SimpleNamespace:
    """`run` in this process (`autotp.cli.main`, as ``python -m autotp.cli`` calls it): the same exit status and
    output, without the 4 s of a fresh interpreter importing torch; `run` serves what needs a process of its
    own (the entry point, and the ranks ``verify`` starts)."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def write_factory(path: Path, body: str) -> Path:
    """A factory file that can import the example models, wherever it lives."""
    examples = Path(__file__).parents[1] / "examples"
    path.write_text(f"import sys\nsys.path.insert(0, {str(examples)!r})\n" + body)
    return path


@pytest.fixture
def factory_file(tmp_path):
    return write_factory(tmp_path / "factory.py", FACTORY)


def test_plan_prints_summary_and_writes_json(factory_file, tmp_path, capsys):
    # the output whole on every rank: Megatron's one all-reduce after fc2 (with collective matmuls the ILP
    # takes a reduce-scatter that fc2 hides, then an all-gather)
    out = run_here(capsys, "plan", f"{factory_file}:make", "--mesh", "4", "--json", str(tmp_path / "p.json"),
                   "--no-baselines", "--whole-outputs", "--no-overlap-tp")
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert ["fc1.weight", "S(0)"] in [w[:2] for w in lines] and ["fc2.weight", "S(1)"] in [w[:2] for w in lines]
    assert any(w[:3] == ["fc2", "forward", "all_reduce"] for w in lines)
    assert "capturing… " in out.stderr and "solving ILP… " in out.stderr  # progress, on stderr only
    assert (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args, message", [
    (["plan", "nowhere.py:make", "--mesh", "4"], "model file 'nowhere.py' does not exist"),
    (["plan", "{factory}:missing", "--mesh", "4"], "has no function 'missing'"),
    (["plan", "{factory}:make", "--mesh", "4y"], "is not of the form '4' or '2x4'"),
    (["plan", "{factory}:make", "--mesh", "4", "--profile", "nope"], "unknown profile 'nope'"),
    (["plan", "{factory}:make", "--mesh", "4", "--links", "warp"], "unknown link class 'warp'"),
    (["plan", "{factory}:make", "--mesh", "4", "--memory-limit", "1MB"], "no plan fits 976.6 KiB per device"),
])
def test_bad_input_is_one_line_and_exit_2(factory_file, args, message, capsys):
    # --quiet: progress lines would precede the error
    out = run_here(capsys, *[a.format(factory=factory_file) for a in args], "--quiet")
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


VERIFY_FACTORY = '''
import random

import torch
from models import GPT


class Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * (1 + random.random())  # a Python number, fixed at each capture: no plan can match it


def make():
    return GPT(vocab=64, hidden=32, heads=4, layers=1, seq=8), (torch.randint(0, 64, (2, 8)),
                                                                torch.randint(0, 64, (2, 8)))


def noisy():
    return Noisy(), (torch.randn(4, 8),)
'''


@pytest.fixture
def verify_file(tmp_path):
    return write_factory(tmp_path / "verify_factory.py", VERIFY_FACTORY)


def test_verify_passes_a_sharded_plan_and_fails_a_mismatch(verify_file, tmp_path):
    import json

    from conftest import compute_bound_profile

    profile = tmp_path / "compute-bound.json"
    profile.write_text(json.dumps(compute_bound_profile()))
    out = run("plan", f"{verify_file}:make", "--mesh", "2", "--profile", str(profile), "--json", str(tmp_path / "p.json"))
    assert out.returncode == 0, out.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert any("S(" in p for layout in plan["parameters"].values() for p in layout)  # really split
    good = run("verify", f"{verify_file}:make", "--plan", str(tmp_path / "p.json"))
    assert good.returncode == 0, good.stderr[-2000:]
    assert "OK" in good.stdout and "over 21 parameters" in good.stdout
    assert "splits nothing" not in good.stderr
    bad = run("verify", f"{verify_file}:noisy", "--mesh", "2")
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout


def test_verify_warns_that_a_plan_splitting_nothing_proves_little(verify_file, tmp_path):
    import autotp
    from autotp.solve.constraints import replicated_only

    sys.path.insert(0, str(verify_file.parent))
    try:
        from verify_factory import make
    finally:
        sys.path.remove(str(verify_file.parent))
    model, inputs = make()
    autotp.plan(model, autotp.Mesh("2"), inputs, allow=replicated_only).save(tmp_path / "whole.json")
    out = run("verify", f"{verify_file}:make", "--plan", str(tmp_path / "whole.json"))
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]
    assert "warning: this plan splits nothing" in out.stderr


def test_verify_refuses_meta_models(factory_file):
    out = run("verify", f"{factory_file}:make", "--mesh", "2")
    assert out.returncode == 2 and "needs real weights" in out.stderr


def test_the_set_of_flags_is_pinned():
    """Flags are an interface: adding or renaming one must be a visible change to this test and the docs."""
    from autotp.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    flags = {name: sorted(o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help")
             for name, p in sub.choices.items()}
    hf = ["--batch", "--config", "--ffn", "--heads", "--hidden", "--kv-heads", "--layers", "--seq", "--vocab"]
    assert flags == {
        "plan": sorted(["--bucket-cap-mb", "--decode", "--export-dtensor", "--export-tp-plan", "--inference", "--json", "--links",
                        "--memory-limit", "--mesh", "--micro-batches", "--no-baselines", "--no-optimizer-sharding",
                        "--no-overlap-gradients", "--no-overlap-tp", "--no-recompute", "--no-regather", "--chart",
                        "--precision", "--profile", "--quiet", "--recompute-layers", "--svg", "--tp-plan",
                        "--whole-outputs", "--workers", *hf]),
        "verify": sorted(["--links", "--mesh", "--plan", "--profile", "--quiet", "--tolerance", *hf]),
        "explain": ["--profile", "--quiet"],
        "calibrate": ["--backend", "--links", "--max-size", "--mesh", "--name", "--nproc", "--out", "--quiet"],
    }


def test_python_m_autotp_runs_the_cli_and_a_closed_pipe_ends_quietly(factory_file):
    """``python -m autotp`` is the same command line; ``autotp plan ... | head -1`` ends without a traceback."""
    shown = subprocess.run([sys.executable, "-m", "autotp", "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "calibrate" in shown.stdout
    command = [sys.executable, "-m", "autotp", "plan", f"{factory_file}:make", "--mesh", "4", "--no-baselines",
               "--quiet"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        first = proc.stdout.readline()
        proc.stdout.close()  # as head does after one line
        errors = proc.stderr.read()
        code = proc.wait()
    assert first.strip(), errors
    assert "Traceback" not in errors and "BrokenPipeError" not in errors, errors
    assert code in (0, 141), (code, errors)


def test_hf_configs_transformers_rejects_or_cannot_build_are_one_line():
    """A config transformers rejects, and hf: without transformers installed: one line naming the fix, exit 2."""
    rejected = run("plan", "hf:llama", "--heads", "5", "--hidden", "64", "--layers", "1", "--mesh", "2")
    missing = subprocess.run([sys.executable, "-c", "import sys; sys.modules['transformers'] = None; "
                              "from autotp.cli import main; sys.exit(main(['plan', 'hf:llama', '--mesh', '2']))"],
                             capture_output=True, text=True)
    for done, says in ((rejected, "not a multiple of the number of attention heads"), (missing, "pip install")):
        errors = [line for line in done.stderr.splitlines() if line.startswith("autotp: error:")]
        assert done.returncode == 2 and len(errors) == 1 and says in errors[0], done.stderr[-2000:]
        assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_verify_refuses_a_plan_made_for_other_shapes_before_starting_processes(tmp_path):
    small = ["hf:llama", "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
             "--vocab", "128", "--seq", "8"]
    made = run("plan", *small, "--batch", "4", "--mesh", "2", "--json", str(tmp_path / "p.json"), "--quiet")
    assert made.returncode == 0, made.stderr[-2000:]
    other = run("verify", *small, "--batch", "2", "--plan", str(tmp_path / "p.json"))
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-2000:]
    assert "plan was made for inputs [4, 8], labels=[4, 8], but hf:llama builds [2, 8]" in other.stderr
    assert "--batch and --seq" in other.stderr and "running" not in other.stderr  # no process started
