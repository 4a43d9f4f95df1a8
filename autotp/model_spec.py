"""What MODEL means on the command line, and how to build it: a factory file, a transformers architecture, or a plan.

    path/to/file.py:factory     factory() returns (model, example_inputs[, example_kwargs])
    hf:llama --layers 2 ...     a transformers model built from its config class, random weights
    plan.json                   a saved plan; its ``source`` field says which of the two above built it

A `ModelSpec` is plain data that round-trips through a plan's ``source``
field, so a saved plan can be re-costed or explained later. Nothing is
downloaded: transformers models are built from config classes only.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from autotp.errors import ModelSpecError

HF_PREFIX = "hf:"
DEFAULT_BATCH, DEFAULT_SEQ = 8, 1024

# architecture -> (config class, model class); the model class has a loss head, for training graphs
HF_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "bert": ("BertConfig", "BertForMaskedLM"),
}

# command-line override -> the config field it sets, per architecture (absent: the architecture has none)
_DECODER = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "ffn": "intermediate_size", "vocab": "vocab_size"}
OVERRIDE_FIELDS = {
    "llama": _DECODER, "mistral": _DECODER, "qwen2": _DECODER,
    "gpt2": {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "ffn": "n_inner", "vocab": "vocab_size"},
    "bert": {k: v for k, v in _DECODER.items() if k != "kv_heads"},
}
_POSITIONS = ("max_position_embeddings", "n_positions")  # grown to the sequence length when shorter
_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")  # kept inside a smaller vocabulary


@dataclass(frozen=True)
class ModelSpec:
    """A model as the command line names it; ``config`` holds transformers config fields to override."""

    model: str
    config: dict = field(default_factory=dict)
    batch: int | None = None
    seq: int | None = None

    @property
    def kind(self) -> str:
        return "hf" if self.model.startswith(HF_PREFIX) else "file"

    def to_source(self) -> dict:
        """The plan JSON's ``source`` field (canonical: only what was set)."""
        out = {"model": self.model}
        if self.kind == "hf":
            out.update(config=dict(sorted(self.config.items())), batch=self.batch, seq=self.seq)
        return out

    @classmethod
    def from_source(cls, source: dict) -> "ModelSpec":
        return cls(source["model"], dict(source.get("config") or {}), source.get("batch"), source.get("seq"))


def is_plan_file(model: str) -> bool:
    return model.endswith(".json")


def parse_model(model: str, overrides: dict | None = None, settings: list[str] | None = None,
                batch: int | None = None, seq: int | None = None) -> ModelSpec:
    """Check MODEL and its flags; ``overrides`` are ``{"layers": 2, ...}``, ``settings`` ``["rope_theta=1e6"]``."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if model.startswith(HF_PREFIX):
        arch = model[len(HF_PREFIX):]
        if arch not in HF_ARCHITECTURES:
            raise ModelSpecError(f"unknown transformers architecture {arch!r}: use one of "
                                 f"{', '.join('hf:' + a for a in HF_ARCHITECTURES)}")
        config = _config_fields(arch, overrides)
        config.update(_settings(arch, settings or []))
        return ModelSpec(model, config, batch or DEFAULT_BATCH, seq or DEFAULT_SEQ)
    given = sorted(["--" + k.replace("_", "-") for k in overrides] + (["--config"] if settings else [])
                   + (["--batch"] if batch else []) + (["--seq"] if seq else []))
    if given:
        raise ModelSpecError(f"{' '.join(given)} only apply to hf:ARCH models; for {model!r} set sizes in the factory")
    path, sep, name = model.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise ModelSpecError(f"model {model!r} is not of the form path/to/file.py:factory, hf:ARCH or plan.json")
    if not Path(path).exists():
        raise ModelSpecError(f"model file {path!r} does not exist")
    return ModelSpec(f"{Path(path).resolve()}:{name}")


def _config_class(arch: str):
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise ModelSpecError(f"hf:{arch} needs the transformers package ({exc}): pip install 'autotp[hf]'") from None
    config_name, model_name = HF_ARCHITECTURES[arch]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def _config_fields(arch: str, overrides: dict) -> dict:
    fields = OVERRIDE_FIELDS[arch]
    for flag in overrides:
        if flag not in fields:
            raise ModelSpecError(f"hf:{arch} has no --{flag.replace('_', '-')} ({HF_ARCHITECTURES[arch][0]} has no "
                                 f"such field): drop it, or use one of "
                                 f"{', '.join('--' + f.replace('_', '-') for f in fields)}")
    return {fields[flag]: value for flag, value in overrides.items()}


def _settings(arch: str, settings: list[str]) -> dict:
    """``["rope_theta=1e6"]`` -> ``{"rope_theta": 1000000.0}``, each key a field of the config class."""
    known = {k for k in _config_class(arch)[0]().to_dict() if not k.startswith("_")}
    out = {}
    for item in settings:
        key, sep, text = item.partition("=")
        if not sep or key not in known:
            raise ModelSpecError(f"unknown config override {item!r} for hf:{arch}: write --config FIELD=VALUE "
                                 f"with a field of {HF_ARCHITECTURES[arch][0]}, e.g. "
                                 f"{', '.join(sorted(known)[:4])}")
        out[key] = _number(text)
    return out


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def build(spec: ModelSpec, meta: bool, training: bool = True):
    """``(model, example_inputs, example_kwargs)``; on the ``meta`` device when ``meta``, else real random weights.

    Seeded, so every process that builds the same spec gets the same weights and inputs.
    """
    torch.manual_seed(0)
    if spec.kind == "hf":
        return _build_hf(spec, meta, training)
    model, args, kwargs = call_factory(load_factory(spec.model))
    return model, args, kwargs


def _build_hf(spec: ModelSpec, meta: bool, training: bool):
    config_cls, model_cls = _config_class(spec.model[len(HF_PREFIX):])
    defaults = config_cls().to_dict()
    # fields go to the constructor, which derives others from them (head_dim from hidden_size and heads)
    # dropout stays as the config has it: split dropout draws the single device's masks, so verify checks it
    fields = {k: max(defaults[k], spec.seq) for k in _POSITIONS if isinstance(defaults.get(k), int)}
    fields.update(spec.config)
    vocab = fields.get("vocab_size", defaults.get("vocab_size"))
    fields.update({k: 0 for k in _SPECIAL_TOKENS if isinstance(defaults.get(k), int) and defaults[k] >= vocab})
    try:
        config = config_cls(**fields)
    except Exception as exc:  # noqa: BLE001 - transformers validates configs with several exception types
        reason = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        raise ModelSpecError(f"transformers rejects this {spec.model} config: {reason[-1].rstrip('.')}: change "
                             "the sizes (e.g. --hidden a multiple of --heads)") from None
    device = torch.device("meta") if meta else torch.device("cpu")
    with device:
        model = model_cls(config)
        ids = torch.randint(0, config.vocab_size, (spec.batch, spec.seq))
    model.train(training)
    return model, (ids,), ({"labels": ids} if training else {})


def load_factory(model: str):
    """``"path/to/file.py:factory"`` -> the factory function."""
    path, _, name = model.rpartition(":")
    file = Path(path)
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    if not hasattr(module, name):
        raise ModelSpecError(f"{path} has no function {name!r}")
    return getattr(module, name)


def call_factory(factory):
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ModelSpecError("the factory must return (model, example_inputs) or "
                             "(model, example_inputs, example_kwargs)")
    model, inputs = made[0], made[1]
    kwargs = made[2] if len(made) == 3 else None
    return model, inputs, kwargs
