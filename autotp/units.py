"""Byte sizes written by people: ``"80GB"``, ``"64MiB"``, ``1 << 30``."""

from __future__ import annotations

from autotp.errors import AutotpError

_UNITS = {"kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}


class SizeError(AutotpError, ValueError):
    """A byte size could not be read."""


def parse_bytes(value) -> int:
    """``"64MiB"`` -> 67108864, ``"80GB"`` -> 80e9 (decimal, as GPU memory is sold), ints pass through."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise SizeError(f"size {value!r} must be a positive number of bytes (or of the form 80GB, 64MiB)")
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    for unit, scale in _UNITS.items():
        number = text[: -len(unit)]
        if text.endswith(unit) and number.replace(".", "", 1).isdigit():
            return int(float(number) * scale)
    if text.isdigit():
        return int(text)
    raise SizeError(f"size {value!r} is not of the form 80GB, 64MiB or a number of bytes")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
