"""The dispatch path and the lifecycle report every outcome through celery_unique.signals."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_unique import UniquenessConflict, UniqueTask, signals


@pytest.fixture
def sent() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """(signal name, arguments) of every uniqueness signal sent during the test."""
    seen: list[tuple[str, dict[str, Any]]] = []
    all_signals = (
        signals.job_created,
        signals.job_reused,
        signals.uniqueness_conflict,
        signals.key_released,
    )

    def receive(signal: Any = None, sender: Any = None, **kwargs: Any) -> None:
        seen.append((signal.name.rpartition(".")[2], kwargs))

    for each in all_signals:
        each.connect(receive, weak=False, dispatch_uid="test.wired")
    yield seen
    for each in all_signals:
        each.disconnect(receive, dispatch_uid="test.wired")


def test_dispatches_send_created_reused_and_conflict(
    app: Celery, sent: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A create, a reuse and a conflict each send their signal and write one log line at most."""

    @app.task(
        shared=False,
        base=UniqueTask,
        name="wired.charge",
        unique_window_key=lambda job: job.request_id,
        unique_window=60,
    )
    def charge(request_id: str, amount: int) -> None:
        return None

    with caplog.at_level(logging.INFO, logger="celery_unique"):
        first = charge.delay("R1", 1)
        charge.delay("R1", 1)
        with pytest.raises(UniquenessConflict):
            charge.delay("R1", 2)
    assert [name for name, _ in sent] == ["job_created", "job_reused", "uniqueness_conflict"]
    assert sent[1][1]["job_id"] == first.id
    assert sent[2][1]["conflicting_job_ids"] == [first.id]
    ours = [record.levelno for record in caplog.records if record.name == "celery_unique"]
    assert ours == [logging.INFO, logging.WARNING]


def test_eager_run_releases_with_a_signal(app: Celery, sent: list[Any]) -> None:
    """A job run eagerly releases its queued key at start: key_released, reason 'started'."""
    app.conf.task_always_eager = True

    @app.task(shared=False, base=UniqueTask, name="wired.eager", unique_key="k")
    def eager() -> int:
        return 1

    eager.delay()
    released = [args for name, args in sent if name == "key_released"]
    assert [(args["key"], args["reason"]) for args in released] == [
        ("wired.eager:k", signals.ReleaseReason.STARTED)
    ]


def test_unique_explain_is_a_task_method(app: Celery) -> None:
    """task.unique_explain(...) explains a dispatch with those arguments."""

    @app.task(shared=False, base=UniqueTask, name="wired.explained", unique_key="nightly")
    def explained() -> None:
        return None

    assert explained.unique_explain().verdict == "would create"
    first = explained.delay()
    assert explained.unique_explain().verdict == f"would reuse job {first.id} (active)"
