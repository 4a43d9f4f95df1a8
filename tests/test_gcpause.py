"""Planning pauses Python's cyclic collector and gives it back as it was, on success and on error."""

import gc

import pytest
import torch

import autotp
from autotp.errors import AutotpError
from autotp.gcpause import collector_paused


def test_the_collector_is_paused_inside_and_restored_after_even_on_error():
    seen = []

    @collector_paused()
    def work(fail: bool):
        with collector_paused():  # nested: one pause
            seen.append(gc.isenabled())
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("boom")

    assert gc.isenabled()
    work(False)
    with pytest.raises(ValueError):
        work(True)
    assert seen == [False, False, False, False] and gc.isenabled()
    gc.disable()  # a caller that runs without the collector keeps it off
    try:
        work(False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_plan_leaves_the_collector_on_after_a_plan_and_after_a_bad_mesh():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    plan = autotp.plan(model, 2, (x,))
    assert plan.parameters and gc.isenabled()
    with pytest.raises(AutotpError):
        autotp.plan(model, "3x0", (x,))
    assert gc.isenabled()
