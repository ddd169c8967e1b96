"""The store's Redis stopped and started again under a producer.

Failing closed (the default), a dispatch raises ``BackendUnavailable`` and
publishes nothing; failing open, it publishes without uniqueness and says so
once per outage. Either way dispatches are unique again as soon as the store
is back. The store is a ``redis-server`` of the test's own (no persistence:
it comes back empty); the broker is the fault tests' Redis, with no worker on
the test's queue, so the queue's length is exactly what was published.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import pytest

from celery_unique import BackendUnavailable, Disposition

from ._apps import Spec
from .conftest import RedisServer, producer, queue_length, task_of

STOPS = [pytest.param(signal.SIGTERM, id="sigterm"), pytest.param(signal.SIGKILL, id="sigkill")]


@pytest.mark.parametrize("stop", STOPS)
def test_store_down_fails_closed_and_publishes_nothing(
    stop: signal.Signals,
    make_spec: Callable[..., Spec],
    redis_server: Callable[[], RedisServer],
) -> None:
    """Store down: dispatches raise backend_unavailable, nothing is queued; back: unique again."""
    store = redis_server()
    spec = make_spec(store_url=store.url())
    with producer(spec) as app:
        job = task_of(app)
        assert job.apply_async(unique_key="k").disposition is Disposition.CREATED
        queued = queue_length(spec)
        store.stop(stop)

        for _ in range(3):
            with pytest.raises(BackendUnavailable) as caught:
                job.apply_async(unique_key="k")
            assert caught.value.code == "backend_unavailable"
        assert queue_length(spec) == queued

        store.start()
        created = job.apply_async(unique_key="k")
        reused = job.apply_async(unique_key="k")
        assert created.disposition is Disposition.CREATED
        assert (reused.disposition, reused.id) == (Disposition.REUSED, created.id)
        assert queue_length(spec) == queued + 1


def test_store_that_stops_answering_fails_closed_with_backend_unavailable(
    make_spec: Callable[..., Spec], redis_server: Callable[[], RedisServer]
) -> None:
    """A store frozen while asked: the dispatch raises backend_unavailable and queues nothing."""
    store = redis_server()
    spec = make_spec(store_url=f"{store.url()}?socket_timeout=0.5")
    with producer(spec) as app:
        job = task_of(app)
        # Opens the pooled connection: the next request is sent, and its answer awaited.
        job.apply_async(unique_key="warm-up")
        queued = queue_length(spec)
        store.pause()
        try:
            with pytest.raises(BackendUnavailable) as caught:
                job.apply_async(unique_key="k")
        finally:
            store.resume()
        assert caught.value.code == "backend_unavailable"
        assert queue_length(spec) == queued


def unique_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Warnings and errors celery_unique logged since the last ``caplog.clear()``."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "celery_unique" and record.levelno >= logging.WARNING
    ]


def test_store_down_with_fail_open_publishes_and_warns_once_per_outage(
    make_spec: Callable[..., Spec],
    redis_server: Callable[[], RedisServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fail-open: jobs go out while the store is down; one warning per outage, one on return."""
    caplog.set_level(logging.INFO, logger="celery_unique")
    store = redis_server()
    spec = make_spec(store_url=store.url(), fail_open=True)
    with producer(spec) as app:
        job = task_of(app)
        held = job.apply_async(unique_key="k")
        for outage in range(2):
            queued = queue_length(spec)
            store.stop()
            caplog.clear()
            during = [job.apply_async(unique_key="k") for _ in range(5)]
            assert [r.disposition for r in during] == [Disposition.CREATED] * 5
            assert len({held.id, *(r.id for r in during)}) == 6, "every dispatch is a new job"
            assert queue_length(spec) == queued + 5
            [warning] = unique_warnings(caplog)
            assert "unavailable" in warning, outage
            assert "fail-open" in warning, outage

            store.start()
            caplog.clear()
            held = job.apply_async(unique_key="k")
            again = job.apply_async(unique_key="k")
            assert (again.disposition, again.id) == (Disposition.REUSED, held.id)
            [restored] = unique_warnings(caplog)
            assert "restored" in restored, outage


@pytest.mark.parametrize("fail_open", ["false", "OFF", "0"])
def test_a_string_saying_false_keeps_fail_closed(
    fail_open: str, make_spec: Callable[..., Spec], redis_server: Callable[[], RedisServer]
) -> None:
    """``unique_fail_open`` from the environment ("false", a truthy string): store down, the
    dispatch raises backend_unavailable and nothing is queued."""
    store = redis_server()
    spec = make_spec(store_url=store.url(), fail_open=fail_open)
    store.stop(signal.SIGKILL)
    with producer(spec) as app:
        queued = queue_length(spec)
        with pytest.raises(BackendUnavailable):
            task_of(app).apply_async(unique_key="k")
        assert queue_length(spec) == queued
