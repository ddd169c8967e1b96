"""The example user project's own test suite (tests/example_user_project), run as its
developers run it: ``pytest`` in the project's folder, with no service reachable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import free_port

pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parent.parent / "example_user_project"


def run_project_tests(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``pytest`` in the example project, its Redis URL on a port nothing listens on."""
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DJANGO_SETTINGS_MODULE", "PYTEST_ADDOPTS", "CELERY_EAGER")
    }
    environ.update(
        REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", PYTHONDONTWRITEBYTECODE="1", **env
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=PROJECT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_documented_test_setup_needs_no_service() -> None:
    """The project's tests (the Testing page shows them) pass with Redis unreachable:
    the fixtures give a memory store, a memory broker and results in memory."""
    run = run_project_tests()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 passed" in run.stdout


def test_fixtures_isolate_a_project_whose_settings_run_tasks_eagerly() -> None:
    """``CELERY_TASK_ALWAYS_EAGER`` in settings: the eager tests still use the fixtures'
    store, not the (unreachable) Redis the settings name."""
    run = run_project_tests("-k", "eagerly or replayed", CELERY_EAGER="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout
