"""The ``autotp`` command line: ``autotp plan MODEL --mesh 4`` prints a sharding plan.

MODEL is ``path/to/file.py:factory``, where ``factory()`` returns
``(model, example_inputs)``; build the model on the ``meta`` device to plan
large shapes without allocating them. Bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from autotp.errors import AutotpError
from autotp.units import parse_bytes

EXIT_USAGE = 2


class UsageError(AutotpError):
    """The command line names something that does not exist."""


def load_factory(spec: str):
    """``"path/to/file.py:factory"`` -> the factory function."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise UsageError(f"model {spec!r} is not of the form path/to/file.py:factory")
    file = Path(path)
    if not file.exists():
        raise UsageError(f"model file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    if not hasattr(module, name):
        raise UsageError(f"{path} has no function {name!r}")
    return getattr(module, name)


def _call_factory(factory):
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise UsageError("the factory must return (model, example_inputs) or (model, example_inputs, example_kwargs)")
    model, inputs = made[0], made[1]
    kwargs = made[2] if len(made) == 3 else None
    return model, inputs, kwargs


def cmd_plan(args) -> int:
    from autotp.api import plan
    from autotp.mesh import Mesh

    mesh = Mesh(args.mesh, links=args.links)
    model, inputs, kwargs = _call_factory(load_factory(args.model))
    result = plan(model, mesh, inputs, kwargs, training=not args.inference, profile=args.profile,
                  memory_limit=args.memory_limit, overlap_gradients=args.overlap_gradients)
    print(result.summary())
    print(f"planned in {result.stats['plan_s']:.2f} s (ILP solve {result.stats['solve_s']:.2f} s)")
    if args.json:
        result.save(args.json)
        print(f"plan written to {args.json}")
    return 0


def _seeded_factory(spec: str):
    """The factory's model and inputs, seeded so every process builds the same weights."""
    import torch

    torch.manual_seed(0)
    return _call_factory(load_factory(spec))


def _verify_on_rank(rank, world, spec, plan):
    from autotp.runtime.verify import max_errors

    model, inputs, kwargs = _seeded_factory(spec)
    return max_errors(model, plan, tuple(inputs), rank, kwargs=kwargs)


def cmd_verify(args) -> int:
    """Run the plan on N gloo processes against the single-device model; exit 1 on a mismatch."""
    from autotp.api import plan as make_plan
    from autotp.mesh import Mesh
    from autotp.runtime import spawn
    from autotp.solve.plan import Plan

    model, inputs, kwargs = _seeded_factory(args.model)
    if any(p.is_meta for p in model.parameters()):
        raise UsageError("verify needs real weights, but the factory built the model on the meta device: "
                         "return a small model with real (random) weights")
    if args.plan:
        plan = Plan.load(args.plan)
    else:
        plan = make_plan(model, Mesh(args.mesh, links=args.links), inputs, kwargs, profile=args.profile)
    print(f"verifying on {plan.mesh.size} gloo processes ({plan.mesh}) ...", flush=True)
    errors = spawn(_verify_on_rank, plan.mesh.size, args.model, plan)
    out, grad = max(e["output"] for e in errors), max(e["gradient"] for e in errors)
    ok = out <= args.tolerance and grad <= args.tolerance
    print(f"max output error {out:.2e}, max gradient error {grad:.2e} over {errors[0]['parameters']} parameters "
          f"on every rank: {'OK' if ok else 'MISMATCH'} (tolerance {args.tolerance:g})")
    return 0 if ok else 1


def _calibrate_on_rank(rank, world, mesh, name, out, sizes):
    from autotp.calibrate import calibrate

    return calibrate(mesh, name=name, out_dir=out, sizes=sizes, progress=True)["name"]


def cmd_calibrate(args) -> int:
    """Under torchrun: measure this process group. Otherwise: spawn ``--nproc`` local gloo processes."""
    import os

    from autotp.calibrate import DEFAULT_SIZES
    from autotp.mesh import Mesh
    from autotp.runtime import spawn

    sizes = tuple(s for s in DEFAULT_SIZES if s <= parse_bytes(args.max_size))
    out = args.out
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group(args.backend or ("nccl" if _has_cuda() else "gloo"))
        if dist.get_backend() == "nccl":
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        mesh = Mesh(args.mesh or str(dist.get_world_size()), links=args.links or _default_link())
        name = _calibrate_on_rank(dist.get_rank(), dist.get_world_size(), mesh, args.name, out, sizes)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        mesh = Mesh(args.mesh or str(args.nproc), links=args.links or "loopback")
        if mesh.size != args.nproc:
            from autotp.errors import MeshError

            raise MeshError(f"--mesh {args.mesh} has {mesh.size} devices but --nproc is {args.nproc}")
        name = spawn(_calibrate_on_rank, args.nproc, mesh, args.name, out, sizes)[0]
    from pathlib import Path

    from autotp.cost.profile import PROFILE_DIR

    path = Path(out or PROFILE_DIR) / f"{name}.json"
    print(f"profile {name!r} written to {path}; use it with --profile {name if not out else path}")
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _default_link() -> str:
    return "nvlink" if _has_cuda() else "loopback"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotp", description="Automatic tensor parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a model on a mesh and print the plan")
    p.add_argument("model", help="path/to/file.py:factory, where factory() returns (model, example_inputs)")
    p.add_argument("--mesh", required=True, help="mesh shape, e.g. 4 or 2x4")
    p.add_argument("--links", default=None, help="link class per axis, e.g. ethernet,nvlink (default nvlink)")
    p.add_argument("--profile", default="h100-hgx", help="profile name in cost_models/ or a path to a JSON profile")
    p.add_argument("--inference", action="store_true", help="plan the forward pass only")
    p.add_argument("--memory-limit", default=None, help="per-device memory the plan must fit, e.g. 80GB")
    p.add_argument("--overlap-gradients", action="store_true",
                   help="let parameter-gradient reductions hide behind the backward pass (as DDP does)")
    p.add_argument("--json", default=None, help="also write the plan to this JSON file")
    p.set_defaults(fn=cmd_plan)
    v = sub.add_parser("verify", help="run a plan on gloo processes and compare with the single-device model")
    v.add_argument("model", help="path/to/file.py:factory returning a small model with real weights and inputs")
    v.add_argument("--mesh", default="2", help="mesh shape when planning here (default 2)")
    v.add_argument("--links", default=None, help="link class per axis")
    v.add_argument("--profile", default="h100-hgx", help="profile for planning here")
    v.add_argument("--plan", default=None, help="check this saved plan instead of planning")
    v.add_argument("--tolerance", type=float, default=1e-5, help="max scaled error allowed (default 1e-5)")
    v.set_defaults(fn=cmd_verify)
    c = sub.add_parser("calibrate", help="measure this machine and write a profile to cost_models/")
    c.add_argument("--nproc", type=int, default=4, help="local processes to spawn when not under torchrun")
    c.add_argument("--mesh", default=None, help="mesh shape (default: one axis over all processes)")
    c.add_argument("--links", default=None, help="link class per axis (default loopback on CPU, nvlink on GPU)")
    c.add_argument("--backend", default=None, help="gloo or nccl under torchrun (default: nccl when CUDA is there)")
    c.add_argument("--name", default=None, help="profile name (default: derived from host and process count)")
    c.add_argument("--out", default=None, help="folder for the profile (default: cost_models/)")
    c.add_argument("--max-size", default="64MiB", help="largest collective message (default 64MiB)")
    c.set_defaults(fn=cmd_calibrate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except AutotpError as exc:
        print(f"autotp: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
