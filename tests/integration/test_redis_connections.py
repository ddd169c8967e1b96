"""The Redis store's decide path: its own connection per thread, and what happens to it.

Decisions normally travel on a connection the dispatching thread keeps for
itself; these tests pin down the cases where that could go wrong on a real
Redis: a second decision while the first reply is unread, a server that drops
the connection, another thread, a forked child, and ``close()``.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import redis

from celery_unique.keys.keyspace import ACTIVE, storage_key
from celery_unique.stores.base import ActiveClaim, Claim, RunStart, Scope, Verdict
from celery_unique.stores.redis import RedisStore

pytestmark = pytest.mark.redis


def claim(key: str) -> Claim:
    return Claim(
        str(uuid.uuid4()),
        "conn.task",
        ActiveClaim(f"unique:v1:{{conn}}:a:conn.task\x1f{key}", Scope.QUEUED, 60_000),
    )


@pytest.fixture
def store(redis_client: Any, redis_url: str) -> Iterator[RedisStore]:
    built = RedisStore.from_url(redis_url)
    try:
        yield built
    finally:
        built.close()


def client_count(redis_client: Any, name: str) -> int:
    return sum(1 for client in redis_client.client_list() if client.get("name") == name)


def test_decisions_of_one_thread_share_one_connection(store: RedisStore) -> None:
    first = store.decide([claim("a")])[0]
    connection = store._lanes._local.lane.connection  # type: ignore[union-attr]
    second = store.decide([claim("b")])[0]
    assert (first.verdict, second.verdict) == (Verdict.CREATED, Verdict.CREATED)
    assert store._lanes._local.lane.connection is connection  # type: ignore[union-attr]
    assert connection._sock is not None


def test_a_decision_inside_another_uses_a_pooled_connection(store: RedisStore) -> None:
    """The outer reply is still unread; the inner one must not be read off the same socket."""
    outer = store.send_decide([claim("outer")])
    inner = store.send_decide([claim("inner")]).wait()[0]
    again = store.send_decide([claim("inner")]).wait()[0]
    outer_decision = outer.wait()[0]
    assert outer_decision.verdict is Verdict.CREATED
    assert inner.verdict is Verdict.CREATED
    assert (again.verdict, again.job_id) == (Verdict.REUSED_ACTIVE, inner.job_id)
    assert store._lanes._local.lane.busy is False  # type: ignore[union-attr]


def test_a_connection_the_server_closed_is_replaced_before_use(
    store: RedisStore, redis_client: Any
) -> None:
    store.decide([claim("before")])
    connection = store._lanes._local.lane.connection  # type: ignore[union-attr]
    connection.send_command("CLIENT", "SETNAME", "lane-under-test")
    assert connection.read_response() in (b"OK", "OK")
    killed = [c for c in redis_client.client_list() if c.get("name") == "lane-under-test"]
    assert len(killed) == 1
    redis_client.execute_command("CLIENT", "KILL", "ID", killed[0]["id"])
    decision = store.decide([claim("after")])[0]
    assert decision.verdict is Verdict.CREATED
    assert client_count(redis_client, "lane-under-test") == 0  # a new connection answered


def test_each_thread_decides_on_its_own_connection(store: RedisStore) -> None:
    seen: list[Any] = []
    verdicts: list[Verdict] = []

    def decide(key: str) -> None:
        verdicts.append(store.decide([claim(key)])[0].verdict)
        seen.append(store._lanes._local.lane.connection)  # type: ignore[union-attr]

    threads = [threading.Thread(target=decide, args=(f"t{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert verdicts == [Verdict.CREATED] * 4
    assert len({id(connection) for connection in seen}) == 4


def _decide_in_child(store: RedisStore, key: str, out: Any) -> None:
    out.put(store.decide([claim(key)])[0].verdict.value)


def test_a_forked_child_opens_its_own_connection(store: RedisStore) -> None:
    """The parent's socket is never written by the child: both keep working."""
    store.decide([claim("parent-1")])
    parent_connection = store._lanes._local.lane.connection  # type: ignore[union-attr]
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_decide_in_child, args=(store, "child", out))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert out.get(timeout=5) == Verdict.CREATED.value
    assert store.decide([claim("parent-2")])[0].verdict is Verdict.CREATED
    assert store._lanes._local.lane.connection is parent_connection  # type: ignore[union-attr]


def test_close_disconnects_the_thread_connections(store: RedisStore) -> None:
    store.decide([claim("x")])
    connection = store._lanes._local.lane.connection  # type: ignore[union-attr]
    assert connection._sock is not None
    store.close()
    assert connection._sock is None


def test_green_threads_decide_through_the_pool(
    redis_client: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under gevent/eventlet (thread-local storage replaced) no connection per "thread"."""
    import _threading_local

    # What monkey-patching does to threading.local, without a green library.
    monkeypatch.setattr(threading, "local", _threading_local.local)
    green = RedisStore.from_url(redis_url)
    try:
        assert green._lanes is None
        first = green.decide([claim("green")])[0]
        again = green.decide([claim("green")])[0]
        assert first.verdict is Verdict.CREATED
        assert (again.verdict, again.job_id) == (Verdict.REUSED_ACTIVE, first.job_id)
    finally:
        green.close()


#: 300 greenlets decide at once on one store, each on a key of its own.
GREEN_BURST = """
from gevent import monkey

monkey.patch_all()

import sys
import uuid

import gevent

from celery_unique.stores.base import ActiveClaim, Claim, Scope, Verdict
from celery_unique.stores.redis import RedisStore

store = RedisStore.from_url(sys.argv[1])
prefix = uuid.uuid4().hex


def decide(n):
    key = "unique:v1:{conn}:a:conn.task\x1f" + prefix + str(n)
    claim = Claim(str(uuid.uuid4()), "conn.task", ActiveClaim(key, Scope.QUEUED, 60_000))
    return store.decide([claim])[0].verdict


jobs = [gevent.spawn(decide, n) for n in range(300)]
gevent.joinall(jobs)
failed = [repr(job.exception) for job in jobs if job.exception is not None]
created = sum(job.value is Verdict.CREATED for job in jobs)
print(created, len(failed), failed[:1])
"""


def test_greenlets_past_the_pools_cap_wait_for_a_connection(redis_url: str) -> None:
    """300 greenlets at once: each decision waits for a pooled connection, none fails."""
    done = subprocess.run(
        [sys.executable, "-c", GREEN_BURST, redis_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["300", "0"], done.stdout


class Interrupted(Exception):
    """What a soft time limit raises into a pool child, wherever it is."""


@pytest.mark.parametrize("where", ["script", "get"])
def test_a_command_interrupted_before_its_reply_leaves_no_reply_behind(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Interrupted after the send, before the read: the next command reads its own reply.

    redis-py puts such a connection back in its pool with the reply unread; a
    worker's next start of a run then took that reply for the job holding the
    key, and called a job that never ran a stale copy.
    """
    namespace = f"conn-{uuid.uuid4().hex[:8]}"
    held, free = (storage_key(namespace, ACTIVE, "conn.task", name) for name in ("held", "free"))

    def start(job: str, key: str) -> str | None:
        return store.start_run(job, key, RunStart(uuid.uuid4().hex, Scope.ACTIVE, "", 60_000))

    assert start("the-holder", held) is None
    # Scripts read their reply through the client, get() through a pipeline.
    owner = store.client if where == "script" else redis.client.Pipeline
    original = owner.parse_response
    struck = False

    def interrupted_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal struck
        if not struck:
            struck = True
            raise Interrupted("the soft time limit struck")
        return original(*args, **kwargs)

    # The server answers "the-holder", or the record and its TTL: unread.
    command = partial(start, "another-job", held) if where == "script" else partial(store.get, held)
    monkeypatch.setattr(owner, "parse_response", interrupted_once)
    with pytest.raises(Interrupted):
        command()
    monkeypatch.undo()
    assert start("mine", free) is None
    assert start("yet-another", held) == "the-holder"
