"""A one-line progress bar for long measurements, printed by rank 0 only."""

from __future__ import annotations

import sys
import time


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
