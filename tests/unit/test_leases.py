"""Leases: a worker renews the keys of every job it holds, with one store call a round.

Which requests hold keys, how often a round comes, what a failed round does, and
that one renewer runs per app and process from the first received job until the
worker shuts down. The rounds are driven by a scripted stop event (the renewer's
only clock), so no test waits for an interval to pass.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, signals
from celery.worker import state

from celery_unique import config as unique_config
from celery_unique.dispatch.headers import HEADER
from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores.base import ActiveClaim, Claim, Hold, Scope
from celery_unique.worker import leases
from tests.unit.fakes import AnsweringStore, FakeRuntime

RENEWER = "celery-unique-lease-renewer"


class Request:
    """A worker's request as leases reads it: an id and the message headers (hashable and
    weakly referenceable, as Celery's own requests are)."""

    def __init__(self, job_id: str | None, header: dict[str, Any] | None = None) -> None:
        self.id = job_id
        self.headers = {} if header is None else {HEADER: {"v": 1, **header}}


class Consumer:
    """The sender of ``task_received``: a worker's consumer, which knows its app."""

    def __init__(self, app: Celery) -> None:
        self.app = app


class Stop:
    """A renewer's stop event that answers each wait from a script (``True``: stopped),
    recording the timeouts it was asked to wait."""

    def __init__(self, *answers: bool) -> None:
        self.answers = list(answers)
        self.waited: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.waited.append(timeout)
        return self.answers.pop(0)


class Changing:
    """A tracked set the consumer changes while it is read: the first ``fails`` reads raise
    as iterating a set that changes size does."""

    def __init__(self, fails: int, *items: Any) -> None:
        self.fails, self.items = fails, list(items)

    def __iter__(self) -> Iterator[Any]:
        if self.fails:
            self.fails -= 1
            raise RuntimeError("Set changed size during iteration")
        return iter(self.items)


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(leases, "runtime", lambda app: fake)
    return fake


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """This process's received, reserved and active requests, empty for the test."""
    sets = SimpleNamespace(received=weakref.WeakSet(), reserved=set(), active=set())
    monkeypatch.setattr(leases, "_received", sets.received)
    monkeypatch.setattr(state, "reserved_requests", sets.reserved)
    monkeypatch.setattr(state, "active_requests", sets.active)
    return sets


@pytest.fixture
def renewers() -> Iterator[None]:
    """Every renewer a test starts is stopped, and its thread ended, by the shutdown. (The
    renewers of workers an earlier test of this process ran are not the test's.)"""
    _earlier.clear()
    _earlier.update(t for t in threading.enumerate() if t.name == RENEWER)
    yield
    leases._on_worker_shutdown()
    for thread in renewer_threads():
        thread.join(5)


_earlier: set[threading.Thread] = set()


def renewer_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name == RENEWER and t.is_alive() and t not in _earlier
    ]


# Which requests hold keys


def test_each_active_key_of_a_request_is_held_by_its_job() -> None:
    requests = [
        Request("job-1", {"a": "ns:a:one"}),
        Request("job-2", {"a": "ns:a:two", "x": {"a": "ns:a:own"}}),
        Request("job-3", {"x": {"a": "ns:a:replacement"}}),
    ]
    assert leases.held_by_worker(requests) == [
        Hold("job-1", "ns:a:one"),
        Hold("job-2", "ns:a:two"),
        Hold("job-2", "ns:a:own"),
        Hold("job-3", "ns:a:replacement"),
    ]


def test_requests_without_an_active_key_a_header_or_an_id_hold_nothing() -> None:
    requests = [
        Request("window-only", {"w": "ns:w:k"}),
        Request("empty", {"a": "", "x": {}}),
        Request("plain"),
        Request(None, {"a": "ns:a:no-id"}),
        Request("", {"a": "ns:a:empty-id"}),
    ]
    assert leases.held_by_worker(requests) == []


def test_a_request_that_holds_nothing_leaves_the_next_ones_held() -> None:
    requests = [Request("plain"), Request(None, {"a": "ns:a:no-id"}), Request("job", {"a": "k"})]
    assert leases.held_by_worker(requests) == [Hold("job", "k")]


def test_a_worker_holds_every_request_it_received_reserved_or_runs_once(
    tracked: SimpleNamespace,
) -> None:
    received, reserved, running = Request("r"), Request("q"), Request("x")
    tracked.received.update({received, reserved})
    tracked.reserved.update({reserved})
    tracked.active.update({running, received})
    found = leases._worker_requests()
    assert sorted(r.id for r in found) == ["q", "r", "x"]


def test_a_set_changing_while_it_is_read_is_read_again_up_to_three_times(
    monkeypatch: pytest.MonkeyPatch, tracked: SimpleNamespace
) -> None:
    third, fourth = Request("third-read"), Request("fourth-read")
    monkeypatch.setattr(state, "reserved_requests", Changing(2, third))
    monkeypatch.setattr(state, "active_requests", Changing(3, fourth))
    assert [r.id for r in leases._worker_requests()] == ["third-read"]


# Rounds


def test_a_round_renews_every_held_key_in_one_call(
    rt: FakeRuntime, tracked: SimpleNamespace
) -> None:
    tracked.active.update({Request("job", {"a": "ns:a:k", "x": {"a": "ns:a:own"}})})
    leases.Renewer(None).renew_once(30_000)  # type: ignore[arg-type]
    assert rt.store.renewed == [([Hold("job", "ns:a:k"), Hold("job", "ns:a:own")], 30_000)]


def test_a_round_with_nothing_held_asks_the_store_nothing(
    rt: FakeRuntime, tracked: SimpleNamespace
) -> None:
    tracked.active.update({Request("plain")})
    assert leases.Renewer(None).renew_once(30_000) == 0  # type: ignore[arg-type]
    assert rt.store.renewed == []


def test_a_round_that_fails_is_logged_and_renews_nothing(
    rt: FakeRuntime, tracked: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    rt.store = AnsweringStore(error=BackendUnavailable("down"))
    tracked.active.update({Request("one", {"a": "ns:a:1"}), Request("two", {"a": "ns:a:2"})})
    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        assert leases.Renewer(None).renew_once(30_000) == 0  # type: ignore[arg-type]
    (record,) = caplog.records
    assert record.getMessage() == "could not renew 2 key leases"
    assert record.exc_info
    assert record.exc_info[0] is BackendUnavailable


def test_a_round_pushes_the_lease_of_the_keys_in_the_store(
    app: Celery, tracked: SimpleNamespace
) -> None:
    store = unique_config.runtime(app).store
    store.decide([Claim("job", "task", active=ActiveClaim("ns:a:k", Scope.ACTIVE, 1_000))])
    request = Request("job", {"a": "ns:a:k"})
    tracked.received.add(request)
    assert leases.Renewer(app).renew_once(600_000) == 1
    held = store.get("ns:a:k")
    assert held is not None
    assert held.expires_in_ms is not None
    assert held.expires_in_ms > 500_000


def test_rounds_come_three_times_a_lease_until_the_renewer_stops(
    rt: FakeRuntime, tracked: SimpleNamespace
) -> None:
    tracked.active.update({Request("job", {"a": "ns:a:k"})})
    rt.lease_ms = 60_000
    renewer = leases.Renewer(None)  # type: ignore[arg-type]
    renewer.stopped = Stop(False, False, True)  # type: ignore[assignment]
    renewer.run()
    assert renewer.stopped.waited == [20.0, 20.0, 20.0]  # type: ignore[attr-defined]
    assert rt.store.renewed == [([Hold("job", "ns:a:k")], 60_000)] * 2


def test_a_short_lease_is_renewed_every_tenth_of_a_second_at_most(rt: FakeRuntime) -> None:
    rt.lease_ms = 30
    renewer = leases.Renewer(None)  # type: ignore[arg-type]
    renewer.stopped = Stop(True)  # type: ignore[assignment]
    renewer.run()
    assert renewer.stopped.waited == [0.1]  # type: ignore[attr-defined]


def test_without_a_lease_there_is_nothing_to_renew(rt: FakeRuntime) -> None:
    rt.lease_ms = None
    renewer = leases.Renewer(None)  # type: ignore[arg-type]
    renewer.stopped = Stop()  # type: ignore[assignment]
    renewer.run()
    assert renewer.stopped.waited == []  # type: ignore[attr-defined]


def test_a_stopped_renewer_ends_its_rounds(rt: FakeRuntime) -> None:
    renewer = leases.Renewer(None)  # type: ignore[arg-type]
    renewer.stop()
    renewer.run()
    assert rt.store.renewed == []


def test_a_renewer_never_keeps_its_process_alive() -> None:
    assert leases.Renewer(None).daemon  # type: ignore[arg-type]


# One renewer per app and process, from the first received job to the shutdown


@pytest.mark.usefixtures("renewers")
def test_the_first_received_job_starts_the_apps_renewer_once(
    app: Celery, tracked: SimpleNamespace
) -> None:
    first, second = Request("one", {"a": "ns:a:1"}), Request("two", {"a": "ns:a:2"})
    consumer = Consumer(app)
    leases._on_received(sender=consumer, request=first)
    leases._on_received(sender=consumer, request=second)
    assert len(renewer_threads()) == 1
    held = leases.held_by_worker(leases._worker_requests())
    assert sorted(held) == [Hold("one", "ns:a:1"), Hold("two", "ns:a:2")]


@pytest.mark.usefixtures("renewers")
def test_a_received_job_names_its_app_on_the_request_when_the_sender_has_none(
    app: Celery, tracked: SimpleNamespace
) -> None:
    request = Request("one", {"a": "ns:a:1"})
    request.app = app  # type: ignore[attr-defined]
    leases._on_received(sender=object(), request=request)
    assert len(renewer_threads()) == 1
    assert leases._worker_requests() == [request]


@pytest.mark.usefixtures("renewers")
def test_a_job_without_keys_starts_no_renewer(app: Celery, tracked: SimpleNamespace) -> None:
    leases._on_received(sender=Consumer(app), request=Request("plain"))
    leases._on_received(sender=object(), request=Request("no-app", {"a": "ns:a:k"}))
    assert renewer_threads() == []
    assert leases._worker_requests() == []


@pytest.mark.usefixtures("renewers")
def test_a_worker_shutdown_stops_the_renewers_and_the_next_job_starts_one(
    app: Celery, tracked: SimpleNamespace
) -> None:
    leases.connect()
    consumer = Consumer(app)
    signals.task_received.send(sender=consumer, request=Request("one", {"a": "ns:a:1"}))
    (renewer,) = renewer_threads()
    signals.worker_shutdown.send(sender=None)
    renewer.join(5)
    assert not renewer.is_alive()
    signals.task_received.send(sender=consumer, request=Request("two", {"a": "ns:a:2"}))
    (again,) = renewer_threads()
    assert again is not renewer
