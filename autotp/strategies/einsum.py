"""Rules written as einsum strings: the shared engine behind matmuls and attention.

For ``"mk,kn->mn"`` each letter is one way to split the op on a mesh axis:
split ``m`` -> ``(S(0), R) -> S(0)``; split ``n`` -> ``(R, S(1)) -> S(1)``; split
the contracted ``k`` -> ``(S(1), S(0)) -> P``. An input that lacks the letter, or
holds it as a broadcast dim of size 1, stays R.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, P, R, Shard


def einsum_options(equation: str, in_metas, out_meta, letters=None, partial_inputs=()) -> list[AxisOption]:
    """Per-axis options of an einsum-shaped op.

    ``letters`` restricts which letters may be split (attention may not split its
    sequence or head dims). ``partial_inputs`` lists inputs the op is linear in:
    each yields ``(.., P, ..) -> P`` with the other inputs R.
    """
    lhs, rhs = equation.replace(" ", "").split("->")
    in_specs = lhs.split(",")
    options = []
    for letter in letters if letters is not None else dict.fromkeys(lhs.replace(",", "")):
        ins = tuple(_place(spec, meta, letter) for spec, meta in zip(in_specs, in_metas))
        if all(p == R for p in ins):
            continue
        if letter in rhs:
            dim = rhs.index(letter)
            if out_meta.shape[dim] == 1:
                continue
            out = Shard(dim)
        else:
            out = P
        options.append(AxisOption(out, ins))
    for i in partial_inputs:
        options.append(AxisOption(P, tuple(P if j == i else R for j in range(len(in_specs)))))
    return options


def _place(spec: str, meta, letter: str):
    if letter not in spec:
        return R
    dim = spec.index(letter)
    return R if meta.shape[dim] == 1 else Shard(dim)


_LETTERS = "abcdefghijlopqrstuvwxyz"  # 'k', 'm', 'n' are kept for the matmul dims


def matmul_equation(a_shape, b_shape, out_shape) -> str:
    """The einsum of ``torch.matmul`` for these shapes, batch dims broadcast from the right.

    ``[2,3,4] @ [4,5] -> [2,3,5]`` gives ``"abk,kn->abn"``.
    """
    a1, b1 = len(a_shape) == 1, len(b_shape) == 1
    a_batch = len(a_shape) - (1 if a1 else 2)
    b_batch = len(b_shape) - (1 if b1 else 2)
    n_batch = max(a_batch, b_batch)
    batch = _LETTERS[:n_batch]
    a = batch[n_batch - a_batch:] + ("" if a1 else "m") + "k"
    b = batch[n_batch - b_batch:] + "k" + ("" if b1 else "n")
    out = batch + ("" if a1 else "m") + ("" if b1 else "n")
    assert len(out) == len(out_shape), (a_shape, b_shape, out_shape)
    return f"{a},{b}->{out}"
