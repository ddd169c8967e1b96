"""The import contracts of pyproject.toml bite: a planted forbidden import breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter not installed")


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the copy of the package in ``tree``, with the project's contracts."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(tree / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "celery_unique", tmp_path / "celery_unique")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(tree: Path, module: str, line: str) -> None:
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_package_keeps_its_contracts(tree: Path) -> None:
    result = lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # A lower area reaching up: the store layer importing the task class.
        ("celery_unique/stores/base.py", "import celery_unique.task", "Each area imports only"),
        # The checks must read declarations, not import the task class.
        ("celery_unique/checks/app.py", "from celery_unique import task", "Each area imports only"),
        # Two areas on one layer are independent.
        ("celery_unique/worker/runs.py", "import celery_unique.metrics", "Each area imports only"),
        ("celery_unique/keys/keyspace.py", "import celery", "Keys are computed without Celery"),
        ("celery_unique/stores/memory.py", "import celery.result", "Stores know nothing of Celery"),
    ],
)
def test_a_planted_forbidden_import_breaks_a_contract(
    tree: Path, module: str, line: str, broken: str
) -> None:
    plant(tree, module, line)
    result = lint(tree)
    assert result.returncode != 0
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(broken)]
    assert verdicts, result.stdout
    assert verdicts[0].endswith(" BROKEN"), result.stdout
