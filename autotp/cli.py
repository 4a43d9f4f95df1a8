"""The ``autotp`` command line: ``plan``, ``explain``, ``verify``, ``calibrate``.

``autotp plan MODEL --mesh 4`` prints the plan as a report (parameters,
collectives per layer, step time, memory, baselines); MODEL is a factory file,
a transformers architecture or a saved plan (`autotp.model_spec`). Progress
goes to stderr unless ``--quiet``. Bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from autotp.api import DEFAULT_PROFILE, plan
from autotp.cost.profile import load_profile
from autotp.errors import AutotpError
from autotp.fileio import atomic_write_text
from autotp.interop import dtensor_plan, pins_from_styles, styles_from_plan
from autotp.mesh import Mesh
from autotp.model_spec import ModelSpec, build, is_plan_file, parse_model
from autotp.progress import Stages
from autotp.report.baselines import NAMES as BASELINES, baseline_plans
from autotp.report.table import format_plan
from autotp.solve.constraints import same_as
from autotp.solve.plan import Plan
from autotp.units import parse_bytes

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader closed the pipe


class UsageError(AutotpError):
    """The command line names something that does not exist."""


MODEL_HELP = "path/to/file.py:factory, hf:ARCH (llama, mistral, qwen2, gpt2, bert) or a saved plan.json"
HF_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


def _spec_from_args(args) -> ModelSpec:
    overrides = {k: getattr(args, k) for k in HF_FLAGS}
    return parse_model(args.model, overrides, args.config, args.batch, args.seq)


def _stages(args) -> Stages:
    return Stages(enabled=not args.quiet)


def _saved_plan(path: str) -> Plan:
    saved = Plan.load(path)
    if not saved.source:
        raise UsageError(f"{path} does not say which model it was made from (no 'source' field): "
                         "re-plan with `autotp plan MODEL --json` to re-cost or explain it")
    return saved


def _recost_setup(args):
    """A saved plan: the same model, mesh shape and placements, optionally under other links or profile."""
    given = [f"--{k.replace('_', '-')}" for k in HF_FLAGS + ("batch", "seq", "config") if getattr(args, k)]
    given += ["--tp-plan"] if args.tp_plan else []
    if given:
        raise UsageError(f"{' '.join(given)} cannot change a saved plan's model: re-plan from the model instead")
    saved = _saved_plan(args.model)
    if args.mesh and Mesh(args.mesh).shape != saved.mesh.shape:
        raise UsageError(f"--mesh {args.mesh} differs from the saved plan's mesh {saved.mesh}: a plan is re-costed "
                         "on its own mesh shape (use --links and --profile for other hardware)")
    if args.inference and saved.training:
        raise UsageError(f"{args.model} was planned for training: re-plan from the model with --inference")
    mesh = Mesh(saved.mesh.shape, names=saved.mesh.names, links=args.links or saved.mesh.links)
    return ModelSpec.from_source(saved.source), mesh, saved.training, args.profile or saved.profile, saved


def cmd_plan(args) -> int:
    """Plan MODEL (or re-cost a saved plan), print the report, write what was asked for."""
    stages = _stages(args)
    if is_plan_file(args.model):
        spec, mesh, training, profile, saved = _recost_setup(args)
    else:
        if not args.mesh:
            raise UsageError("--mesh is required unless MODEL is a saved plan.json: e.g. --mesh 4 or --mesh 2x4")
        spec, mesh, training = _spec_from_args(args), Mesh(args.mesh, links=args.links), not args.inference
        profile, saved = args.profile or DEFAULT_PROFILE, None
    load_profile(profile)  # a bad name fails here, before the model is built
    if args.decode is not None:
        return _plan_decoding(args, spec, mesh, profile, stages)
    with stages.stage(f"building {spec.model}"):
        model, inputs, kwargs = build(spec, meta=True, training=training)
    pins = _tp_plan_pins(args.tp_plan, model, mesh) if args.tp_plan else None
    options = dict(training=training, profile=profile, memory_limit=_memory_limit(args.memory_limit),
                   overlap_gradients=args.overlap_gradients, bucket_cap_mb=args.bucket_cap_mb,
                   whole_outputs=args.whole_outputs, precision=args.precision,
                   optimizer_sharding=args.optimizer_sharding, recompute=args.recompute, regather=args.regather,
                   overlap_tp=args.overlap_tp)
    micro, workers = _micro_batches(args.micro_batches), _workers(args.workers)
    if saved is not None:  # a re-cost runs the program as the plan was made to run
        runtime = saved.runtime
        options.update(overlap_gradients=runtime["overlap_gradients"], whole_outputs=runtime["whole_outputs"],
                       bucket_cap_mb=runtime["bucket_bytes"] / 2**20, precision=runtime.get("precision", "auto"),
                       overlap_tp=runtime.get("overlap_tp", False))
        micro = saved.micro_batches
    result = plan(model, mesh, inputs, kwargs, pin=pins, allow=same_as(saved) if saved else None, progress=stages,
                  micro_batches=micro, workers=workers, **options)
    result.source = spec.to_source()
    baselines = None
    if not args.no_baselines:
        with stages.stage(f"costing the baselines ({', '.join(BASELINES)})"):
            baselines = baseline_plans(model, mesh, inputs, kwargs, **options)
    print(format_plan(result, baselines))
    print(f"planned in {result.stats['plan_s']:.2f} s (ILP solve {result.stats['solve_s']:.2f} s)")
    _write_outputs(args, result, model, inputs, kwargs, baselines, stages)
    return 0


def _plan_decoding(args, spec, mesh, profile, stages) -> int:
    """``--decode L``: plan generation, a prefill of the example batch (``--batch`` prompts of ``--seq`` tokens)
    and a decode step with a cache of L positions (`autotp.decoding`); print both plans and the per-token time."""
    from autotp.decoding import plan_decoding

    if not args.inference or spec.kind != "hf":
        raise UsageError("--decode plans generation: give an hf: causal LM with --inference, e.g. "
                         "autotp plan hf:llama --inference --batch 1 --seq 1024 --decode 4096 --mesh 8")
    unsupported = [flag for flag, value in (("--tp-plan", args.tp_plan), ("--svg", args.svg), ("--chart", args.chart),
                                            ("--export-tp-plan", args.export_tp_plan),
                                            ("--export-dtensor", args.export_dtensor)) if value]
    if unsupported:
        raise UsageError(f"{', '.join(unsupported)} cannot be combined with --decode yet: drop them, or plan "
                         "without --decode")
    if args.json and not args.json.endswith(".json"):
        raise UsageError(f"--json {args.json}: with --decode give a name ending in .json; the two plans are written "
                         "beside it as NAME.prefill.json and NAME.decode.json")
    with stages.stage(f"building {spec.model}"):
        model, inputs, _ = build(spec, meta=True, training=False)
    batch, prompt = inputs[0].shape
    plans = plan_decoding(model, mesh, batch, prompt, args.decode, profile=profile, progress=stages,
                          memory_limit=_memory_limit(args.memory_limit), overlap_tp=args.overlap_tp)
    for name, result in (("prefill", plans.prefill), ("decode step", plans.decode)):
        result.source = spec.to_source()
        print(f"=== {name} ===\n{format_plan(result)}\n")
    print(plans.summary())
    if args.json:
        for name, result in (("prefill", plans.prefill), ("decode", plans.decode)):
            path = f"{args.json[:-len('.json')]}.{name}.json"
            result.save(path)
            print(f"{name} plan written to {path}")
    return 0


def _micro_batches(text: str):
    """``--micro-batches``: ``auto`` or a positive count."""
    return _auto_or_count(text, "--micro-batches")


def _workers(text: str):
    """``--workers``: ``auto`` or a positive count."""
    return _auto_or_count(text, "--workers")


def _auto_or_count(text: str, flag: str):
    if text == "auto":
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise UsageError(f"{flag} takes 'auto' or a positive count such as 4, not {text!r}")
    return count


def _memory_limit(text: str):
    """``--memory-limit``: ``auto`` (the default limit), ``none`` (no limit) or a size such as ``80GB``."""
    return None if text.lower() == "none" else text


def _tp_plan_pins(path: str, model, mesh) -> dict:
    """An HF-style ``{module pattern: "colwise" | "rowwise"}`` file as pins on the last mesh axis."""
    try:
        styles = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read --tp-plan {path}: {exc}") from None
    if not isinstance(styles, dict) or not all(isinstance(v, str) for v in styles.values()):
        raise UsageError(f"--tp-plan {path} must be a JSON object of module pattern -> \"colwise\" | \"rowwise\"")
    return pins_from_styles(model, styles, mesh.ndim)


def _write_outputs(args, result, model, inputs, kwargs, baselines, stages) -> None:
    if args.json:
        result.save(args.json)
        print(f"plan written to {args.json}")
    if args.export_tp_plan:
        atomic_write_text(args.export_tp_plan, json.dumps(styles_from_plan(result, model), indent=1, sort_keys=True)
                          + "\n")
        print(f"Hugging Face tp_plan written to {args.export_tp_plan}")
    if args.export_dtensor:
        atomic_write_text(args.export_dtensor, dtensor_source(result, model, as_python=args.export_dtensor.endswith(".py")))
        print(f"DTensor parallelize_module plan written to {args.export_dtensor}")
    if args.svg:
        from autotp.report.rebuild import rebuild_graph
        from autotp.report.svg import plan_svg

        with stages.stage("drawing the op graph"):
            atomic_write_text(args.svg, plan_svg(result, rebuild_graph(model, inputs, kwargs)))
        print(f"op graph written to {args.svg}")
    if args.chart:
        from autotp.report.chart import baseline_chart

        atomic_write_text(args.chart, baseline_chart(result, baselines or []))
        print(f"chart written to {args.chart}")


def dtensor_source(result, model, as_python: bool) -> str:
    """DTensor's ``parallelize_module`` plan as a Python file, or as JSON of module path -> style class name."""
    exported = {path: type(style).__name__ for path, style in dtensor_plan(result, model).items()}
    if not as_python:
        return json.dumps(exported, indent=1, sort_keys=True) + "\n"
    lines = ['"""DTensor parallelize_module plan exported by autotp; pass it to parallelize_module(model, mesh, plan)."""',
             "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel", "", "plan = {"]
    lines += [f"    {path!r}: {style}()," for path, style in exported.items()] + ["}", ""]
    return "\n".join(lines)


def _verify_on_rank(rank, world, spec, plan):
    from autotp.runtime.verify import max_errors

    model, inputs, kwargs = build(spec, meta=False)
    return max_errors(model, plan, tuple(inputs), rank, kwargs=kwargs)


def _splits(checked: Plan) -> bool:
    """Whether any parameter or op output of the plan is split over a mesh axis."""
    layouts = list(checked.parameters.values()) + [n.out for n in checked.nodes.values()]
    return any(p.startswith("S(") for layout in layouts for p in layout)


def _check_inputs_fit(checked: Plan, inputs, kwargs, spec) -> None:
    """Refuse, before any process starts, a model whose example inputs are not the ones the plan was made for
    (every rank would die in its first reshape)."""
    from autotp.capture.export import example_specs

    given = example_specs(tuple(inputs), kwargs)
    planned = {k: checked.inputs.get(k) for k in ("args", "kwargs")}
    if given == planned:
        return
    shapes = lambda specs: ", ".join(  # noqa: E731
        [str(s.get("shape", s.get("value"))) for s in specs["args"]]
        + [f"{k}={s.get('shape', s.get('value'))}" for k, s in sorted(specs["kwargs"].items())])
    hint = " (for hf: models, --batch and --seq)" if spec.kind == "hf" else ""
    raise UsageError(f"the plan was made for inputs {shapes(planned)}, but {spec.model} builds "
                     f"{shapes(given)}: build the model at the plan's shapes{hint}, or plan again at these")


def cmd_verify(args) -> int:
    """Run the plan on N gloo processes against the single-device model; exit 1 on a mismatch."""
    from autotp.runtime import spawn

    spec = _spec_from_args(args)
    stages = _stages(args)
    with stages.stage(f"building {spec.model}"):
        model, inputs, kwargs = build(spec, meta=False)
    if any(p.is_meta for p in model.parameters()):
        raise UsageError("verify needs real weights, but the factory built the model on the meta device: "
                         "return a small model with real (random) weights")
    if args.plan:
        checked = Plan.load(args.plan)
    else:
        checked = plan(model, Mesh(args.mesh, links=args.links), inputs, kwargs, profile=args.profile,
                       progress=stages)
    _check_inputs_fit(checked, inputs, kwargs, spec)
    if not _splits(checked):
        print("warning: this plan splits nothing (every device runs the whole model and only gradient sums, if "
              "any, are checked): an OK says little; a larger model, or a profile in which splitting pays, gives a "
              "plan worth verifying", file=sys.stderr)
    print(f"verifying on {checked.mesh.size} gloo processes ({checked.mesh}) ...", flush=True)
    with stages.stage(f"running {checked.mesh.size} processes"):
        errors = spawn(_verify_on_rank, checked.mesh.size, spec, checked)
    out, grad = max(e["output"] for e in errors), max(e["gradient"] for e in errors)
    ok = out <= args.tolerance and grad <= args.tolerance
    for mismatch in sorted({m for e in errors for m in e["mismatches"]}):
        print(f"mismatch: {mismatch}")
    print(f"max output error {out:.2e}, max gradient error {grad:.2e} over {errors[0]['parameters']} parameters "
          f"on every rank: {'OK' if ok else 'MISMATCH'} (tolerance {args.tolerance:g}, in float32 terms)")
    return 0 if ok else 1


def cmd_explain(args) -> int:
    """Why an op (or the ops consuming a parameter) got its placement: every strategy it had, costed."""
    from autotp.cost.profile import load_profile as load
    from autotp.report.explain import explain_node, format_explanation, resolve
    from autotp.api import replays_layers
    from autotp.report.rebuild import all_strategies, chosen_strategies, rebuild_graph

    saved = _saved_plan(args.plan)
    profile = load(args.profile or saved.profile)
    stages = _stages(args)
    spec = ModelSpec.from_source(saved.source)
    with stages.stage(f"rebuilding {spec.model}"):
        model, inputs, kwargs = build(spec, meta=True, training=saved.training)
        graph = rebuild_graph(model, inputs, kwargs, replay_layers=replays_layers(saved))
        strategies = all_strategies(graph, saved.mesh, training=saved.training)
        chosen = chosen_strategies(graph, strategies, saved)
    if len(chosen) != len(graph):
        raise UsageError(f"{args.plan} does not match its model any more ({len(graph) - len(chosen)} ops differ): "
                         "re-plan it")
    for name in resolve(graph, saved, args.name):
        options = explain_node(graph, strategies, chosen, name, saved.mesh, profile, saved.training)
        print(format_explanation(graph, saved, name, options))
        print()
    return 0


def _calibrate_on_rank(rank, world, mesh, name, out, sizes, progress=True):
    from autotp.calibrate import calibrate

    return calibrate(mesh, name=name, out_dir=out, sizes=sizes, progress=progress)["name"]


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
        name = _calibrate_on_rank(dist.get_rank(), dist.get_world_size(), mesh, args.name, out, sizes,
                                  not args.quiet)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        mesh = Mesh(args.mesh or str(args.nproc), links=args.links or "loopback")
        if mesh.size != args.nproc:
            from autotp.errors import MeshError

            raise MeshError(f"--mesh {args.mesh} has {mesh.size} devices but --nproc is {args.nproc}")
        name = spawn(_calibrate_on_rank, args.nproc, mesh, args.name, out, sizes, not args.quiet)[0]
    from pathlib import Path

    from autotp.cost.profile import USER_DIR

    path = (Path(out) if out else USER_DIR.resolve()) / f"{name}.json"
    print(f"profile {name!r} written to {path}; use it with --profile {name if not out else path}")
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _default_link() -> str:
    return "nvlink" if _has_cuda() else "loopback"


def _add_hf_flags(p) -> None:
    """Sizes of an hf:ARCH model (each maps to its config class's field) and of its example batch."""
    hf = p.add_argument_group("hf:ARCH models (built from the config class, random weights, nothing downloaded)")
    for flag, what in (("layers", "layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads (grouped-query attention)"), ("ffn", "MLP inner size"),
                       ("vocab", "vocabulary size"), ("batch", "example batch (default 8)"),
                       ("seq", "example sequence length (default 1024)")):
        hf.add_argument(f"--{flag}", type=int, default=None, help=what)
    hf.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="any other config field, e.g. --config tie_word_embeddings=true (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotp", description="Automatic tensor parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a model on a mesh (or re-cost a saved plan) and print the report")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--mesh", default=None, help="mesh shape, e.g. 4 or 2x4 (required unless MODEL is a plan.json)")
    p.add_argument("--links", default=None, help="link class per axis, e.g. ethernet,nvlink (default nvlink)")
    p.add_argument("--profile", default=None,
                   help=f"profile name in cost_models/ or a path to a JSON profile (default {DEFAULT_PROFILE})")
    p.add_argument("--inference", action="store_true", help="plan the forward pass only")
    p.add_argument("--decode", type=int, default=None, metavar="L",
                   help="with --inference, for an hf: causal LM: plan generation, the prefill of --batch prompts of "
                        "--seq tokens and the decode step with a key/value cache of L positions (prompt and new "
                        "tokens), and print both plans and the predicted time per token")
    p.add_argument("--memory-limit", default="auto",
                   help="per-device memory the plan must fit, e.g. 80GB; 'none' lifts it (default: "
                        "the device's memory less 5%%)")
    p.add_argument("--no-overlap-gradients", dest="overlap_gradients", action="store_false",
                   help="run data parallelism's gradient sums where they are used, not in buckets behind the "
                        "backward pass (as DDP does, the default)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="gradient bucket size in MiB (default 25, as DDP)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "mixed", "bf16"],
                   help="how the parameters are trained, for their memory: mixed is bf16 weights with fp32 "
                        "gradients, master weights and Adam moments (18 B a parameter); auto reads each "
                        "parameter's dtype (default)")
    p.add_argument("--no-optimizer-sharding", dest="optimizer_sharding", action="store_false",
                   help="keep every optimizer state and gradient whole (by default the plan may split them where a "
                        "parameter is whole, ZeRO-1 and 2, when memory binds or it is faster)")
    p.add_argument("--micro-batches", default="auto",
                   help="run the batch as this many micro-batches a step, gradients summed once; 'auto' (the "
                        "default) tries more while memory binds and keeps the fastest plan")
    p.add_argument("--workers", default="auto",
                   help="search this many micro-batch counts at once, each in a forked process (the same plan); "
                        "'auto' (the default) is one per core, 1 one at a time")
    p.add_argument("--no-recompute", dest="recompute", action="store_false",
                   help="keep every activation (by default the plan may recompute classes of identical layers in "
                        "backward when memory binds)")
    p.add_argument("--recompute-layers", dest="recompute", action="store_const", const="layers",
                   help="let the plan recompute any number of a class's layers, not only all or none (finer, "
                        "slower to solve)")
    p.add_argument("--no-regather", dest="regather", action="store_false",
                   help="keep every all-gathered input backward reads (by default the plan may keep the shard and "
                        "gather it again in backward when memory binds)")
    p.add_argument("--no-overlap-tp", dest="overlap_tp", action="store_false",
                   help="run every tensor-parallel all-gather and reduce-scatter whole, before or after its matmul "
                        "(by default one feeding or following a matmul runs as a collective matmul, in chunks the "
                        "matmul hides)")
    p.add_argument("--whole-outputs", action="store_true",
                   help="return every output replicated on every rank (default: each rank its own rows where "
                        "the plan splits the batch, as with DDP; whole otherwise)")
    _add_hf_flags(p)
    p.add_argument("--tp-plan", default=None, help="cost and compile this Hugging Face-style tp_plan JSON "
                   "(module pattern -> colwise | rowwise) instead of choosing weight splits")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the replicated, data-parallel, megatron and megatron-sp baselines (each is one more "
                        "solve)")
    p.add_argument("--json", default=None, help="also write the plan to this JSON file")
    p.add_argument("--svg", default=None, help="draw the op graph, identical layers folded, to this SVG file")
    p.add_argument("--chart", default=None, help="draw step time and memory against the baselines to this SVG file")
    p.add_argument("--export-tp-plan", default=None, help="write the plan as a Hugging Face tp_plan JSON")
    p.add_argument("--export-dtensor", default=None,
                   help="write the plan as a DTensor parallelize_module plan (.py, or .json of class names)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(fn=cmd_plan)
    v = sub.add_parser("verify", help="run a plan on gloo processes and compare with the single-device model")
    v.add_argument("model", help="path/to/file.py:factory returning a small model with real weights, or hf:ARCH")
    v.add_argument("--mesh", default="2", help="mesh shape when planning here (default 2)")
    v.add_argument("--links", default=None, help="link class per axis")
    v.add_argument("--profile", default=DEFAULT_PROFILE, help="profile for planning here")
    v.add_argument("--plan", default=None, help="check this saved plan instead of planning")
    v.add_argument("--tolerance", type=float, default=1e-5, help="max scaled error allowed (default 1e-5)")
    _add_hf_flags(v)
    v.add_argument("--quiet", action="store_true", help="no progress on stderr")
    v.set_defaults(fn=cmd_verify)
    e = sub.add_parser("explain", help="why an op or parameter of a saved plan got its placement")
    e.add_argument("plan", help="a plan.json written by autotp plan --json")
    e.add_argument("name", help="an op name from the plan's nodes, or a parameter name (its consuming ops)")
    e.add_argument("--profile", default=None, help="cost under this profile instead of the plan's")
    e.add_argument("--quiet", action="store_true", help="no progress on stderr")
    e.set_defaults(fn=cmd_explain)
    c = sub.add_parser("calibrate", help="measure this machine and write a profile to ./cost_models/")
    c.add_argument("--nproc", type=int, default=4, help="local processes to spawn when not under torchrun")
    c.add_argument("--mesh", default=None, help="mesh shape (default: one axis over all processes)")
    c.add_argument("--links", default=None, help="link class per axis (default loopback on CPU, nvlink on GPU)")
    c.add_argument("--backend", default=None, help="gloo or nccl under torchrun (default: nccl when CUDA is there)")
    c.add_argument("--name", default=None, help="profile name (default: derived from host and process count)")
    c.add_argument("--out", default=None, help="folder for the profile (default: ./cost_models/, searched first "
                                               "by --profile NAME)")
    c.add_argument("--max-size", default="64MiB", help="largest collective message (default 64MiB)")
    c.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    c.set_defaults(fn=cmd_calibrate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except AutotpError as exc:
        print(f"autotp: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # the reader went away (``autotp plan ... | head``): not an error of ours, and nothing left to say.
        # Point stdout at /dev/null so that the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
