"""app.send_task with uniqueness options is applied or refused, never ignored."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery

from celery_unique import Disposition, UniqueTask, UnsupportedCombination, install


def test_send_task_applies_options_of_a_registered_unique_task(
    app: Celery, published: list[Any]
) -> None:
    """send_task routes a registered UniqueTask through its apply_async."""

    @app.task(shared=False, base=UniqueTask)
    def job(x: int) -> None:
        return None

    first = app.send_task(job.name, (1,), unique_key="k")
    second = app.send_task(job.name, (2,), unique_key="k")
    assert (first.disposition, second.disposition) == (Disposition.CREATED, Disposition.REUSED)
    assert second.id == first.id
    assert len(published) == 1


def test_send_task_refuses_options_it_cannot_apply(app: Celery, published: list[Any]) -> None:
    """A task not registered as a UniqueTask here: refused before anything is sent."""

    @app.task(shared=False)
    def plain() -> None:
        return None

    install(app)
    with pytest.raises(UnsupportedCombination):
        app.send_task("elsewhere.task", unique_key="k")
    with pytest.raises(UnsupportedCombination):
        app.send_task(plain.name, unique_key="k")
    assert published == []
    assert app.send_task("elsewhere.task", (1,)).id


def test_unguarded_app_logs_an_error_for_leaked_options(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An app that never installed the guard still gets a loud error for ignored options."""
    from celery_unique.dispatch import send_task

    send_task.connect()
    bare = Celery("bare-send", broker="memory://", set_as_current=False)
    with caplog.at_level(logging.ERROR, logger="celery_unique"):
        bare.send_task("x.y", unique_key="k")
    assert any("NOT applied" in record.getMessage() for record in caplog.records)
