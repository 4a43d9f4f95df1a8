"""Sharded checkpoints: each rank saves only its shards; one index names the complete step.

Layout of a checkpoint directory::

    checkpoint.json              the index, written last by rank 0: step, plan fingerprint, mesh, files
    step-00000003/plan.json      the plan the shards follow (so a new process can resume or consolidate)
    step-00000003/rank-00000.pt  rank 0's parameter shards, persistent buffers and optimizer state
    ...

Every file is written atomically (`autotp.fileio`), and the index moves to a
step only after every rank's file of that step exists (a barrier), so a save
interrupted anywhere leaves the previous step loadable. Older steps are
removed once the new index is in place.

A shard is stored under its parameter's ``model.state_dict()`` name, with its
placement, so `consolidate` can put the full tensors back together without
the model: pieces are laid out by their chunk index along each split dim
(`autotp.placement.shard_index`), and replicas are read once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from autotp.errors import CheckpointError
from autotp.fileio import atomic_path, atomic_write_text
from autotp.lower.dtensor import is_dtensor, like_parameter, local_tensor
from autotp.lower.pending import wait_parameters
from autotp.lower.rewrite import parameter_aliases
from autotp.mesh import Mesh
from autotp.placement import Partial, Shard, parse_layout, shard_index
from autotp.solve.plan import Plan

FORMAT = 1
INDEX = "checkpoint.json"


def plan_fingerprint(plan) -> str:
    """A short hash of what decides the shards: the mesh, the parameter placements and the op layouts."""
    d = plan.to_dict()
    text = json.dumps({k: d[k] for k in ("mesh", "parameters", "nodes")}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _local_parameters(module, plan) -> dict[str, tuple[list[str], torch.nn.Parameter]]:
    """Plan name -> (every name of the parameter, the local parameter); tied weights once."""
    found = {}
    for names, param in parameter_aliases(module):
        planned = [n for n in names if n in plan.parameters]
        if not planned:
            raise CheckpointError(f"parameter {names[0]!r} is not in the plan: pass the module parallelize returned "
                                  "for this plan")
        found[planned[0]] = (names, param)
    return found


def _persistent_buffers(module) -> dict[str, torch.Tensor]:
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v.detach().cpu() for k, v in module.state_dict(keep_vars=True).items() if k not in params}


def _owner(tensor: torch.Tensor) -> torch.Tensor:
    """The parameter an optimizer's tensor stands for: itself, or the one a `shard_optimizer` slice is cut from.

    A master copy in another dtype (``shard_optimizer(master_dtype=...)``) is
    state of its own that these checkpoints do not hold: `CheckpointError`.
    """
    owner = getattr(tensor, "autotp_parameter", tensor)
    if owner.dtype != tensor.dtype:
        raise CheckpointError("the optimizer keeps master weights in another dtype than the parameters "
                              "(shard_optimizer's master_dtype), which sharded checkpoints do not save yet: "
                              "checkpoint an optimizer built without master_dtype")
    return owner


def _optimizer_state(optimizer, params: dict) -> dict:
    """The optimizer's state keyed by parameter name, not by position (positions depend on construction order)."""
    if optimizer is None:
        return {}
    name_of = {id(p): name for name, (_, p) in params.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(_owner(p))] for p in g["params"]]}
              for g in optimizer.param_groups]
    state = {name_of[id(_owner(p))]: {k: local_tensor(v).detach().cpu() if torch.is_tensor(v) else v
                                      for k, v in s.items()}
             for p, s in optimizer.state.items()}
    return {"groups": groups, "state": state}


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def save_sharded(directory, module, optimizer, plan, rank: int, step: int) -> Path:
    """Save this rank's shards (and AdamW state) for ``step``; every rank calls it, rank 0 writes the index.

    Collective when a process group is initialised. Without one (a single
    process saving for several ranks), call rank 0 last: its call writes the
    index. Returns the step's directory.
    """
    directory, step_dir = Path(directory), _step_dir(Path(directory), step)
    wait_parameters(module)  # ZeRO's all-gathers after the last step may still be running
    params = _local_parameters(module, plan)
    payload = {"format": FORMAT, "rank": rank, "step": step, "plan": plan_fingerprint(plan),
               "parameters": {name: local_tensor(p).detach().cpu() for name, (_, p) in params.items()},
               "aliases": {name: names for name, (names, _) in params.items()},
               "buffers": _persistent_buffers(module), "optimizer": _optimizer_state(optimizer, params)}
    with atomic_path(step_dir / _rank_file(rank)) as tmp:
        torch.save(payload, tmp)
    _barrier()
    if rank == 0:
        atomic_write_text(step_dir / "plan.json", plan.to_json())
        index = {"format": FORMAT, "step": step, "plan": plan_fingerprint(plan), "mesh": str(plan.mesh),
                 "world_size": plan.mesh.size, "directory": step_dir.name,
                 "files": [_rank_file(r) for r in range(plan.mesh.size)]}
        atomic_write_text(directory / INDEX, json.dumps(index, indent=1, sort_keys=True) + "\n")
        for old in directory.glob("step-*"):
            if old != step_dir and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return step_dir


def read_index(directory) -> dict:
    """The checkpoint's index, checked to name files that exist."""
    path = Path(directory) / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint in {directory} ({INDEX} is missing): pass the directory "
                              "save_sharded wrote") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}; the checkpoint is damaged, use an earlier one") from None
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {index.get('format')!r}; this autotp reads format {FORMAT}")
    missing = [f for f in index["files"] if not (Path(directory) / index["directory"] / f).exists()]
    if missing:
        raise CheckpointError(f"checkpoint {directory} step {index['step']} lacks {missing[:3]}: it is incomplete; "
                              "use an earlier checkpoint")
    return index


def checkpoint_plan(directory) -> Plan:
    """The plan a checkpoint was saved with: resume with it to get the same shards."""
    index = read_index(directory)
    return Plan.load(Path(directory) / index["directory"] / "plan.json")


def _read_rank(directory, index, rank: int) -> dict:
    return torch.load(Path(directory) / index["directory"] / index["files"][rank], weights_only=True)


def load_sharded(directory, module, optimizer, plan, rank: int) -> int:
    """Load this rank's shards (and optimizer state) into ``module``/``optimizer``; returns the saved step.

    The checkpoint must have been saved with the same plan on the same mesh:
    else `CheckpointError` names both fingerprints and meshes.
    """
    index = read_index(directory)
    if index["plan"] != plan_fingerprint(plan) or index["world_size"] != plan.mesh.size:
        raise CheckpointError(
            f"checkpoint {directory} was saved for plan {index['plan']} on mesh {index['mesh']}, but this run uses "
            f"plan {plan_fingerprint(plan)} on mesh {plan.mesh}: resume with autotp.checkpoint.checkpoint_plan"
            f"({str(directory)!r}) and {index['world_size']} processes, or consolidate it and re-shard")
    saved = _read_rank(directory, index, rank)
    wait_parameters(module)  # a pending all-gather must not land over the loaded values
    params = _local_parameters(module, plan)
    with torch.no_grad():
        for name, (_, param) in params.items():
            value, shard = saved["parameters"].get(name), local_tensor(param)
            if value is None or value.shape != shard.shape:
                got = None if value is None else list(value.shape)
                raise CheckpointError(f"checkpoint shard {name!r} of rank {rank} has shape {got}, the module "
                                      f"{list(shard.shape)}: the checkpoint belongs to another model")
            shard.copy_(value)
        buffers = dict(module.named_buffers())
        for name, value in saved["buffers"].items():
            buffers[name].copy_(value)
    if optimizer is not None and saved["optimizer"]:
        _load_optimizer(optimizer, saved["optimizer"], params)
    return int(saved["step"])


def _load_optimizer(optimizer, saved: dict, params: dict) -> None:
    """Rebuild the positional ``state_dict`` the optimizer expects from the state saved by name."""
    current = optimizer.state_dict()
    position, shape_of, stepped = {}, {}, {}
    for group, ids in zip(optimizer.param_groups, current["param_groups"]):
        position.update({id(_owner(p)): i for p, i in zip(group["params"], ids["params"])})
        shape_of.update({id(_owner(p)): local_tensor(p).shape for p in group["params"]})
        stepped.update({id(_owner(p)): p for p in group["params"]})
    index_of = {name: position[id(p)] for name, (_, p) in params.items() if id(p) in position}
    for name, state in saved["state"].items():
        want = shape_of.get(id(params[name][1])) if name in params else None
        got = next((v.shape for v in state.values() if torch.is_tensor(v) and v.dim()), want)
        if want is not None and got != want:
            raise CheckpointError(f"the optimizer state of {name!r} was saved with shape {list(got)}, this optimizer "
                                  f"steps {list(want)}: resume with the same kind of optimizer (shard_optimizer or "
                                  "a plain one) it was saved with")
    groups = [{**g, "params": [index_of[n] for n in g["params"]]} for g in saved["groups"]]
    state = {index_of[name]: {k: _like(stepped[id(params[name][1])], v) for k, v in s.items()}
             for name, s in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _like(param, value):
    """A saved optimizer tensor of ``param``'s local shape as the optimizer keeps it: a DTensor of ``param``'s
    placements when ``param`` is one (Adam's moments), else as saved (a scalar step count)."""
    if not (torch.is_tensor(value) and is_dtensor(param) and value.shape == local_tensor(param).shape):
        return value
    return like_parameter(param, value.to(local_tensor(param).device))


def consolidate(directory) -> dict[str, torch.Tensor]:
    """The full state dict of a sharded checkpoint, which the original model loads with ``strict=True``.

    Tied weights appear under each of their names, as ``model.state_dict()`` has them.
    """
    index = read_index(directory)
    plan = checkpoint_plan(directory)
    ranks = [_read_rank(directory, index, r) for r in range(index["world_size"])]
    full = {}
    for name, names in ranks[0]["aliases"].items():
        tensor = assemble(name, plan.parameters[name], plan.mesh, [r["parameters"][name] for r in ranks])
        full.update({alias: tensor for alias in names})
    full.update(ranks[0]["buffers"])
    return full


def assemble(name: str, texts, mesh: Mesh, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Put one parameter back together from every rank's piece (a replica is read once)."""
    layout = parse_layout(texts)
    if any(isinstance(p, Partial) for p in layout):
        raise CheckpointError(f"parameter {name!r} is saved as partial sums ({texts}); a checkpoint holds "
                              "parameters only as S(d) or R")
    split = sorted({p.dim for p in layout if isinstance(p, Shard)})
    by_chunk = {}
    for rank, piece in enumerate(pieces):
        key = tuple(shard_index(layout, d, mesh.coords(rank), mesh.shape) for d in split)
        by_chunk.setdefault(key, piece)
    offsets = {}  # (dim, chunk) -> start along dim, from the sizes of the chunks before it
    shape = list(pieces[0].shape)
    for i, d in enumerate(split):
        sizes = {key[i]: piece.shape[d] for key, piece in by_chunk.items()}
        starts = 0
        for chunk in sorted(sizes):
            offsets[d, chunk] = starts
            starts += sizes[chunk]
        shape[d] = starts
    out = torch.empty(shape, dtype=pieces[0].dtype)
    for key, piece in by_chunk.items():
        where = [slice(None)] * len(shape)
        for d, chunk in zip(split, key):
            where[d] = slice(offsets[d, chunk], offsets[d, chunk] + piece.shape[d])
        out[tuple(where)] = piece
    return out
