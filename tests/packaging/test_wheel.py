"""The wheel: the import names a ``pip install celery-unique`` puts into site-packages."""

from __future__ import annotations

import configparser
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import in_ci

REPO = Path(__file__).resolve().parents[2]

#: What a build must not see: environments, caches, earlier builds (a stale build/lib
#: could put into the wheel a module the source tree no longer has).
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".nox",
    "build",
    "dist",
    "*.egg-info",
    "_build",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    "*.sqlite3",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    """The wheel built from a clean copy of the source tree."""
    if importlib.util.find_spec("build") is None:
        message = "the build package is not installed (it is in the dev dependency group)"
        if in_ci():
            pytest.fail(f"{message} [CI=true]", pytrace=False)
        pytest.skip(message)
    where = tmp_path_factory.mktemp("wheel")
    source, out = where / "source", where / "dist"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


@pytest.mark.slow
def test_the_wheel_installs_only_the_projects_own_names(wheel: zipfile.ZipFile) -> None:
    """Its top-level packages are celery_unique and celery_unique_django, nothing generic."""
    names = wheel.namelist()
    top = {name.split("/")[0] for name in names}
    packages = {name for name in top if not name.endswith((".dist-info", ".data"))}
    print(f"wheel top-level names: {sorted(packages)}")
    assert packages == {"celery_unique", "celery_unique_django"}
    (metadata,) = top - packages
    top_level = f"{metadata}/top_level.txt"
    if top_level in names:
        assert set(wheel.read(top_level).decode().split()) == packages
    assert [name for name in names if "django_integration" in name] == []


@pytest.mark.slow
def test_the_django_app_carries_its_data_files(wheel: zipfile.ZipFile) -> None:
    """Migrations, templates, py.typed and the management commands are in the wheel."""
    names = set(wheel.namelist())
    app = REPO / "django_integration" / "celery_unique_django"
    expected = {
        f"celery_unique_django/{path.relative_to(app).as_posix()}"
        for path in app.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert "celery_unique_django/migrations/0001_initial.py" in expected
    assert "celery_unique_django/management/commands/celery_unique.py" in expected
    assert sorted(expected - names) == []


@pytest.mark.slow
def test_the_wheel_registers_the_pytest_plugin(wheel: zipfile.ZipFile) -> None:
    """pytest finds the plugin through the ``pytest11`` entry point, named ``celery_unique``."""
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parsed = configparser.ConfigParser()
    parsed.read_string(wheel.read(entry_points).decode())
    assert dict(parsed["pytest11"]) == {"celery_unique": "celery_unique.pytest_plugin"}
