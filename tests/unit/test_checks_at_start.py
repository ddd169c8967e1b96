"""The checks a starting worker runs: for an app that uses the plugin, bound UniqueTask or not."""

from __future__ import annotations

import logging

import pytest
from celery import Celery, _state

from celery_unique.checks.at_start import check_at_worker_start


@pytest.fixture
def no_shared_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Apps of the test get none of the shared tasks other tests declared (Celery gives every
    app those, UniqueTasks among them)."""
    monkeypatch.setattr(_state, "_on_app_finalizers", set())


@pytest.mark.usefixtures("no_shared_tasks")
def test_only_an_app_that_uses_the_plugin_is_checked(caplog: pytest.LogCaptureFixture) -> None:
    """Unique_* options on a task are use enough (no setting, no UniqueTask); a plain app is not."""
    plain = Celery("plain", broker="memory://", set_as_current=False)
    forgot = Celery("forgot", broker="memory://", set_as_current=False)

    @plain.task(name="plain.noop", shared=False)
    def noop() -> None: ...

    @forgot.task(name="forgot.reindex", shared=False, unique_key="all")
    def reindex() -> None: ...

    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        check_at_worker_start(plain)
        check_at_worker_start(forgot)
    assert [(r.levelno, r.getMessage().split()[0]) for r in caplog.records] == [
        (logging.ERROR, "celery_unique.E001"),
        (logging.ERROR, "celery_unique.E020"),
    ]


@pytest.mark.usefixtures("no_shared_tasks")
@pytest.mark.parametrize(("strict", "stops"), [("on", True), ("false", False), ("maybe", True)])
def test_strict_checks_read_as_a_boolean(strict: str, stops: bool) -> None:
    """``unique_strict_checks`` from the environment: a string saying true stops a worker
    with an error, one saying false does not, and any other stops it naming the setting."""
    forgot = Celery("forgot", broker="memory://", set_as_current=False)
    forgot.conf.unique_strict_checks = strict

    @forgot.task(name="forgot.reindex", shared=False, unique_key="all")
    def reindex() -> None: ...

    if not stops:
        check_at_worker_start(forgot)
        return
    with pytest.raises(SystemExit, match="unique_strict_checks") as stopped:
        check_at_worker_start(forgot)
    if strict == "maybe":
        assert "'maybe'" in str(stopped.value)
