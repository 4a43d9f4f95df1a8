"""Calibration: the fit reproduces what it measured, a real run writes a valid profile atomically."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from autotp import load_profile
from autotp.calibrate.fit import fit_curve, fit_link
from autotp.calibrate.measure import matmul_flops
from autotp.cost.comm import collective_time_s
from autotp.mesh import Mesh


def test_fit_reproduces_every_measured_point():
    times = {"all_reduce": [(4096, 1e-4), (65536, 2e-4), (1 << 20, 1.2e-3), (16 << 20, 1.5e-2)],
             "all_gather": [(4096, 8e-5), (65536, 1.5e-4), (1 << 20, 9e-4), (16 << 20, 1.1e-2)]}
    times["reduce_scatter"] = times["all_gather"]
    times["all_to_all"] = times["all_gather"]
    link = fit_link(times, 4, "test")
    profile = {"schema_version": 1, "name": "fit", "description": "",
               "device": {"name": "x", "peak_flops": {"float32": 1e9}, "matmul_efficiency": 1.0,
                          "memory_bandwidth_Bps": 1e9, "memory_efficiency": 1.0, "memory_bytes": 1e9,
                          "launch_overhead_s": 1e-6, "backward_compute_factor": 2.0, "sources": {}},
               "links": {"loopback": link}}
    loaded, mesh = load_profile(profile), Mesh("4", links="loopback")
    assert link["latency_s"] == 8e-5
    for kind in ("all_reduce", "all_gather"):
        for nbytes, seconds in times[kind]:
            if seconds > 1.05 * link["latency_s"]:
                assert collective_time_s(kind, 0, nbytes, mesh, loaded) == pytest.approx(seconds, rel=1e-9)


def test_latency_bound_points_borrow_a_real_bandwidth():
    curve = fit_curve([(4096, 1.0e-4), (8192, 1.01e-4), (1 << 20, 1e-3)], "all_gather", 2, 1.0e-4)
    assert all(bw > 0 for _, bw in curve)
    assert curve[0][1] == curve[1][1] == curve[2][1]


def test_matmul_sizes_stop_at_the_first_that_takes_long_enough():
    """The sizes are tried in order up to the first whose matmul takes ``enough_s``; with no such size, all."""
    for enough_s, tried in ((0.0, [64]), (math.inf, [64, 96, 128])):
        asked = []

        def sizes():
            for n in (64, 96, 128):
                asked.append(n)
                yield n

        assert matmul_flops(torch.float32, torch.device("cpu"), sizes=sizes(), enough_s=enough_s) > 0
        assert asked == tried


def test_calibrate_cli_writes_a_loadable_profile(tmp_path):
    out = subprocess.run([sys.executable, "-m", "autotp.cli", "calibrate", "--nproc", "2", "--name", "ci-probe",
                          "--out", str(tmp_path), "--max-size", "64KiB"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    path = tmp_path / "ci-probe.json"
    data = json.loads(path.read_text())
    profile = load_profile(str(path))
    assert profile.name == "ci-probe" and set(profile.links) == {"loopback"}
    assert profile.device["peak_flops"]["float32"] > 0 and profile.device["launch_overhead_s"] > 0
    assert [b for b, _ in data["links"]["loopback"]["busbw_Bps"]["all_reduce"]] == [4096, 16384, 65536]
    assert "autotp calibrate" in profile.device["sources"]["peak_flops"]
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file and a rename
    assert "[" in out.stderr and "] " in out.stderr  # the progress bar


def test_calibrate_under_torchrun(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "autotp.cli", "calibrate", "--name", "trun", "--out", str(tmp_path),
                          "--max-size", "16KiB"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("written to") == 1  # rank 0 reports
    assert load_profile(str(tmp_path / "trun.json")).links["loopback"].latency_s > 0


def test_shipped_cpu_profile_is_from_calibration():
    profile = load_profile("cpu-2core-4proc")
    assert "autotp calibrate" in profile.description
    assert "loopback" in profile.links
