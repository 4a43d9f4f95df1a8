"""Progress on stderr for long work: named stages with elapsed times, and a one-line bar.

Both are passed explicitly to whatever does the work (no global state). The
API is silent unless given one; the command line passes one that writes to
stderr unless ``--quiet``. A disabled reporter costs nothing and prints nothing.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Stage:
    """One running stage; set ``detail`` to say what it found (``"42,054 variables"``)."""

    detail: str = ""


class Stages:
    """``with stages.stage("capturing"): ...`` prints ``capturing… 2.1 s`` on one line of stderr."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.times: dict[str, float] = {}  # seconds per stage name, kept for plan.stats

    @contextmanager
    def stage(self, name: str):
        current, started = Stage(), time.perf_counter()
        self.write(f"{name}… ")
        try:
            yield current
        finally:
            self.times[name] = time.perf_counter() - started
            detail = f"{current.detail}, " if current.detail else ""
            self.write(f"{detail}{self.times[name]:.1f} s\n")

    def write(self, text: str) -> None:
        """Write ``text`` as it is (a line another reporter wrote: a forked search's, `autotp.lanes`)."""
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()


def stages_or_silent(progress: Stages | bool | None) -> Stages:
    """The reporter to use when a caller may pass none (or a flag): ``True`` reports on stderr; ``None`` or
    ``False`` gives a silent one that still keeps stage times."""
    if isinstance(progress, bool) or progress is None:
        return Stages(enabled=bool(progress))
    return progress


class Progress:
    """``with Progress(total, enabled) as bar: bar.step("all_reduce 4 MiB")`` redraws one line on stderr."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30, stream=None):
        self.total, self.enabled, self.width = max(total, 1), enabled, width
        self.stream = stream or sys.stderr
        self.done, self.started = 0, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = int(self.width * self.done / self.total)
        elapsed = time.perf_counter() - self.started
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label:<40.40}")
        self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
