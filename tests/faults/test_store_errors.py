"""A store that answers with an outage error is unavailable, not a crash: backend_unavailable.

Real ``redis-server`` s put in each state: out of memory (``--maxmemory``),
a read-only replica (``--replicaof``), busy with a long script, and a store
whose connections the server kills. Every dispatch path (a single dispatch,
``dispatch_many``) raises ``backend_unavailable`` with nothing published,
and ``unique_fail_open=True`` applies to these errors as to an unreachable
store.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_unique import BackendUnavailable, Disposition, dispatch_many
from tests.processes import RedisServer

from ._apps import Spec
from .conftest import eventually, producer, queue_length, task_of

pytestmark = pytest.mark.slow


def fill(url: str) -> None:
    """Write until the server refuses with OOM (its maxmemory is tiny)."""
    client = redis.Redis.from_url(url)
    try:
        for n in range(100_000):
            client.set(f"ballast:{n}", "x" * 1024)
    except redis.exceptions.OutOfMemoryError:
        return
    finally:
        client.close()
    pytest.fail("the server never ran out of memory")


@pytest.fixture
def out_of_memory(redis_server: Callable[..., RedisServer]) -> RedisServer:
    server = redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    fill(server.url(0))
    return server


@pytest.fixture
def replica(redis_server: Callable[..., RedisServer]) -> RedisServer:
    master = redis_server()
    server = redis_server("--replicaof", "127.0.0.1", str(master.port))
    client = redis.Redis.from_url(server.url(0))
    try:
        eventually(lambda: client.info("replication")["master_link_status"] == "up", 20)
    finally:
        client.close()
    return server


@pytest.fixture
def busy(redis_server: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    """A server stuck in a script (``BUSY`` to everyone else) until the test ends."""
    server = redis_server("--busy-reply-threshold", "100")
    client = redis.Redis.from_url(server.url(0))
    stuck = threading.Thread(
        target=lambda: _ignore(lambda: client.eval("while true do end", 0)), daemon=True
    )
    stuck.start()
    time.sleep(0.3)
    yield server
    killer = redis.Redis.from_url(server.url(0))
    killer.script_kill()
    killer.close()
    stuck.join(10)
    client.close()


def _ignore(call: Callable[[], Any]) -> None:
    with contextlib.suppress(redis.RedisError):
        call()


STATES = ["out_of_memory", "replica", "busy"]


@pytest.mark.parametrize("state", STATES)
def test_an_outage_reply_is_backend_unavailable_and_nothing_is_published(
    state: str, request: pytest.FixtureRequest, make_spec: Callable[..., Spec]
) -> None:
    """OOM, READONLY, BUSY: a dispatch and a batch raise backend_unavailable, publish nothing."""
    server: RedisServer = request.getfixturevalue(state)
    spec = make_spec(store_url=server.url(0))
    with producer(spec) as app:
        task = task_of(app)
        published = queue_length(spec)
        with pytest.raises(BackendUnavailable) as single:
            task.apply_async(unique_key="k", unique_while="active")
        with pytest.raises(BackendUnavailable):
            dispatch_many([task.s().set(unique_key=f"k{n}") for n in range(3)])
        assert queue_length(spec) == published
    if state == "busy":
        assert not single.value.maybe_applied, "refused before the script ran: nothing to undo"


@pytest.mark.parametrize("state", STATES)
def test_fail_open_publishes_through_an_outage_reply(
    state: str, request: pytest.FixtureRequest, make_spec: Callable[..., Spec]
) -> None:
    """With fail-open the same errors publish without uniqueness, as for an unreachable store."""
    server: RedisServer = request.getfixturevalue(state)
    spec = make_spec(store_url=server.url(0), fail_open=True)
    with producer(spec) as app:
        task = task_of(app)
        published = queue_length(spec)
        first = task.apply_async(unique_key="k", unique_while="active")
        results = dispatch_many([task.s().set(unique_key="k") for _ in range(2)])
        assert first.disposition is Disposition.CREATED
        assert [r.disposition for r in results] == [Disposition.CREATED] * 2  # type: ignore[union-attr]
        assert queue_length(spec) == published + 3


def test_killed_store_connections_are_replaced(
    redis_server: Callable[..., RedisServer], make_spec: Callable[..., Spec]
) -> None:
    """The server kills every client: the next dispatch reconnects and decides as usual."""
    server = redis_server()
    spec = make_spec(store_url=server.url(0))
    admin = redis.Redis.from_url(server.url(0))
    try:
        with producer(spec) as app:
            task = task_of(app)
            first = task.apply_async(unique_key="k", unique_while="active")
            admin.client_kill_filter(_type="normal", skipme=True)
            second = task.apply_async(unique_key="k", unique_while="active")
            assert (second.disposition, second.id) == (Disposition.REUSED, first.id)
    finally:
        admin.close()
