"""The checks on a copy of the example project, run as its users run them.

The copy lives in the test's directory with a ``manage.py``, importable under
the example's own module names (``tests.django.example``), and nothing else
of this repository on the path: ``manage.py check`` and ``celery unique
check`` run in subprocesses with ``DJANGO_SETTINGS_MODULE`` set, so Celery's
Django fixup is installed as in a real project.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.django.project import SETTINGS_MODULE

EXAMPLE = Path(__file__).resolve().parent / "example"

MANAGE_PY = """
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", {settings!r})
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
"""

#: ``celery``, with the ``unique`` group added as its entry point adds it.
CELERY = (
    "import sys; from celery.bin.celery import celery, main; "
    "from celery_unique.cli import unique; celery.add_command(unique); sys.exit(main())"
)

#: A task only autodiscovery finds (neither the URLs nor the models import tasks.py).
FORGOTTEN_BASE = """

@app.task(unique_key=lambda job: f"customer:{job.customer}", unique_while="active")
def send_statement(customer: str) -> str:
    return f"statement for {customer}"
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the example project (its own SQLite file, not migrated) and its manage.py."""
    shutil.copytree(
        EXAMPLE,
        tmp_path / "tests" / "django" / "example",
        ignore=shutil.ignore_patterns("__pycache__", "*.sqlite3"),
    )
    for package in (tmp_path / "tests", tmp_path / "tests" / "django"):
        (package / "__init__.py").write_text("")
    (tmp_path / "manage.py").write_text(MANAGE_PY.format(settings=SETTINGS_MODULE))
    return tmp_path


def run(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in the project, with only the project added to the path."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project), "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_manage_py_check_sees_a_task_only_autodiscovery_imports(project: Path) -> None:
    """``manage.py check`` imports the Celery app's task modules: a task's mistake fails it."""
    clean = run(project, "manage.py", "check")
    assert clean.returncode == 0, clean.stderr
    assert "no issues" in clean.stdout
    tasks = project / "tests" / "django" / "example" / "shop" / "tasks.py"
    tasks.write_text(tasks.read_text() + FORGOTTEN_BASE)
    broken = run(project, "manage.py", "check")
    assert broken.returncode == 1
    assert (
        "tests.django.example.shop.tasks.send_statement: (celery_unique.E020) task "
        "tests.django.example.shop.tasks.send_statement has unique_key, unique_while but is "
        "not a UniqueTask"
    ) in broken.stderr
    assert "System check identified 1 issue" in broken.stderr


def test_the_celery_command_sets_django_up_for_a_django_store(project: Path) -> None:
    """``celery unique check`` reaches a ``django://`` store (Celery's fixup sets Django up as
    the task modules are imported) and shows its URL as written."""
    command = ["-c", CELERY, "-A", "tests.django.example.celery", "unique", "check"]
    unmigrated = run(project, *command)
    assert unmigrated.returncode == 1, unmigrated.stderr
    [line] = [line for line in unmigrated.stdout.splitlines() if line.startswith("celery_")]
    assert line.startswith(
        "celery_unique.E012 [error] unique_backend: the uniqueness store django:// has no table "
        "yet: "
    )
    assert "no such table" in line
    migrated = run(project, "manage.py", "migrate", "--verbosity", "0")
    assert migrated.returncode == 0, migrated.stderr
    checked = run(project, *command)
    assert (checked.returncode, checked.stdout.strip()) == (0, "no problems found"), checked.stderr
