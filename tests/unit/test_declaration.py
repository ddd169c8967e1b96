"""Declaration errors are raised when the task class is created, not at dispatch."""

from __future__ import annotations

import itertools
import sys
from datetime import timedelta
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from celery import Celery, Task

from celery_unique import (
    ImproperlyConfigured,
    InvalidDeclaration,
    InvalidKey,
    InvalidWindow,
    UniqueTask,
    UnsupportedCombination,
)
from celery_unique.options.declaration import parse_window


@pytest.fixture
def app() -> Celery:
    """A finalized app: tasks are created (and checked) as they are defined."""
    app = Celery("decl", broker="memory://", set_as_current=False)
    app.conf.unique_backend = "memory://"
    app.finalize()
    return app


_names = itertools.count()


def define(app: Celery, **options: Any) -> Any:
    """A task with a fresh name (an app hands back the old task for a known name)."""
    options.setdefault("base", UniqueTask)

    @app.task(name=f"decl.job{next(_names)}", shared=False, **options)
    def job(user_id: int) -> None:
        return None

    return job


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"unique_key": "k", "unique_while": "forever"}, InvalidDeclaration),
        ({"unique_window_key": "k"}, InvalidWindow),
        ({"unique_window_key": "k", "unique_window": 0}, InvalidWindow),
        ({"unique_window_key": "k", "unique_window": -5}, InvalidWindow),
        ({"unique_window_key": "k", "unique_window": 0.0005}, InvalidWindow),
        ({"unique_window_key": "k", "unique_window": timedelta(microseconds=1500)}, InvalidWindow),
        ({"unique_window_key": "k", "unique_window": timedelta(days=3651)}, InvalidWindow),
        ({"unique_window_key": "k", "unique_window": "1h"}, InvalidWindow),
        ({"unique_key": 5}, InvalidKey),
        ({"unique_key": ""}, InvalidKey),
        ({"unique_key": "bad\nkey"}, InvalidKey),
        ({"unique_key": "k", "unique_prefix": "maybe"}, ImproperlyConfigured),
        ({"unique_key": "k", "unique_prefix": "maybe"}, InvalidDeclaration),
        ({"unique_key": "k", "unique_overridable": "maybe"}, ImproperlyConfigured),
        ({"unique_key": "k", "unique_retention": -1}, InvalidDeclaration),
    ],
)
def test_malformed_declarations_raise_at_definition(
    app: Celery, options: dict[str, Any], error: type[Exception]
) -> None:
    """Each malformed option raises its coded error as the task is defined."""
    with pytest.raises(error):
        define(app, **options)


def test_lazy_app_raises_when_the_task_is_created(app: Celery) -> None:
    """On an app not yet finalized, the error comes at finalization, before any dispatch."""
    lazy = Celery("lazy", broker="memory://", set_as_current=False)

    @lazy.task(base=UniqueTask, unique_key="k", unique_while="forever", shared=False)
    def job() -> None:
        return None

    with pytest.raises(InvalidDeclaration, match="unique_while"):
        lazy.finalize()


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (1, 1000),
        (0.001, 1),
        (timedelta(hours=24), 86_400_000),
        (timedelta(milliseconds=1), 1),
        (timedelta(days=3650), 3650 * 86_400_000),
    ],
)
def test_windows_in_whole_milliseconds(value: Any, ms: int) -> None:
    """Windows are accepted as seconds or timedelta, in whole milliseconds up to 3,650 days."""
    assert parse_window(value) == ms


def test_a_plain_unique_task_declares_nothing(app: Celery) -> None:
    """A UniqueTask without options has no keys and behaves like a plain task."""
    job = define(app)
    assert not job.__unique__.declares_keys


def test_selector_lambda_stays_a_plain_function(app: Celery) -> None:
    """A lambda given as an option is called with the view only, not bound as a method."""
    job = define(app, unique_key=lambda view: f"user:{view.user_id}")
    assert job.unique_key(SimpleNamespace(user_id=1)) == "user:1"


def test_unique_batches_task_is_rejected_at_definition(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unique batching task is refused when defined: batches cannot release by job id."""
    fake = ModuleType("celery_batches")
    fake.Batches = type("Batches", (Task,), {"abstract": True})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "celery_batches", fake)
    base = type("UniqueBatches", (UniqueTask, fake.Batches), {})  # type: ignore[attr-defined]

    with pytest.raises(UnsupportedCombination, match="Batches"):
        define(app, base=base, unique_key="k")
    assert define(app, base=base).__unique__.declares_keys is False
