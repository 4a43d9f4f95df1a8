"""Profiles: the shipped one loads with sources; a broken one names the file and the field."""

from __future__ import annotations

import json

import pytest

from autotp import load_profile
from autotp.cost.comm import collective_time_s
from autotp.cost.profile import COLLECTIVES
from autotp.errors import ProfileError
from autotp.mesh import Mesh
from conftest import compute_bound_profile


def test_shipped_h100_profile_is_complete_and_sourced():
    profile = load_profile("h100-hgx")
    assert set(profile.links) >= {"nvlink", "infiniband"}
    for key in ("peak_flops", "memory_bandwidth_Bps", "launch_overhead_s"):
        assert profile.device["sources"][key]
    for link in profile.links.values():
        assert link.source
        for c in COLLECTIVES:
            sizes = [b for b, _ in link.busbw_Bps[c]]
            assert sizes[0] <= 4096 and sizes[-1] >= 64 * 2**20


def test_bandwidth_grows_with_message_size():
    """Below ~16 MiB even NVLink reaches only a fraction of its peak bus bandwidth."""
    link = load_profile("h100-hgx").link("nvlink")
    assert link.busbw("all_reduce", 64 * 1024) < 0.2 * link.busbw("all_reduce", 1 << 30)


def test_collective_time_formula():
    profile = load_profile(compute_bound_profile())
    mesh = Mesh("4")
    t = collective_time_s("all_reduce", 0, 1e6, mesh, profile)
    assert t == pytest.approx(1e-9 + 2 * 3 / 4 * 1e6 / 1e14)
    assert collective_time_s("all_gather", 0, 1e6, mesh, profile) == pytest.approx(1e-9 + 3 / 4 * 1e6 / 1e14)
    assert collective_time_s("all_reduce", 0, 1e6, Mesh("1"), profile) == 0.0


def _write(tmp_path, data) -> str:
    path = tmp_path / "broken.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_malformed_profiles_name_file_and_field(tmp_path):
    with pytest.raises(ProfileError, match=r"broken\.json: not valid JSON"):
        load_profile(_write(tmp_path, "{"))
    data = compute_bound_profile()
    del data["device"]["memory_bandwidth_Bps"]
    with pytest.raises(ProfileError, match=r"broken\.json: missing field device\.memory_bandwidth_Bps"):
        load_profile(_write(tmp_path, data))
    data = compute_bound_profile()
    data["device"]["matmul_efficiency"] = 3.0
    with pytest.raises(ProfileError, match=r"device\.matmul_efficiency = 3\.0 is out of range"):
        load_profile(_write(tmp_path, data))
    data = compute_bound_profile()
    data["links"]["nvlink"]["busbw_Bps"]["all_gather"] = [[10, 1e9], [5, 1e9]]
    with pytest.raises(ProfileError, match=r"links\.nvlink\.busbw_Bps\.all_gather must be sorted"):
        load_profile(_write(tmp_path, data))
    with pytest.raises(ProfileError, match="unknown profile 'nope'.*h100-hgx"):
        load_profile("nope")


def test_missing_dtype_or_link_says_what_to_add():
    profile = load_profile(compute_bound_profile())
    with pytest.raises(ProfileError, match="no peak_flops for dtype 'bfloat16'"):
        profile.peak_flops("torch.bfloat16")
    with pytest.raises(ProfileError, match="no curves for link class 'pcie'"):
        profile.link("pcie")


@pytest.mark.parametrize("name", sorted(p.stem for p in __import__("autotp").cost.profile.PROFILE_DIR.glob("*.json")))
def test_every_shipped_profile_loads_and_says_where_its_figures_come_from(name):
    profile = load_profile(name)
    assert profile.links, name
    assert all(link.source for link in profile.links.values()), name
    assert all(profile.device["sources"].get(k) for k in ("peak_flops", "memory_bandwidth_Bps")), name
