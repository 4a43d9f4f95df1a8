"""Train and eval modes of a rank module: fixed by the plan, and said so when asked to switch.

A rank module runs the program `torch.export` captured, and the capture
fixes the mode: dropout draws masks, batch norm updates its running
statistics, exactly as the model did when captured (``plan.training``).
``module.train()`` / ``.eval()`` cannot switch a captured program, and the
exported module answers them with a bare ``NotImplementedError``. Here
asking for the plan's own mode is a no-op (so training loops that call
``model.train()`` each epoch work), and asking for the other one is a
`PlanError` that says how to get it: plan again with the other ``training``.
"""

from __future__ import annotations

import types

import torch

from autotp.errors import PlanError


def fix_mode(local: torch.nn.Module, training: bool) -> torch.nn.Module:
    """Give ``local`` the ``train``/``eval`` of a program captured in one mode (``training``)."""

    def train(self, mode: bool = True):
        if bool(mode) != training:
            captured, wanted = ("training", "inference") if training else ("inference", "training")
            raise PlanError(f"this rank module runs the program captured for {captured} (plan.training="
                            f"{training}), and a captured program cannot change mode: for {wanted}, plan with "
                            f"autotp.plan(..., training={not training}) and parallelize that plan")
        return self

    def eval(self):
        return self.train(False)

    local.train = types.MethodType(train, local)
    local.eval = types.MethodType(eval, local)
    local.training = training
    return local
