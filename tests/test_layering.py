"""The README's promise about the code's shape: data flows one way, no stage imports a later one.

Stages in the README's order; the tools on top (calibrate, report) may use the
`autotp.plan` facade (``api.py``). Read from the source (every ``from autotp...``
import, module level or inside a function), so a new upward import fails here
unless it is one of the two the README names.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "autotp"
STAGES = ["mesh", "placement", "capture", "graph", "strategies", "redistribute", "cost", "solve", "lower", "runtime",
          "calibrate", "report"]
USE_THE_FACADE = {"report"}
NAMED_IN_THE_README = {("autotp.solve.summary", "autotp.report.table"), ("autotp.runtime.verify", "autotp.api")}


def _upward_imports() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        stage = module.split(".")[1] if "." in module else None
        if stage not in STAGES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autotp."):
                target = node.module.split(".")[1]
                later = target in STAGES and STAGES.index(target) > STAGES.index(stage)
                if later or (target == "api" and stage not in USE_THE_FACADE):
                    found.add((module, node.module))
    return found


def test_no_stage_imports_a_later_one_but_the_two_the_readme_names():
    assert _upward_imports() == NAMED_IN_THE_README
    readme = (ROOT.parent / "README.md").read_text()
    assert "`Plan.summary()` formats itself with\n`report.table`" in readme and "`runtime.verify` builds" in readme
