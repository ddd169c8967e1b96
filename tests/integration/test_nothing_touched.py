"""A dispatch with an invalid key fails before the store or the broker is touched.

The proof, on a real Redis store and a real Redis broker:

* **Store**: the app reaches its store (Redis db 9) through a TCP proxy
  (``tests.faultproxy``) that records every command sent through it. Redis's own counters (``INFO
  commandstats``) cannot prove anything here: they count every client of the
  server, and the broker (db 10 of the same server), the test's own checks and
  any other test run sharing the server all bump them. The proxy sees the
  store's connections and nothing else, so "no command went through it" is
  exact. The store's connection is opened (a ``PING``) before the invalid
  dispatch, so that dispatch would find it ready, and a valid dispatch after
  it must show up as a script call: the proxy really is on the store's path.
* **Broker**: the app publishes to a queue of its own that no worker
  consumes, so its Redis list holds exactly what was published: nothing
  after the invalid dispatch, one message after the valid one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_unique import (
    Disposition,
    InvalidJobId,
    InvalidKey,
    KeySelectorFailed,
    UniquenessError,
    UniquenessRequired,
    UniqueTask,
)
from celery_unique import config as unique_config
from tests.conftest import HOST, REDIS_TEST_DB, redis_publisher, service_port
from tests.faultproxy import FaultProxy

from .test_races import queue_lists

pytestmark = pytest.mark.redis

WINDOW_S = 60

BAD_KEYS = [
    pytest.param("", id="empty"),
    pytest.param("x" * 513, id="513-ascii-bytes"),
    pytest.param("é" * 256 + "x", id="513-utf8-bytes-257-chars"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("line\nbreak", id="newline"),
    pytest.param("del\x7f", id="del"),
    pytest.param("next\x85line", id="c1-control"),
    pytest.param("lone\ud800", id="lone-surrogate"),
    pytest.param(42, id="int"),
    pytest.param(b"key", id="bytes"),
]


@pytest.fixture
def tap(redis_url: str) -> Iterator[FaultProxy]:
    """A proxy in front of the Redis server that holds the store, recording every command."""
    with FaultProxy(HOST, service_port("redis")) as proxy:
        yield proxy


@pytest.fixture
def app(tap: FaultProxy, broker: Any) -> Iterator[Celery]:
    """An app whose store is reached through ``tap`` and whose queue no worker consumes."""
    app = redis_publisher("untouched", tap.url(REDIS_TEST_DB))
    app.finalize()
    yield app
    unique_config.reset(app)
    app.close()
    queue = app.conf.task_default_queue
    broker.delete(*queue_lists(queue), f"_kombu.binding.{queue}")


def define_tasks(app: Celery) -> dict[str, Any]:
    """A task without keys, and tasks that take their active or window key from a selector."""

    @app.task(shared=False, base=UniqueTask, name="untouched.given")
    def given(key: Any = None) -> None:
        return None

    @app.task(
        shared=False, base=UniqueTask, name="untouched.selected", unique_key=lambda job: job.key
    )
    def selected(key: Any) -> None:
        return None

    @app.task(
        shared=False,
        base=UniqueTask,
        name="untouched.windowed",
        unique_window_key=lambda job: job.key,
        unique_window=WINDOW_S,
    )
    def windowed(key: Any) -> None:
        return None

    return {"given": given, "selected": selected, "windowed": windowed}


#: One way of handing a key to a dispatch: ``(tasks, key) -> AsyncResult``.
WAYS: dict[str, Callable[[dict[str, Any], Any], Any]] = {
    "active-key-given": lambda t, key: t["given"].apply_async(unique_key=key),
    "window-key-given": lambda t, key: t["given"].apply_async(
        unique_window_key=key, unique_window=WINDOW_S
    ),
    "active-key-in-signature": lambda t, key: t["given"].s().set(unique_key=key).apply_async(),
    "active-key-from-selector": lambda t, key: t["selected"].delay(key),
    "window-key-from-selector": lambda t, key: t["windowed"].delay(key=key),
}


class Untouched:
    """Checks that the store saw no command and the broker's queue stayed empty in between.

    On entry the store's connection is opened (``PING``), so a dispatch in
    the block would not even have to connect to reach the store.
    """

    def __init__(self, app: Celery, tap: FaultProxy, broker: Any) -> None:
        self.app, self.tap, self.broker = app, tap, broker
        self.queue: str = app.conf.task_default_queue

    def __enter__(self) -> Untouched:
        unique_config.runtime(self.app).store.ping()
        assert queue_length(self.broker, self.queue) == 0
        self.commands = self.tap.command_log()
        assert self.commands[-1:] == ["PING"]
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self.tap.command_log() == self.commands, "the store was sent commands"
        assert queue_length(self.broker, self.queue) == 0, "a message was published"


def queue_length(broker: Any, queue: str) -> int:
    return sum(broker.llen(name) for name in queue_lists(queue))


def reaches_store_and_broker(app: Celery, tap: FaultProxy, broker: Any, send: Any) -> None:
    """``send()`` creates a job, then reuses it: one script call each, one queued message.

    The first call may open the dispatching thread's own connection to the
    store (its handshake); after that a dispatch is exactly one command.
    """
    commands, queued = len(tap.command_log()), queue_length(broker, app.conf.task_default_queue)
    assert send().disposition is Disposition.CREATED
    sent = tap.command_log()[commands:]
    assert sent[-1] in ("EVALSHA", "EVAL")  # EVAL: the script was new to the server
    assert set(sent[:-1]) <= CONNECTION_SETUP | {"EVALSHA"}, sent
    assert queue_length(broker, app.conf.task_default_queue) == queued + 1
    commands = len(tap.command_log())
    assert send().disposition is Disposition.REUSED
    assert tap.command_log()[commands:] == ["EVALSHA"], "one decision, one round trip"
    assert queue_length(broker, app.conf.task_default_queue) == queued + 1


#: What redis-py (and the store, to name it for undoing lost decisions) send on a
#: new connection: handshake, database, health check.
CONNECTION_SETUP = {"HELLO", "CLIENT", "SELECT", "AUTH", "PING"}


def dispatch_checked(
    way: str, app: Celery, tap: FaultProxy, broker: Any, key: Any
) -> UniquenessError:
    """Dispatch ``key`` the given way, checked to touch nothing; the error it raised.

    A valid dispatch the same way afterwards must reach the store and the
    broker, proving both are watched on the right path.
    """
    tasks = define_tasks(app)
    send = WAYS[way]
    with Untouched(app, tap, broker), pytest.raises(UniquenessError) as caught:
        send(tasks, key)
    reaches_store_and_broker(app, tap, broker, lambda: send(tasks, f"control-{way}"))
    return caught.value


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("bad", BAD_KEYS)
def test_invalid_key_touches_neither_store_nor_broker(
    way: str, bad: Any, app: Celery, tap: FaultProxy, broker: Any
) -> None:
    """An invalid key, given or selected: invalid_key, no store command, nothing published."""
    error = dispatch_checked(way, app, tap, broker, bad)
    assert isinstance(error, InvalidKey)
    assert error.code == "invalid_key"
    assert error.key == bad


@pytest.mark.parametrize("way", ["active-key-given", "active-key-from-selector"])
def test_longest_valid_key_reaches_the_store(
    way: str, app: Celery, tap: FaultProxy, broker: Any
) -> None:
    """A key of exactly 512 bytes (as UTF-8) is valid: it is decided and published."""
    tasks = define_tasks(app)
    for key in ("k" * 512, "é" * 256):
        reaches_store_and_broker(app, tap, broker, lambda: WAYS[way](tasks, key))  # noqa: B023


def test_failing_selectors_and_unbound_arguments_touch_nothing(
    app: Celery, tap: FaultProxy, broker: Any
) -> None:
    """A selector returning None or raising, or arguments that do not bind, touch nothing."""
    tasks = define_tasks(app)

    @app.task(shared=False, base=UniqueTask, name="untouched.broken", unique_key=lambda job: 1 / 0)
    def broken() -> None:
        return None

    with Untouched(app, tap, broker):
        with pytest.raises(UniquenessRequired):
            tasks["selected"].delay(None)
        with pytest.raises(KeySelectorFailed) as caught:
            broken.delay()
        assert isinstance(caught.value.__cause__, ZeroDivisionError)
        with pytest.raises(TypeError):
            tasks["selected"].delay("k", "one too many")
    reaches_store_and_broker(app, tap, broker, lambda: tasks["selected"].delay("control"))


#: Every control character, and a lone surrogate: ids no store could hold exactly.
BAD_JOB_IDS = [f"job-{chr(code)}-id" for code in (*range(0x20), *range(0x7F, 0xA0))] + [
    "job-\ud800-id"
]


@pytest.mark.parametrize("way", ["active-key-given", "window-key-from-selector"])
def test_job_ids_no_store_can_hold_are_refused_before_anything(
    way: str, app: Celery, tap: FaultProxy, broker: Any
) -> None:
    """``task_id`` with a control character (or unencodable): invalid_job_id, nothing touched."""
    tasks = define_tasks(app)
    task = tasks["given"] if way == "active-key-given" else tasks["windowed"]
    options = {"unique_key": "k"} if way == "active-key-given" else {"kwargs": {"key": "request-1"}}
    with Untouched(app, tap, broker):
        for job_id in BAD_JOB_IDS:
            with pytest.raises(InvalidJobId) as caught:
                task.apply_async(task_id=job_id, **options)
            assert (caught.value.code, caught.value.job_id) == ("invalid_job_id", job_id)
    reaches_store_and_broker(
        app, tap, broker, lambda: task.apply_async(task_id="ok:{1}", **options)
    )
