"""linear, mm, bmm and matmul: split a batch dim, the output features, or the contraction.

For ``linear(x, w)`` with ``x: [b, s, k]`` and ``w: [n, k]`` the options are the
familiar ones: batch split ``S(0)``/``S(1)`` with ``w`` replicated (data
parallel), column split ``w: S(0) -> out S(2)``, and row split
``x: S(2), w: S(1) -> out P`` (Megatron's row-parallel linear).
"""

from __future__ import annotations

from autotp.strategies.einsum import _LETTERS, einsum_options, matmul_equation


def linear_rule(op):
    x, w = op.in_metas[:2]
    batch = _LETTERS[: len(x.shape) - 1]
    eq = f"{batch}k,nk->{batch}n"
    return einsum_options(eq, op.in_metas[:2], op.out[0], partial_inputs=(0,))


def mm_rule(op):
    return einsum_options("mk,kn->mn", op.in_metas, op.out[0], partial_inputs=(0, 1))


def bmm_rule(op):
    return einsum_options("bmk,bkn->bmn", op.in_metas, op.out[0], partial_inputs=(0, 1))


def matmul_rule(op):
    a, b = op.in_metas
    eq = matmul_equation(a.shape, b.shape, op.out[0].shape)
    return einsum_options(eq, op.in_metas, op.out[0], partial_inputs=(0, 1))
