"""Materialise a model straight into this rank's shards: no rank ever holds the full weights.

A *weight source* maps parameter and buffer names (``model.state_dict()``
names) to tensors on storage and reads only the part one device holds:

- `StateDictSource`: a full state dict, in memory or opened with
  ``torch.load(path, mmap=True)`` (then only the pages of this rank's shard are
  read from the file);
- `SafetensorsSource`: ``.safetensors`` files, read with the ``safetensors``
  library: each read maps the file (``safe_open``), copies this rank's block
  out of it (``get_slice(name)[rows, cols]``, which touches only the pages the
  block covers) and unmaps it, so no full tensor is ever buffered.

``autotp.parallelize(meta_model, plan, weights=source)`` captures the model on
the ``meta`` device and takes every parameter shard from the source.

Buffers. Buffers are not split, so each rank holds them whole. A buffer found
in the source (every persistent buffer of a checkpoint) is read from it. A
non-persistent buffer (Llama's rotary ``inv_freq``) is in no checkpoint: it is
computed in the module's ``__init__``. Build the model under
`empty_parameters()` and ``__init__`` computes such buffers for real while
every parameter goes to ``meta`` unfilled; a buffer still on ``meta`` after
that is an error naming it, never a silent zero.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.fx as fx
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.utils import _pytree as pytree

from autotp.errors import MaterializeError
from autotp.placement import Shard, shard_factor, shard_index

META = torch.device("meta")


def shard_ranges(shape, layout, mesh_shape, coords) -> list[tuple[int, int]]:
    """``[start, stop)`` per tensor dim of the piece the device at ``coords`` holds, in ``torch.chunk`` order.

    ``(S(0), R)`` on a 2x2 mesh for a ``[8, 6]`` weight at coords ``(1, 0)``
    gives ``[(4, 8), (0, 6)]``: the second half of the rows, every column.
    """
    ranges = [(0, size) for size in shape]
    for dim in sorted({p.dim for p in layout if isinstance(p, Shard)}):
        pieces, index = shard_factor(layout, dim, mesh_shape), shard_index(layout, dim, coords, mesh_shape)
        step = -(-shape[dim] // pieces)  # torch.chunk's chunk size
        ranges[dim] = (min(index * step, shape[dim]), min((index + 1) * step, shape[dim]))
    return ranges


class StateDictSource:
    """A full state dict (possibly memory-mapped) as a weight source; reads copy only the shard."""

    def __init__(self, state_dict: dict):
        self.tensors = dict(state_dict)

    def names(self) -> set[str]:
        return set(self.tensors)

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self.tensors[name]
        return tuple(t.shape), t.dtype

    def read(self, name: str, ranges) -> torch.Tensor:
        full = self.tensors[name]
        return full[tuple(slice(a, b) for a, b in ranges)].clone()


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@contextlib.contextmanager
def _open_safetensors(path):
    """``safe_open(path)`` for the length of the block; a broken file is a `MaterializeError` naming it."""
    try:
        handle = safe_open(path, framework="pt")
    except SafetensorError as exc:
        raise MaterializeError(f"{path} is not a readable safetensors file ({exc}): re-write it, "
                               "or pass the right path") from None
    with handle:
        yield handle


class SafetensorsSource:
    """One or more ``.safetensors`` files (or a directory of them) as a weight source, read shard by shard."""

    def __init__(self, paths):
        if sys.byteorder != "little":
            raise MaterializeError("safetensors data is little-endian; this machine is big-endian: "
                                   "load the file with torch and use StateDictSource")
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        files = [f for p in map(Path, paths) for f in (sorted(p.glob("*.safetensors")) if p.is_dir() else [p])]
        if not files:
            raise MaterializeError(f"no .safetensors files in {paths}; pass the files or their directory")
        self.entries: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        for path in files:
            with _open_safetensors(path) as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise MaterializeError(f"{path}: tensor {name!r} has dtype {view.get_dtype()}, which autotp "
                                               f"does not read (supported: {', '.join(_SAFETENSORS_DTYPES)})")
                    self.entries[name] = (path, tuple(view.get_shape()), dtype)

    def names(self) -> set[str]:
        return set(self.entries)

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        _, shape, dtype = self.entries[name]
        return shape, dtype

    def read(self, name: str, ranges) -> torch.Tensor:
        """Copy the block ``ranges`` of one tensor out of its memory-mapped file, touching only the pages it covers.

        The file stays mapped for this read only, and the copy owns its
        memory: no mapping outlives the call.
        """
        path, _, _ = self.entries[name]
        with _open_safetensors(path) as f:
            block = f.get_slice(name)[tuple(slice(a, b) for a, b in ranges)]  # a view into the mapping
            return block.clone(memory_format=torch.contiguous_format)


def save_safetensors(tensors: dict, path) -> None:
    """Write ``tensors`` as one ``.safetensors`` file, atomically (for tests, examples and benchmarks).

    Tensors that share memory (tied weights) are each written whole, under every name.
    """
    from autotp.fileio import atomic_path

    dense, storages = {}, set()
    for name, t in tensors.items():
        if t.dtype not in _SAFETENSORS_DTYPES.values():
            raise MaterializeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors files here cannot hold")
        t = t.detach().cpu().contiguous()
        storage = t.untyped_storage().data_ptr()
        dense[name] = t.clone() if storage in storages else t  # save_file refuses tensors that share memory
        storages.add(storage)
    with atomic_path(path) as tmp:
        save_file(dense, tmp)


def load_shard(source, name: str, like: torch.Tensor, layout, mesh_shape, coords, device=None) -> torch.Tensor:
    """This device's piece of parameter ``name`` from ``source``, checked against the model's ``like``.

    The dtype follows the model's parameter (as ``load_state_dict`` copies),
    so a bfloat16 checkpoint fills a float32 model.
    """
    if name not in source.names():
        raise MaterializeError(f"parameter {name!r} is not in the weights: pass a checkpoint of this model "
                               "(its state_dict names)")
    shape, _ = source.spec(name)
    if tuple(shape) != tuple(like.shape):
        raise MaterializeError(f"parameter {name!r} has shape {list(shape)} in the weights but {list(like.shape)} "
                               "in the model: the weights belong to a different configuration")
    piece = source.read(name, shard_ranges(shape, layout, mesh_shape, coords))
    return piece.to(device=device or "cpu", dtype=like.dtype)


@contextlib.contextmanager
def empty_parameters():
    """Build modules with every parameter on ``meta`` (unallocated) and every buffer computed for real.

    Why: ``with torch.device("meta")`` would put the buffers an ``__init__``
    computes (rotary frequencies) on ``meta`` too, and those are in no
    checkpoint. Here each parameter is swapped for a ``meta`` one as it is
    registered, so the initialisers that run afterwards touch no memory (a
    parameter built with values, ``torch.ones(n)``, exists for real only until
    it is registered). It patches ``nn.Module.register_parameter`` for the
    duration of the block: build nothing on other threads meanwhile.
    Example::

        with autotp.materialize.empty_parameters():
            model = LlamaForCausalLM(config)      # params on meta, inv_freq real
    """
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device != META:
            param = torch.nn.Parameter(param.to(META), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def retarget_device(gm: fx.GraphModule, device, captured_on=META) -> None:
    """Make ops captured on the ``meta`` device (or ``captured_on``) create their tensors on ``device`` instead.

    Export records the device of factory calls (``arange``, ``to``, ...) as it
    traced them; a model captured on ``meta`` would otherwise build ``meta``
    tensors at run time, one captured on the CPU CPU tensors on a GPU rank.
    """
    device, sources = torch.device(device), {META, torch.device(captured_on)}
    swap = lambda a: device if isinstance(a, torch.device) and a in sources else a  # noqa: E731
    for node in gm.graph.nodes:
        node.args, node.kwargs = pytree.tree_map(swap, (node.args, dict(node.kwargs)))
    gm.recompile()


def materialize_buffers(gm: fx.GraphModule, source, device, captured_on=META) -> None:
    """Fill every buffer of the captured ``gm``: from ``source`` when it has the name, else keep a real one.

    A buffer that is neither in ``source`` nor real raises `MaterializeError`.
    """
    for name, buf in list(gm.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        if name in source.names():
            shape, _ = source.spec(name)
            value = source.read(name, [(0, s) for s in shape]).to(dtype=buf.dtype)
        elif buf.device != META:
            value = buf
        else:
            raise MaterializeError(
                f"buffer {name!r} is on the meta device and not in the weights: build the model under "
                "autotp.materialize.empty_parameters() so __init__ computes it, or add it to the weights")
        owner._buffers[leaf] = value.to(device)
    retarget_device(gm, device, captured_on)


def check_materialized(module: torch.nn.Module) -> None:
    """Every parameter and buffer is real: a ``meta`` tensor left behind would fail later, less clearly."""
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device == META]
    if left:
        raise MaterializeError(f"{len(left)} tensors are still on the meta device after loading ({left[:3]}): "
                               "pass weights that hold them")


def prepare_weights(gm: fx.GraphModule, source, mesh_shape, device=None, captured_on=META):
    """Fill ``gm``'s buffers from ``source`` and return the ``load_shard`` callback `lower` takes; tensors the
    program creates go to ``device`` too (``captured_on``: the device the model was captured on)."""
    device = torch.device(device or "cpu")
    materialize_buffers(gm, source, device, captured_on)

    def loader(name, param, layout, coords):
        return load_shard(source, name, param, layout, mesh_shape, coords, device)

    return loader
