"""The version matrix: every Celery, Python, Django and redis-py the project claims.

``scripts/test`` runs the whole suite on the development environment (the
newest Celery, kombu, redis-py and Django, on the machine's Python). Each cell
here installs the project with other versions into a virtualenv of its own
and runs the tests that tell whether it works there: unit, store contract, a
real prefork worker whose pool child is killed, and the one-script path's
messages compared byte for byte with the cell's kombu; Django cells add the
Django store contract, migrations, checks and store; the path cell plays the
path matrix (tests/paths) on the oldest Celery, on a real prefork worker.
``scripts/matrix`` runs every cell, the longest first, and prints a table.

Interpreters are the ones already on the machine (pyenv's), never
downloaded. A cell's virtualenv is kept between runs and rebuilt only when
what it installs changes (its own pins, or the project's dependencies).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import nox

ROOT = Path(__file__).parent

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

#: What every cell runs.
TESTS = [
    "tests/unit",
    "tests/contract",
    "tests/faults/test_worker_crash.py::test_acks_late_job_of_a_killed_pool_child_keeps_its_key_and_runs_again",
    # The one-script path writes what this cell's kombu writes, byte for byte.
    "tests/faults/test_colocated.py::test_messages_are_byte_for_byte_what_kombu_writes",
]
#: What a Django cell runs: the unit tests and the Django app (its store's contract on
#: SQLite, PostgreSQL and MariaDB, migrations, checks). The Redis and worker tests
#: do not depend on Django's version and run in the Celery cells on the same Pythons.
DJANGO_TESTS = [
    "tests/django/test_django_store_contract.py",
    "tests/django/test_migrations.py",
    "tests/django/test_checks.py",
    "tests/django/test_django_store.py",
]
#: What a path cell runs: the path matrix on Redis and a real prefork worker, every path
#: (with each scope, and with a window key) as the cell's Celery goes, and the docs' list
#: of the paths that go otherwise on older Celery.
PATH_TESTS = [
    "tests/paths/test_paths.py::test_every_path_holds_its_key_exactly_while_its_job_can_run"
    "[redis-prefork]",
    "tests/paths/test_paths.py::test_every_path_keeps_a_window_key_naming_its_job[redis]",
    "tests/paths/test_paths.py::test_the_docs_list_the_paths_that_go_otherwise_on_older_celery",
]
#: Tests that do not apply to any cell, and why: deselected there, and said so.
NOT_IN_CELLS = (
    (
        "tests/unit/test_matrix_docs.py::test_the_docs_matrix_is_generated_from_the_noxfile",
        "it checks the repository's docs against this file, whatever the versions: "
        "the development suite runs it",
    ),
    (
        "tests/unit/test_pytest_plugin.py::test_fixtures_work_with_pytest_celery_loaded",
        "pytest-celery is not one of the cells' test tools (it pulls in Docker's client): "
        "the development suite runs it",
    ),
    (
        "tests/unit/test_import_contracts.py",
        "the import contracts are the source's, whatever the versions (import-linter is a "
        "lint tool, not one of the cells' test tools): the development suite runs them",
    ),
)
#: Tests that do not apply where Celery is older than 5.7, and why.
BEFORE_CELERY_5_7 = (
    (
        "tests/unit/test_review_fixes.py::test_pydantic_arguments_are_hashed_as_they_will_be_sent",
        "Celery before 5.7 does not dump a pydantic=True task's arguments on the producer",
    ),
    (
        "tests/unit/test_testing.py::test_unique_store_leaves_settings_read_from_a_source_following_it",
        "Celery before 5.7 keeps reading a setting the block changed after the change is "
        "taken back (docs/testing.md says so)",
    ),
)
#: The project, as every cell installs it: with every extra the tests use.
EXTRAS = ".[redis,django,prometheus]"
#: Test tools, in every cell.
TOOLS = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-django>=4.8",
    "hypothesis>=6.100",
    "psycopg[binary]>=3.1",
    "PyMySQL>=1.1",
    "pydantic>=2",
    # gevent's Timeout is what a publish interrupted by something other than an
    # Exception is tested with.
    "gevent>=24.2",
]


@dataclass(frozen=True)
class Cell:
    """One combination: a name, a Python, and what it pins."""

    name: str
    python: str
    pins: tuple[str, ...] = ()
    #: uv's ``--resolution`` for the project's own dependencies.
    resolution: str = "highest"
    tests: tuple[str, ...] = field(default_factory=lambda: tuple(TESTS))
    #: Packages removed after the install, to run without them.
    without: tuple[str, ...] = ()
    #: Tests of ``tests`` that do not apply here, each with the reason the cell prints.
    not_applying: tuple[tuple[str, str], ...] = ()
    #: Why this cell is in the matrix.
    why: str = ""


MATRIX = (
    Cell(
        "celery-5.3",
        "3.10",
        ("celery==5.3.*", "kombu==5.3.*"),
        not_applying=BEFORE_CELERY_5_7,
        why="oldest Celery claimed, oldest Python",
    ),
    Cell(
        "paths-celery-5.3",
        "3.10",
        ("celery==5.3.*", "kombu==5.3.*"),
        tests=tuple(PATH_TESTS),
        why="the worker's side (fates, leases, re-sends) builds on Celery's request internals",
    ),
    Cell("celery-5.4", "3.11", ("celery==5.4.*", "kombu==5.4.*"), not_applying=BEFORE_CELERY_5_7),
    Cell("celery-5.5", "3.12", ("celery==5.5.*", "kombu==5.5.*"), not_applying=BEFORE_CELERY_5_7),
    Cell("celery-5.6", "3.13", ("celery==5.6.*", "kombu==5.6.*"), not_applying=BEFORE_CELERY_5_7),
    Cell(
        "celery-5.7",
        "3.13",
        ("celery==5.7.*", "kombu==5.7.*"),
        why="newest Celery on the newest Python",
    ),
    Cell(
        "django-4.2",
        "3.10",
        ("django==4.2.*",),
        tests=tuple(DJANGO_TESTS),
        why="oldest Django LTS",
    ),
    Cell("django-5.2", "3.12", ("django==5.2.*",), tests=tuple(DJANGO_TESTS)),
    Cell(
        "django-6.0",
        "3.13",
        ("django==6.0.*",),
        tests=tuple(DJANGO_TESTS),
        why="newest Django (needs Python 3.12+)",
    ),
    Cell(
        "redis-6.4",
        "3.11",
        ("redis==6.4.*",),
        without=("hiredis",),
        why="the redis-py floor the metadata declares, parsing replies in Python (no hiredis)",
    ),
    Cell(
        "lowest-direct",
        "3.10",
        resolution="lowest-direct",
        tests=(*TESTS, *DJANGO_TESTS),
        not_applying=BEFORE_CELERY_5_7,  # Celery 5.3, the floor
        why="every direct dependency at the floor the metadata declares",
    ),
)


def interpreter(version: str) -> str:
    """The machine's own Python ``version`` (pyenv's, or on PATH); never a download."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(root.glob(f"{version}.*"), reverse=True):
        binary = candidate / "bin" / f"python{version}"
        if binary.exists():
            return str(binary)
    found = shutil.which(f"python{version}")
    if found is None:
        raise RuntimeError(f"Python {version} is not installed on this machine")
    return found


def fingerprint(cell: Cell) -> str:
    """What decides a cell's installs: rebuild its virtualenv when this changes."""
    pyproject = (ROOT / "pyproject.toml").read_bytes()
    what = json.dumps([cell.python, cell.pins, cell.resolution, cell.without, EXTRAS, TOOLS])
    return hashlib.sha256(pyproject + what.encode()).hexdigest()


def _session(cell: Cell) -> None:
    @nox.session(name=cell.name, python=interpreter(cell.python), venv_params=["--seed"])
    def run(session: nox.Session) -> None:
        stamp = Path(session.virtualenv.location) / ".cell-fingerprint"
        wanted = fingerprint(cell)
        if not stamp.exists() or stamp.read_text() != wanted:
            env = {"UV_PYTHON_DOWNLOADS": "never"}
            if cell.resolution != "highest":
                session.install(f"--resolution={cell.resolution}", EXTRAS, *cell.pins, env=env)
                session.install(*TOOLS, env=env)
            else:
                session.install(EXTRAS, *cell.pins, *TOOLS, env=env)
            if cell.without:
                session.run("python", "-m", "pip", "uninstall", "-y", *cell.without)
            stamp.write_text(wanted)
        session.run("python", "-m", "pip", "list", silent=False, external=False)
        session.run(
            "python",
            "-c",
            "import importlib.util, celery, kombu, redis, django, celery_unique; "
            "print('celery', celery.__version__, 'kombu', kombu.__version__, "
            "'redis', redis.__version__, 'django', django.__version__, 'hiredis', "
            "bool(importlib.util.find_spec('hiredis')))",
        )
        deselected = []
        for test, reason in (*NOT_IN_CELLS, *cell.not_applying):
            session.log(f"not run in this cell: {test}: {reason}")
            deselected += ["--deselect", test]
        session.run(
            "python",
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            *deselected,
            *cell.tests,
            # Every test a cell runs applies to it: a skip fails the cell (tests/conftest.py).
            env={"CELERY_UNIQUE_TEST_NO_SKIPS": "1"},
        )


for _cell in MATRIX:
    _session(_cell)


def render_matrix() -> str:
    """The matrix as the README and the docs show it (``tests/unit/test_matrix_docs.py``)."""
    rows = [
        "| cell | Python | pins | tests | why |",
        "|---|---|---|---|---|",
        "| development (`scripts/test`) | 3.11 | newest of everything | the whole suite | |",
    ]
    for cell in MATRIX:
        pins = ", ".join(f"`{pin}`" for pin in cell.pins) or f"`--resolution {cell.resolution}`"
        tests = {
            tuple(TESTS): "core",
            tuple(DJANGO_TESTS): "Django app",
            tuple(PATH_TESTS): "path matrix (Redis, prefork)",
        }.get(cell.tests, "core + Django app")
        rows.append(f"| `{cell.name}` | {cell.python} | {pins} | {tests} | {cell.why} |")
    return "\n".join(rows) + "\n"
