"""`calibrate()`: measure this machine and process group, fit, and write a profile to ``./cost_models/``.

Called on every rank of an initialised process group (gloo on CPU, NCCL on
GPUs; torchrun or `autotp.runtime.spawn`). Rank 0 shows progress and writes
the JSON, atomically (a temporary file, then a rename).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autotp.calibrate.fit import fit_link
from autotp.calibrate.measure import (COLLECTIVES, ENOUGH_S, collective_time_s, launch_overhead_s, matmul_flops,
                                      memory_bandwidth_Bps)
from autotp.progress import Progress
from autotp.cost.profile import SCHEMA_VERSION, USER_DIR, profile_from_dict
from autotp.errors import MeshError
from autotp.fileio import atomic_write_text
from autotp.mesh import Mesh
from autotp.runtime.groups import mesh_groups

DEFAULT_SIZES = tuple(4096 * 4 ** i for i in range(8))  # 4 KiB .. 64 MiB
CPU_DTYPES = (torch.float32, torch.bfloat16)
GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return platform.processor() or "cpu"


def _axes_by_link(mesh: Mesh) -> dict[str, int]:
    """The first mesh axis of each link class: a profile has one curve set per class."""
    out = {}
    for axis, link in enumerate(mesh.links):
        if mesh.shape[axis] > 1:
            out.setdefault(link, axis)
    return out


def calibrate(mesh=None, *, name: str | None = None, sizes=DEFAULT_SIZES, dtypes=None, repeats: int = 15,
              out_dir=None, progress: bool = True) -> dict:
    """Measure, fit and write a profile; returns the profile dict (the same on every rank)."""
    if not dist.is_initialized():
        raise MeshError("calibrate needs an initialised process group: run it under torchrun, "
                        "or use `autotp calibrate --nproc N`")
    world, rank, device = dist.get_world_size(), dist.get_rank(), _device()
    if mesh is None:
        mesh = Mesh(world, links="loopback" if device.type == "cpu" else "nvlink")
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    groups = mesh_groups(mesh, device.type)
    dtypes = dtypes or (CPU_DTYPES if device.type == "cpu" else GPU_DTYPES)
    links = _axes_by_link(mesh)
    total = len(dtypes) + 2 + len(links) * len(COLLECTIVES) * len(sizes)
    with Progress(total, enabled=progress and rank == 0) as bar:
        flops = {}
        for dtype in dtypes:
            flops[str(dtype).removeprefix("torch.")] = matmul_flops(dtype, device)
            bar.step(f"matmul {dtype}")
        bandwidth = memory_bandwidth_Bps(device)
        bar.step("memory bandwidth")
        launch = launch_overhead_s(device)
        bar.step("launch overhead")
        measured = {}
        for link, axis in links.items():
            n = mesh.shape[axis]
            times = {}
            for kind in COLLECTIVES:
                times[kind] = []
                for nbytes in sizes:
                    times[kind].append((nbytes, collective_time_s(kind, nbytes, n, groups[axis], device, repeats)))
                    bar.step(f"{kind} {nbytes >> 10} KiB on {mesh.names[axis]}")
            measured[link] = (n, times)
    profile = _profile(name or _default_name(device, world), device, world, mesh, flops, bandwidth, launch, measured)
    profile_from_dict(profile)  # validate before anything is written
    if rank == 0:
        write_profile(profile, Path(out_dir) if out_dir else USER_DIR)
    dist.barrier()
    return profile


def _default_name(device, world: int) -> str:
    return f"{'cpu' if device.type == 'cpu' else 'gpu'}-{socket.gethostname()}-{world}proc"


def _profile(name, device, world, mesh, flops, bandwidth, launch, measured) -> dict:
    where = (f"measured by `autotp calibrate` on {socket.gethostname()} with {world} processes "
             f"({dist.get_backend()}), {time.strftime('%Y-%m-%d')}")
    return {
        "schema_version": SCHEMA_VERSION, "name": name,
        "description": f"{_device_name(device)}; {world} processes on mesh {mesh}; {where}",
        "device": {
            "name": _device_name(device), "peak_flops": flops, "matmul_efficiency": 1.0,
            "memory_bandwidth_Bps": bandwidth, "memory_efficiency": 1.0,
            "memory_bytes": float(_memory_bytes(device)), "launch_overhead_s": launch,
            "backward_compute_factor": 2.0,
            "sources": {
                "peak_flops": f"best square matmul (256..1024, up to the first that takes {ENOUGH_S} s) per dtype, "
                              f"all ranks at once; {where}",
                "matmul_efficiency": "1.0: peak_flops is already the measured, achieved rate",
                "memory_bandwidth_Bps": f"64 MiB tensor copy, bytes read + written; {where}",
                "memory_efficiency": "1.0: the bandwidth is already measured",
                "memory_bytes": "physical memory of the device (GPU) or host (CPU) divided by processes",
                "launch_overhead_s": f"one-element add, mean of 200 calls; {where}",
                "backward_compute_factor": "backward of a matmul is two matmuls of the forward's size",
            },
        },
        "links": {link: fit_link(times, n, f"{where}; latency = fastest measured collective, curve fitted "
                                           "so that every measured size is reproduced (docs/cost-model.md)")
                  for link, (n, times) in measured.items()},
    }


def _memory_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages // max(dist.get_world_size(), 1)


def write_profile(profile: dict, out_dir: Path) -> Path:
    """Write ``<out_dir>/<name>.json`` atomically: an interrupted write never leaves a broken profile."""
    target = Path(out_dir) / f"{profile['name']}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, json.dumps(profile, indent=1) + "\n")
    return target
