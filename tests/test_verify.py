"""`autotp.runtime.verify`'s comparison: shapes and dtypes must match, tolerances read per dtype, and the upstream
gradient is random, so an error that an all-ones gradient cancels still shows.

The end-to-end checks (tests/test_end_to_end.py, test_transformers.py, ...) run it on real gloo ranks.
"""

from __future__ import annotations

import math

import torch

from autotp.runtime.verify import _compare, _loss, _upstream, dtype_scale


def test_a_shape_or_dtype_that_differs_is_a_named_mismatch():
    mismatches = []
    assert _compare(torch.zeros(4), torch.zeros(4, dtype=torch.int64), "output 0", mismatches) == math.inf
    assert _compare(torch.zeros(2, 2), torch.zeros(4), "gradient of w", mismatches) == math.inf
    assert mismatches == ["output 0: (4,) torch.float32 where one device has (4,) torch.int64",
                          "gradient of w: (2, 2) torch.float32 where one device has (4,) torch.float32"]
    assert _compare(torch.ones(3), torch.ones(3), "same", mismatches) == 0.0 and len(mismatches) == 2


def test_low_precision_is_allowed_torch_testing_s_looser_tolerance():
    assert dtype_scale(torch.float32) == dtype_scale(torch.float64) == 1.0
    assert math.isclose(dtype_scale(torch.bfloat16), 1.6e-2 / 1.3e-6)
    want = torch.ones(8, dtype=torch.bfloat16)
    got = want + 2 ** -7  # one bfloat16 ulp at 1
    assert _compare(got, want, "output", []) <= 1e-5  # within float32's 1e-5, once scaled
    assert _compare(got.float(), want.float(), "output", []) > 1e-5  # the same error in float32 is not


def test_the_upstream_gradient_sees_what_a_sum_cancels():
    """Two outputs swapped along a dim have the same sum, so ``sum()``'s all-ones gradient cannot tell them
    apart; a random upstream gradient (the same on both sides) can."""
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    y = x.flip(0).detach().requires_grad_()
    upstream = _upstream([x])
    assert torch.equal(upstream[0], _upstream([x])[0])  # drawn alike on every rank
    assert torch.equal(x.sum(), y.sum())
    assert not torch.equal(_loss([x], upstream), _loss([y], upstream))
    _loss([x], upstream).backward()
    assert torch.equal(x.grad, upstream[0])
