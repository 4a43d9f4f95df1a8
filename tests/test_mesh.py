"""Mesh parsing, row-major rank coordinates and axis groups."""

from __future__ import annotations

import pytest

from autotp import Mesh
from autotp.errors import MeshError


def test_forms_agree():
    assert Mesh("2x4") == Mesh((2, 4)) == Mesh((2, 4), names=("axis0", "axis1"), links=("nvlink", "nvlink"))
    assert Mesh("4").shape == (4,) and Mesh(4).names == ("axis0",)
    assert Mesh("4x8", links="ethernet,nvlink").links == ("ethernet", "nvlink")


def test_row_major_coordinates_like_init_device_mesh():
    mesh = Mesh("2x4")
    assert mesh.coords(5) == (1, 1)
    assert [mesh.rank_of(mesh.coords(r)) for r in range(8)] == list(range(8))
    assert mesh.axis_groups(1) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.axis_groups(0) == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("bad, words", [("2y4", "2x4"), ("0", "positive"), ("", "2x4"), (2.5, r"a size \(4\)"),
                                        (True, "positive"), ((2, 0), "positive")])
def test_bad_shape_says_what_to_write(bad, words):
    with pytest.raises(MeshError, match=words):
        Mesh(bad)


def test_bad_links_and_names():
    with pytest.raises(MeshError, match="unknown link class 'warp'"):
        Mesh("2", links="warp")
    with pytest.raises(MeshError, match="one per axis"):
        Mesh("2x2", links=("nvlink", "nvlink", "nvlink"))
    with pytest.raises(MeshError, match="distinct axis names"):
        Mesh("2x2", names=("a", "a"))
    with pytest.raises(MeshError, match="outside a mesh of 4"):
        Mesh("4").coords(4)
