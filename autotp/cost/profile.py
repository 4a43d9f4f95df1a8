"""Hardware profiles: the device's roofline and each link class's collective curves.

A profile is JSON in ``cost_models/`` (schema below), loaded by name
(``"h100-hgx"``) or path. A name is looked up in ``./cost_models/`` (the
working directory's, where `autotp calibrate` writes by default), then among
the shipped profiles: the checkout's ``cost_models/`` when autotp runs from
one, else where a wheel installs them (``<prefix>/share/autotp/cost_models``). Every figure carries its source. The loader validates
strictly and names the file and the field of any problem.

    {"schema_version": 1, "name": ..., "description": ...,
     "device": {"name", "peak_flops": {dtype: FLOP/s}, "matmul_efficiency",
                "memory_bandwidth_Bps", "memory_efficiency", "memory_bytes",
                "launch_overhead_s", "backward_compute_factor", "sources"},
     "links": {link_class: {"latency_s", "busbw_Bps": {collective: [[bytes, B/s], ...]},
                            "source"}}}
"""

from __future__ import annotations

import json
import math
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from autotp.errors import ProfileError

SCHEMA_VERSION = 1
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
USER_DIR = Path("cost_models")  # relative: the working directory's, searched first and written by calibrate


def _shipped_dir() -> Path:
    """The shipped profiles: a checkout's ``cost_models/`` (a source tree or an editable install), else the
    data directory a wheel installed them into (under the interpreter's prefix, or the user base)."""
    candidates = [Path(__file__).resolve().parents[2] / "cost_models",
                  Path(sys.prefix) / "share" / "autotp" / "cost_models",
                  Path(site.getuserbase()) / "share" / "autotp" / "cost_models"]
    return next((d for d in candidates if any(d.glob("*.json"))), candidates[0])


PROFILE_DIR = _shipped_dir()
_DEVICE_FIELDS = {
    "peak_flops": None, "matmul_efficiency": (0.0, 1.0), "memory_bandwidth_Bps": (1e6, 1e15),
    "memory_efficiency": (0.0, 1.0), "memory_bytes": (1e6, 1e14), "launch_overhead_s": (-1e-30, 1e-2),
    "backward_compute_factor": (0.0, 10.0),
}


@dataclass(frozen=True)
class LinkCurve:
    """Collective cost on one link class: a latency and a bus-bandwidth curve per collective."""

    latency_s: float
    busbw_Bps: dict  # collective -> tuple of (message_bytes, bytes_per_s), ascending
    source: str = ""

    def busbw(self, collective: str, message_bytes: float) -> float:
        """Bus bandwidth at this message size, log-linear between measured points."""
        points = self.busbw_Bps[collective]
        if message_bytes <= points[0][0]:
            return points[0][1]
        for (b0, w0), (b1, w1) in zip(points, points[1:]):
            if message_bytes <= b1:
                t = (math.log(message_bytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
                return w0 + t * (w1 - w0)
        return points[-1][1]


@dataclass(frozen=True)
class Profile:
    """A validated hardware profile (see the module docstring for the schema)."""

    name: str
    description: str
    device: dict
    links: dict  # link class -> LinkCurve
    source_path: str | None = None
    # seconds of collectives already priced on it (`autotp.cost.comm`): a costing of 70B asks 41,000 times for some
    # 230 distinct ones; the profile is never changed once loaded, so they hold for its life
    spans: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    # `autotp.cost.reshard.edge_cost` of the redistributions already priced on it, by the steps they take
    redistributions: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def peak_flops(self, dtype) -> float:
        key = str(dtype).removeprefix("torch.")
        table = self.device["peak_flops"]
        if key not in table:
            raise ProfileError(
                f"profile {self.name!r} has no peak_flops for dtype {key!r} (it has {sorted(table)}): "
                f"add device.peak_flops.{key} to {self.source_path or 'the profile'}")
        return table[key]

    def link(self, link_class: str) -> LinkCurve:
        if link_class not in self.links:
            raise ProfileError(
                f"profile {self.name!r} has no curves for link class {link_class!r} (it has {sorted(self.links)}): "
                "pick a mesh link class the profile measures, or calibrate one")
        return self.links[link_class]

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "name": self.name, "description": self.description,
                "device": self.device,
                "links": {k: {"latency_s": v.latency_s,
                              "busbw_Bps": {c: [list(p) for p in pts] for c, pts in v.busbw_Bps.items()},
                              "source": v.source}
                          for k, v in self.links.items()}}


def profile_dirs() -> list[Path]:
    """Where a profile name is looked up, in order: ``./cost_models/``, then the shipped profiles."""
    here = USER_DIR.resolve()
    return [here, PROFILE_DIR] if here != PROFILE_DIR.resolve() else [PROFILE_DIR]


def available_profiles() -> list[str]:
    return sorted({p.stem for d in profile_dirs() for p in d.glob("*.json")})


def load_profile(name_or_path) -> Profile:
    """Load and validate a profile by name (``"h100-hgx"``), path, or pass a `Profile` through."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    if isinstance(name_or_path, dict):
        return profile_from_dict(name_or_path, "<dict>")
    path = Path(name_or_path)
    if not path.suffix:
        found = [d / f"{name_or_path}.json" for d in profile_dirs() if (d / f"{name_or_path}.json").exists()]
        path = found[0] if found else PROFILE_DIR / f"{name_or_path}.json"
    if not path.exists():
        missing = (f"no {name_or_path}.json in {' or '.join(str(d) for d in profile_dirs())}"
                   if not Path(name_or_path).suffix else f"no file {path}")
        raise ProfileError(f"unknown profile {str(name_or_path)!r}: {missing}. "
                           f"Profiles: {', '.join(available_profiles())}; or pass a path to a JSON profile")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc}); fix the file or re-run `autotp calibrate`") from exc
    return profile_from_dict(data, str(path))


def _need(d: dict, key: str, where: str, path: str):
    if not isinstance(d, dict) or key not in d:
        raise ProfileError(f"{path}: missing field {where}{key}; see docs/cost-model.md for the schema")
    return d[key]


def _number(value, field: str, path: str, lo: float, hi: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (lo < value <= hi):
        raise ProfileError(f"{path}: field {field} = {value!r} is out of range; expected a number in ({lo:g}, {hi:g}]")
    return float(value)


def _curve(points, field: str, path: str) -> tuple:
    if not isinstance(points, list) or len(points) < 2:
        raise ProfileError(f"{path}: field {field} must list at least two [message_bytes, bytes_per_s] points")
    out = []
    for i, pt in enumerate(points):
        if not (isinstance(pt, list) and len(pt) == 2):
            raise ProfileError(f"{path}: field {field}[{i}] must be [message_bytes, bytes_per_s]")
        out.append((_number(pt[0], f"{field}[{i}][0]", path, 0, 1e15), _number(pt[1], f"{field}[{i}][1]", path, 0, 1e15)))
    if any(b1 <= b0 for (b0, _), (b1, _) in zip(out, out[1:])):
        raise ProfileError(f"{path}: field {field} must be sorted by message size, ascending")
    return tuple(out)


def profile_from_dict(data: dict, path: str = "<dict>") -> Profile:
    """Validate a parsed profile; every error names ``path`` and the offending field."""
    version = _need(data, "schema_version", "", path)
    if version != SCHEMA_VERSION:
        raise ProfileError(f"{path}: schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")
    device = dict(_need(data, "device", "", path))
    for key, bounds in _DEVICE_FIELDS.items():
        value = _need(device, key, "device.", path)
        if bounds is None:
            if not isinstance(value, dict) or not value:
                raise ProfileError(f"{path}: field device.{key} must map dtype names to FLOP/s")
            for dt, v in value.items():
                _number(v, f"device.{key}.{dt}", path, 0, 1e18)
        else:
            _number(value, f"device.{key}", path, *bounds)
    links = {}
    for link_class, spec in _need(data, "links", "", path).items():
        where = f"links.{link_class}."
        latency = _number(_need(spec, "latency_s", where, path), where + "latency_s", path, -1e-30, 1.0)
        curves = _need(spec, "busbw_Bps", where, path)
        links[link_class] = LinkCurve(latency, {c: _curve(_need(curves, c, where + "busbw_Bps.", path),
                                                         f"{where}busbw_Bps.{c}", path) for c in COLLECTIVES},
                                     str(spec.get("source", "")))
    return Profile(name=str(_need(data, "name", "", path)), description=str(data.get("description", "")),
                   device=device, links=links, source_path=path)
