"""Unit tests: memory store, kombu's in-memory broker, no services."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals

from celery_unique import config as unique_config

_apps = itertools.count()


@pytest.fixture
def app() -> Iterator[Celery]:
    """A finalized app on the in-memory broker with the memory store."""
    app = Celery(f"unit{next(_apps)}", broker="memory://", set_as_current=False)
    app.conf.unique_backend = "memory://"
    app.conf.broker_connection_retry = False
    app.finalize()
    yield app
    unique_config.reset(app)


@pytest.fixture
def unique_app(app: Celery) -> Celery:
    """The app of celery-unique's own fixtures (``unique_store``, ``unique_eager``)."""
    return app


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """Headers of every message published during the test, in order."""
    sent: list[dict[str, Any]] = []

    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append(dict(headers or {}))

    signals.before_task_publish.connect(record, weak=False)
    yield sent
    signals.before_task_publish.disconnect(record)
