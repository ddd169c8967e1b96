"""The pytest plugin as a project meets it: pytest run in a subprocess on a small project,
next to Celery's own fixtures and pytest-celery, with no service reachable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.processes import free_port

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs"

#: The project's app: everything it names is on a port nothing listens on.
APP = """
from celery import Celery

from celery_unique import UniqueTask

app = Celery("proj")
app.conf.update(
    broker_url="redis://127.0.0.1:{port}/0",
    result_backend="redis://127.0.0.1:{port}/1",
    unique_backend="{store}",
    task_always_eager={eager},
)


@app.task(base=UniqueTask, unique_window_key=lambda job: job.request_id, unique_window=3600)
def charge(cents, request_id):
    return cents
"""


def run_pytest(
    tmp_path: Path,
    tests: str,
    *args: str,
    eager: bool = False,
    ini: str = "",
    store: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``pytest`` on ``tests`` (a test module) next to the project's ``proj.py``, whose
    store is ``store`` (by default, like its broker, on a port nothing listens on)."""
    port = free_port()
    store = store or f"redis://127.0.0.1:{port}/2"
    (tmp_path / "proj.py").write_text(APP.format(port=port, eager=eager, store=store))
    (tmp_path / "test_proj.py").write_text(textwrap.dedent(tests))
    (tmp_path / "pytest.ini").write_text(f"[pytest]\n{ini}\n")
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    environ.update(PYTHONPATH=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
    )


def fenced(page: str, language: str) -> list[str]:
    """The code blocks of a docs page written in ``language``."""
    return re.findall(rf"^```{language}\n(.*?)^```$", page, flags=re.MULTILINE | re.DOTALL)


def passed(run: subprocess.CompletedProcess[str], count: int) -> bool:
    return run.returncode == 0 and f"{count} passed" in run.stdout


def test_fixtures_work_beside_celerys_pytest_fixtures(tmp_path: Path) -> None:
    """The Testing page's example with Celery's ``celery_app``/``celery_worker`` passes, run
    with the options the page gives for pytest-celery: ``unique_store`` acts on
    ``celery_app`` and ``wait_released`` sees the in-thread worker's release."""
    page = (DOCS / "testing.md").read_text()
    (example,) = [block for block in fenced(page, "python") if "celery_worker" in block]
    (options,) = [block for block in fenced(page, "ini") if "addopts" in block]
    addopts = options.split("addopts =", 1)[1].split()
    assert addopts == ["-p", "no:celery", "-p", "celery.contrib.pytest"]
    run = run_pytest(tmp_path, example, *addopts)
    assert passed(run, 1), run.stdout + run.stderr


def test_fixtures_work_with_pytest_celery_loaded(tmp_path: Path) -> None:
    """pytest-celery 1.x's plugin loaded (no ``-p`` options): the fixtures are still there,
    on the project's current app, and an eager duplicate carries the holder's value."""
    run = run_pytest(
        tmp_path,
        """
        from celery_unique.testing import held_keys
        from proj import charge


        def test_pytest_celery_is_loaded(request):
            assert request.config.pluginmanager.get_plugin("celery").__name__ == (
                "pytest_celery.plugin"
            )


        def test_replayed_charge(unique_eager):
            first = charge.delay(250, request_id="R-1")
            replay = charge.delay(250, request_id="R-1")
            assert (replay.id, replay.duplicate, replay.get(timeout=5)) == (first.id, True, 250)
            assert held_keys() == ["proj.charge:R-1"]
        """,
    )
    assert passed(run, 2), run.stdout + run.stderr


def test_autouse_isolates_a_project_that_runs_tasks_eagerly(tmp_path: Path) -> None:
    """``unique_autouse = true``: a test that asks for no fixture, in a project whose settings
    run tasks eagerly, keeps its keys in a store of its own (the configured one is down)."""
    tests = """
        from proj import charge


        def test_charge():
            assert charge.delay(250, request_id="R-1").get() == 250


        def test_the_next_test_starts_empty():
            assert charge.delay(300, request_id="R-1").get() == 300
        """
    isolated = run_pytest(tmp_path, tests, eager=True, ini="unique_autouse = true")
    assert passed(isolated, 2), isolated.stdout + isolated.stderr
    alone = run_pytest(tmp_path, tests, eager=True)
    assert "2 failed" in alone.stdout, alone.stdout
