"""pytest fixtures for testing your own tasks with uniqueness on.

Loaded by pytest by itself once celery-unique is installed (the ``pytest11``
entry point ``celery_unique``; ``-p no:celery_unique`` turns it off). It adds:

* ``unique_store``: a fresh, isolated store for the test, yielded. By
  default a memory store, with the app's broker on ``memory://`` and its
  result backend on ``cache+memory://``, so nothing a test dispatches
  reaches a service (or a development worker). The ini option
  ``unique_store = configured`` uses the app's configured store instead,
  under a namespace of the test's own whose keys are deleted afterwards;
  ``unique_broker = keep`` leaves the app's broker and result backend alone
  (for tests that run a worker on a real broker).
* ``unique_eager``: ``unique_store`` with ``task_always_eager`` on: a
  dispatch runs the task in the test's process, with the same uniqueness
  as on a worker. Yields the store.
* ``unique_app``: the Celery app both act on. It is the app named by the
  ini option ``unique_app`` (``proj.celery:app``), else the ``celery_app``
  fixture of Celery's pytest plugin when the test uses it, else Celery's
  current app (in a Django project, the app your ``proj/__init__.py``
  imports). Override the fixture to choose another.

The ini option ``unique_autouse = true`` gives every test ``unique_store``:
a project whose settings turn on ``task_always_eager`` then never writes
keys into the store it develops with.

See :mod:`celery_unique.testing` for ``held_keys()`` and ``wait_released()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from celery import Celery
from celery._state import get_current_app
from kombu.utils.imports import symbol_by_name

from celery_unique import config, testing
from celery_unique.stores.base import Store

MEMORY = "memory"
CONFIGURED = "configured"
KEEP = "keep"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "unique_app",
        "celery-unique: the Celery app its fixtures use, as module:attribute "
        "(default: the celery_app fixture when the test uses it, else Celery's current app)",
        default="",
    )
    parser.addini(
        "unique_store",
        "celery-unique: the store of the unique_store fixture: 'memory' (default), "
        "'configured' (the app's own store, a namespace per test) or a store URL",
        default=MEMORY,
    )
    parser.addini(
        "unique_broker",
        "celery-unique: 'memory' (default: with a memory store, the app's broker is "
        "memory:// and its result backend cache+memory:// during the test) or 'keep'",
        default=MEMORY,
    )
    parser.addini(
        "unique_autouse",
        "celery-unique: give every test the unique_store fixture",
        type="bool",
        default=False,
    )


@pytest.fixture
def unique_app(request: pytest.FixtureRequest) -> Celery:
    """The Celery app the ``unique_store`` and ``unique_eager`` fixtures act on."""
    named = str(request.config.getini("unique_app")).strip()
    if named:
        app: Celery = symbol_by_name(named)
        return app
    if "celery_app" in request.fixturenames:
        celery_app: Celery = request.getfixturevalue("celery_app")
        return celery_app
    return get_current_app()


@pytest.fixture
def unique_store(request: pytest.FixtureRequest, unique_app: Celery) -> Iterator[Store]:
    """A fresh store for the test (memory unless the ``unique_store`` ini option says
    otherwise), with nothing dispatched reaching a service; yields the store."""
    with _isolated(request, unique_app, eager=None) as store:
        yield store


@pytest.fixture
def unique_eager(request: pytest.FixtureRequest, unique_app: Celery) -> Iterator[Store]:
    """``unique_store`` with ``task_always_eager`` on: dispatches run here, deduplicated."""
    with _isolated(request, unique_app, eager=True) as store:
        yield store


@pytest.fixture(autouse=True)
def _unique_autouse(request: pytest.FixtureRequest) -> None:
    if request.config.getini("unique_autouse") and not {"unique_store", "unique_eager"} & set(
        request.fixturenames
    ):
        request.getfixturevalue("unique_store")


@contextmanager
def _isolated(
    request: pytest.FixtureRequest, app: Celery, *, eager: bool | None
) -> Iterator[Store]:
    """The store the ini options ask for, on ``app``, for one test."""
    chosen = str(request.config.getini("unique_store")).strip() or MEMORY
    namespace = None
    if chosen == MEMORY:
        url: str | None = "memory://"
    else:
        url = config.configured_backend_url(app) if chosen == CONFIGURED else chosen
        namespace = testing.testing_namespace(app)
    if url is None:
        raise pytest.UsageError(
            "unique_store = configured, but the app has no store configured "
            "(unique_backend, CELERY_UNIQUE_BACKEND in Django)"
        )
    keep = str(request.config.getini("unique_broker")).strip() == KEEP
    broker = None if keep or url != "memory://" else "memory://"
    with testing.unique_store(app, url, eager=eager, broker=broker, namespace=namespace) as store:
        try:
            yield store
        finally:
            if namespace is not None:
                # A shared store: the test's keys go with it.
                testing.reset_store(app)
