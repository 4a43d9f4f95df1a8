"""Plans used across the tests: the ILP's own, and forced plans that test lowering on their own."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import autotp
from autotp.graph.opgraph import KIND_PARAM
from autotp.solve.constraints import data_parallel_only, replicated_only
from autotp.strategies.enumerate import optimizer_variants
from conftest import compute_bound_profile
from models import GPT, MLP


def make_model(name: str):
    """The same weights and inputs on every call (and so on every rank)."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(16, 32), (torch.randn(8, 16),)
    if name == "gpt":
        return GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8), (
            torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
    raise ValueError(name)


def activation_bound_gpt(batch: int = 32):
    """The test GPT with a batch of 32 sequences: its activations are about its weights' state, so a memory
    limit under its fastest plan binds as backward starts, where regathering works (with one micro-batch the peak
    is the larger of backward's start and end, `autotp.solve.step.memory_bytes`; at the tests' batch of 4 it is
    the end, which only splitting the weights lowers)."""
    model, _ = make_model("gpt")
    generator = torch.Generator().manual_seed(0)
    return model, tuple(torch.randint(0, 64, (batch, 8), generator=generator) for _ in range(2))


def megatron_pins(name: str, model, mesh) -> dict:
    """Column-parallel in, row-parallel out on the last mesh axis; everything else replicated."""
    tp = mesh.ndim - 1
    pins = {}
    for fqn, _ in model.named_parameters():
        leaf = fqn.rsplit(".", 2)
        module, kind = (leaf[-2], leaf[-1]) if len(leaf) > 1 else ("", leaf[-1])
        placement = "R"
        if module in ("fc1", "q", "k", "v", "up", "head"):
            placement = "S(0)"
        elif module in ("fc2", "proj", "down") and kind == "weight":
            placement = "S(1)"
        pins[fqn] = tuple(placement if a == tp else "R" for a in range(mesh.ndim))
    return pins


def forced_plan(kind: str, name: str, mesh, **options):
    """The ILP's plan (``"ilp"``) or a forced one: replicated, data-parallel, megatron (``options`` for `plan`)."""
    model, inputs = make_model(name)
    profile = compute_bound_profile()
    if kind == "ilp":
        return autotp.plan(model, mesh, inputs, profile=profile, **options)
    if kind == "replicated":
        return autotp.plan(model, mesh, inputs, profile=profile, allow=replicated_only, **options)
    if kind == "data_parallel":
        return autotp.plan(model, mesh, inputs, profile=profile, allow=data_parallel_only, **options)
    if kind == "megatron":
        return autotp.plan(model, mesh, inputs, profile="h100-hgx", pin=megatron_pins(name, model, mesh), **options)
    raise ValueError(kind)


def split_optimizer_where_whole(mesh_shape, gradients: bool | None = None):
    """A filter: a trained parameter whose optimizer state can be split has it split, over the most axes it can.

    ``gradients`` False keeps every gradient whole (ZeRO-1), True splits the
    gradient with the state where the parameter's use allows it (ZeRO-2),
    None leaves that to the ILP.
    """

    def allow(op, strategy) -> bool:
        if op.kind != KIND_PARAM or not op.requires_grad:
            return True
        widest = max((len(v.optimizer_axes) for v in optimizer_variants(strategy, mesh_shape)), default=0)
        return len(strategy.optimizer_axes) == widest and (gradients is None or not strategy.optimizer_axes
                                                          or gradients or not strategy.gradient_split)

    return allow


def recomputed_stretches(local) -> int:
    """How many stretches of the rank module run under activation checkpointing."""
    return sum(1 for name, _ in local.named_children() if name.startswith("recompute_"))


class _Block(nn.Module):
    def __init__(self, hidden: int, p: float):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.ln(x)))))


class DropoutNet(nn.Module):
    """Two residual MLP blocks with dropout in an ``nn.ModuleList`` (identical layers), and a loss."""

    def __init__(self, p: float, vocab: int = 32, hidden: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, p) for _ in range(2))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx, targets):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def dropout_net(p: float, seq: int, batch: int = 4):
    """A `DropoutNet` (hidden 16, vocabulary 32) and ``batch`` x ``seq`` tokens and targets, the same each call."""
    torch.manual_seed(0)
    return DropoutNet(p), (torch.randint(0, 32, (batch, seq)), torch.randint(0, 32, (batch, seq)))


def planned_and_run(run, make_plans, mesh, ready=None) -> tuple:
    """``(plans, per-rank results)``: ``make_plans(mesh)`` made once, then ``run(rank, world, plans)`` on every rank
    of ``mesh`` (real gloo process groups): one spawn for all of a module's plans. ``ready(plans, world)``: what the
    ranks lower, made here once (`made_for_ranks`) and handed to ``run`` after the plans."""
    from autotp.runtime import spawn

    plans = make_plans(mesh)
    extra = () if ready is None else (ready(plans, mesh.size),)
    return plans, spawn(run, mesh.size, plans, *extra)


def captured_for_ranks(model, plan, world: int):
    """``model`` captured for ``plan`` here, once (`autotp.api.capture_for`), where ``world`` ranks fork from this
    process and inherit it with ``model``; None where they are spawned (each then captures its own): a model's
    export is most of a rank's set-up, which every rank paid again."""
    from autotp.api import capture_for
    from autotp.runtime.spawn import start_method

    return capture_for(model, plan) if start_method(world) == "fork" else None


def made_for_ranks(make, plan, world: int) -> tuple:
    """``(model, captured)``: ``make()``'s model for ``world`` ranks to lower ``plan`` on, and its capture where
    they fork from here (`captured_for_ranks`)."""
    model = make()
    return model, captured_for_ranks(model, plan, world)


def check_exact_with_dropout(e: dict, where: str, tolerance: float) -> None:
    """One rank's run: output and every gradient within ``tolerance`` of the single device, and the dropout run
    really drew a mask (a loss unchanged by dropout would prove nothing)."""
    assert e["output"] <= tolerance, f"{where}: output error {e['output']:.2e}"
    assert e["gradient"] <= tolerance, f"{where}: gradient error {e['gradient']:.2e}"
    assert e["dropout_drew"], f"{where}: dropout did not change the loss: the check proves nothing"
