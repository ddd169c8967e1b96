from __future__ import annotations

import sys
from typing import Any

from tests.paths._pass import matrix_pass

__all__ = ["matrix_pass"]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the rows this run played with an older Celery's expectations, and why: a path
    that goes otherwise here is checked against what this Celery does, never left out
    unsaid."""
    module = sys.modules.get("tests.paths.test_paths")
    played = getattr(module, "played_otherwise", None)
    if not played:
        return
    version = ".".join(map(str, module.CELERY))  # type: ignore[union-attr]
    terminalreporter.write_sep(
        "=", f"paths played with Celery {version}'s own expectations (not the docs' tables)"
    )
    for name, older in played.items():
        terminalreporter.write_line(
            f"{name}: {older.runs} run(s), as on Celery before "
            f"{older.since[0]}.{older.since[1]}: {older.why}"
        )
