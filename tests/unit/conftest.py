"""Unit tests: memory store, kombu's in-memory broker, no services."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import gevent
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


@pytest.fixture(
    params=[KeyboardInterrupt, gevent.Timeout], ids=["KeyboardInterrupt", "gevent.Timeout"]
)
def interruption(request: pytest.FixtureRequest) -> type[BaseException]:
    """What stops a publish without being an ``Exception``: a Ctrl-C, gevent's ``Timeout``."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def interrupt_publish(
    interruption: type[BaseException],
) -> Iterator[Callable[[int], list[str]]]:
    """``interrupt_publish(n)``: the test's ``n``-th publish is interrupted, just before its
    message leaves. Returns the ids of the jobs whose publish was attempted, in order."""
    attempted: list[str] = []
    at: list[int] = []

    def interrupt(headers: dict[str, Any] | None = None, **_: Any) -> None:
        attempted.append((headers or {}).get("id", ""))
        if len(attempted) in at:
            raise interruption()

    def arm(nth: int) -> list[str]:
        at.append(nth)
        return attempted

    signals.before_task_publish.connect(interrupt, weak=False)
    yield arm
    signals.before_task_publish.disconnect(interrupt)


def queued_job_ids(app: Celery, queue: str = "celery") -> set[str]:
    """The ids of the jobs waiting in ``queue`` of the in-memory broker (taken off it)."""
    ids: set[str] = set()
    with app.connection_for_read() as connection:
        waiting = connection.SimpleQueue(queue)
        while True:
            try:
                message = waiting.get_nowait()
            except waiting.Empty:
                return ids
            ids.add(message.headers["id"])
            message.ack()
