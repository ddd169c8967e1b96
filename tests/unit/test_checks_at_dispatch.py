"""The checks of a task alone, logged once at its first dispatch in the process."""

from __future__ import annotations

import logging
import uuid

import pytest
from celery import Celery

from celery_unique import UniqueTask


def _logged(caplog: pytest.LogCaptureFixture, check_id: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.getMessage().startswith(check_id)]


def test_a_task_that_forgot_its_base_is_an_error_at_its_first_publish(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain task with unique_* options: E020 at ERROR when first published, once."""
    name = f"forgot.{uuid.uuid4().hex[:8]}"

    @app.task(name=name, shared=False, unique_key=lambda job: job.n, unique_while="active")
    def forgot(n: int) -> None: ...

    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        forgot.delay(1)
        forgot.delay(2)
        app.send_task(name, (3,))
    [record] = _logged(caplog, "celery_unique.E020")
    assert record.levelno == logging.ERROR
    assert f"task {name} has unique_key, unique_while but is not a UniqueTask" in (
        record.getMessage()
    )


def test_a_unique_task_s_own_warnings_come_at_its_first_dispatch_only(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """W022/W023 of a UniqueTask are logged once, at its first dispatch; a queued key has none."""
    app.conf.result_expires = 60
    name = f"export.{uuid.uuid4().hex[:8]}"

    @app.task(
        base=UniqueTask,
        name=name,
        shared=False,
        unique_key=lambda job: job.day,
        unique_while="exists",
        unique_retention=120,
    )
    def export(day: str) -> None: ...

    @app.task(base=UniqueTask, name=f"{name}.queued", shared=False, unique_key="one")
    def queued() -> None: ...

    with caplog.at_level(logging.INFO, logger="celery_unique"):
        for day in ("mon", "tue", "mon"):
            export.delay(day)
        queued.delay()
        queued.delay()
    [retention] = _logged(caplog, "celery_unique.W022")
    [no_result] = _logged(caplog, "celery_unique.W023")
    assert (retention.levelno, no_result.levelno) == (logging.WARNING, logging.WARNING)
    assert f"task {name} keeps its exists key 120 s" in retention.getMessage()
    assert f"the reaper cannot free the keys of {name} " in no_result.getMessage()
    findings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("celery_")]
    assert len(findings) == 2


def test_the_names_remembered_as_checked_are_bounded(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process publishing ever new task names keeps at most ``MAX_REMEMBERED`` of them:
    each is remembered (checked once) until the set is full, then the set starts again
    (a name is checked once more), never growing on. (A bound past the integers Python
    keeps one object each for: an identity test would never see the set full.)"""
    from celery_unique.checks import at_dispatch

    bound = 300
    monkeypatch.setattr(at_dispatch, "MAX_REMEMBERED", bound)
    monkeypatch.setattr(at_dispatch, "_published", set())
    checked: list[object] = []
    monkeypatch.setattr(at_dispatch, "_tasks_named", lambda name: checked.append(name) or [])
    for n in range(2 * bound + 10):
        at_dispatch.on_publish(sender=f"made.at.run.time.{n}")
        assert len(at_dispatch._published) == n % bound + 1
        at_dispatch.on_publish(sender=f"made.at.run.time.{n - n % bound}")  # remembered
    assert checked == [f"made.at.run.time.{n}" for n in range(2 * bound + 10)]
