"""`examples/data_parallel.py` runs: each of 4 gloo ranks trains on its own rows and ends where one process trained
on the whole batches ends (its parameters are DTensors, read whole for the comparison)."""

import subprocess
import sys
from pathlib import Path


def test_the_data_parallel_example_trains_as_one_process():
    root = Path(__file__).parents[1]
    run = subprocess.run([sys.executable, str(root / "examples" / "data_parallel.py")], cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count("max loss error") == 4 and "data parallel on 4 gloo processes" in run.stdout
