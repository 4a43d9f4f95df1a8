"""The dtypes autotp can plan, and the checks that turn any other dtype into a clear `DtypeError`.

Every cost is counted in bytes and FLOP/s per dtype, and every collective and
local op must exist for it on gloo and NCCL alike. Complex numbers and the
float8 variants fail one of these (no profile has a float8 peak; complex
tensors have no meaningful row/column split of a real matmul; float8 needs
scaled matmuls), so they are refused where they are first met: the model's
parameters and the example inputs at capture, an op inside the captured graph,
and dtype names read back from a plan or a command line.
"""

from __future__ import annotations

import torch

from autotp.errors import DtypeError

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: the name plans and profiles use."""
    return str(dtype).removeprefix("torch.")


def supported_names() -> str:
    return ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)


CONVERT = "convert it first, e.g. model.to(torch.bfloat16) and the inputs likewise"


def check_dtype(dtype: torch.dtype, what: str, fix: str = CONVERT) -> None:
    """Raise `DtypeError` naming ``what`` (e.g. ``parameter 'fc1.weight'``) unless ``dtype`` is supported."""
    if dtype not in SUPPORTED_DTYPES:
        raise DtypeError(f"{what} has dtype {dtype_name(dtype)}, which autotp cannot plan (supported: "
                         f"{supported_names()}); {fix}")


def parse_dtype(name: str, where: str) -> torch.dtype:
    """``torch.float32`` for ``"float32"`` (or ``"torch.float32"``); `DtypeError` for a typo or an unsupported one."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DtypeError(f"unknown dtype {name!r} in {where}; use one of: {supported_names()}")
    check_dtype(dtype, where)
    return dtype
