"""In-place updates that capture leaves in place: of graph inputs and buffers (running statistics).

Capture rewrites in-place ops on activations out of place
(`autotp.capture.normalize.functionalize_inplace`), so the in-place ops
left in a graph write into a tensor the caller or the module owns: a user
input, or a buffer such as BatchNorm's ``running_mean`` and
``num_batches_tracked``. Buffers are replicated on every rank, and the update
must reach that very tensor, not a slice or a gathered copy of it, so these
ops offer no split: they run whole on every rank, and every rank's buffer
takes the same update as the single-device model's.
"""

from __future__ import annotations

INPLACE_UPDATES = ("copy_", "add_", "sub_", "mul_", "div_", "fill_", "zero_", "clamp_", "masked_fill_", "relu_",
                   "gelu_", "silu_", "sigmoid_", "tanh_", "exp_", "neg_", "pow_", "sqrt_", "abs_", "lerp_",
                   "addcmul_", "addcdiv_", "index_put_", "index_add_", "scatter_", "scatter_add_", "clamp_min_",
                   "clamp_max_", "fill_diagonal_", "index_copy_")  # the last: a key/value cache's write


def in_place_update_rule(op):
    """Only the replicated strategy (which `expand` always adds): see the module docstring."""
    return []
