"""Regenerate docs/img/plan.svg and docs/img/baselines.svg with the real command line.

A small Llama (4 layers, hidden 1024, 16 heads, 4 key/value heads, vocabulary
32000, batch 8 x 512 tokens) on a 2x2 mesh of H100s, planned on the meta
device; prints the report it draws. Run from the repository root:

    python benchmarks/report_pictures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from autotp.cli import main

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
MODEL = ["hf:llama", "--layers", "4", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--ffn", "4096",
         "--vocab", "32000", "--batch", "8", "--seq", "512"]


def command(img: Path = IMG) -> list[str]:
    """The `autotp` command line that plans the model and writes both pictures into ``img``."""
    return ["plan", *MODEL, "--mesh", "2x2", "--svg", str(img / "plan.svg"), "--chart", str(img / "baselines.svg")]


if __name__ == "__main__":
    IMG.mkdir(parents=True, exist_ok=True)
    sys.exit(main(command()))
