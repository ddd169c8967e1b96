"""The example Django project (``example/``) for every test in this folder, and no other.

Django is configured here, at collection, with ``settings.configure()`` from
``example/settings.py``; ``DJANGO_SETTINGS_MODULE`` is not set, so Celery apps
of other test folders get no Django fixup. The databases are the example's
SQLite file (always) and PostgreSQL / MariaDB when they answer: tests on
those carry the ``postgres`` / ``mariadb`` marker (skip locally, fail in CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals

from tests.conftest import in_ci, require_service
from tests.django import project

project.configure()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mariadb: needs a real MariaDB (or MySQL) server")


#: The databases a store test can run on, each with the service marker it needs.
DATABASES = {"default": None, "postgres": "postgres", "mariadb": "mariadb"}


def database_params(**db_marker: Any) -> list[Any]:
    """``pytest.param`` per database alias: service marker plus a ``django_db`` marker."""
    return [
        pytest.param(
            alias,
            marks=[
                *([getattr(pytest.mark, service)] if service else []),
                pytest.mark.django_db(databases=[alias], **db_marker),
            ],
            id="sqlite" if alias == "default" else alias,
        )
        for alias, service in DATABASES.items()
    ]


def require_database(alias: str) -> None:
    """Skip (fail in CI) when ``alias`` is not configured: its server is down or has no driver."""
    from django.conf import settings

    if alias in project.SERVICES:
        require_service(project.SERVICES[alias])
    if alias not in settings.DATABASES:
        message = f"database {alias!r} is not available (is its Python driver installed?)"
        if in_ci():
            pytest.fail(f"{message} [CI=true]", pytrace=False)
        pytest.skip(message)


@pytest.fixture
def example_app() -> Iterator[Celery]:
    """The example project's Celery app, configured from settings.py; its store reset after."""
    from celery_unique import config
    from tests.django.example.celery import app

    app.loader.import_default_modules()
    yield app
    config.reset(app)


@pytest.fixture
def published(example_app: Celery) -> Iterator[list[str]]:
    """Ids of the jobs published during the test, in order."""
    sent: list[str] = []

    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append((headers or {}).get("id", "?"))

    signals.before_task_publish.connect(record, weak=False)
    yield sent
    signals.before_task_publish.disconnect(record)
