"""dispatch_many where the store and a Redis broker are one server (a private ``redis-server``).

There one script decides the whole batch and pushes the messages of the jobs it
created; a batch that cannot be exact that way asks the store first and kombu
publishes it. Each test reads what reached the server (through a loopback proxy
that logs every command and can refuse or break connections), the keys held
afterwards, and which jobs this process still awaits a result of.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery, signals
from kombu import Exchange, Queue
from kombu.exceptions import EncodeError

from celery_unique import (
    BackendUnavailable,
    Disposition,
    UniquenessConflict,
    UniqueTask,
    dispatch_many,
)
from celery_unique import config as unique_config
from celery_unique.testing import held_keys
from tests.conftest import HOST, fresh_queue_name, redis_publisher
from tests.faultproxy import FaultProxy
from tests.processes import RedisServer

pytestmark = pytest.mark.redis

#: Commands a client may send while it opens a connection.
SETUP = {"HELLO", "CLIENT", "SELECT", "AUTH", "PING", "INFO"}


@dataclass
class Bench:
    """An app whose store (db 0) and broker (db 1) are one server, and its tasks."""

    app: Celery
    queue: str
    broker: redis.Redis
    proxy: FaultProxy
    job: Any
    plain: Any
    order: Any

    def queued(self, queue: str | None = None) -> list[str]:
        """The ids of the jobs waiting in ``queue`` (the app's own by default), oldest first."""
        waiting = self.broker.lrange(queue or self.queue, 0, -1)
        return [json.loads(raw)["headers"]["id"] for raw in reversed(waiting)]

    def commands(self, dispatch: Callable[[], Any]) -> tuple[Any, list[str]]:
        """What ``dispatch()`` returns, and the commands it sent to the server."""
        before = len(self.proxy.command_log())
        result = dispatch()
        sent = [name for name in self.proxy.command_log()[before:] if name not in SETUP]
        return result, sent

    def held(self) -> dict[str, str]:
        """Each held key's name (as ``held_keys`` shows it), and the job holding it."""
        return {str(name): name.job_id for name in held_keys(self.app)}

    def subscribed(self, job_ids: list[str]) -> list[str]:
        """Those of ``job_ids`` whose result this process still awaits from the backend."""
        consumer = self.app.backend.result_consumer
        return [j for j in job_ids if consumer._get_key_for_task(j) in consumer.subscribed_to]


@pytest.fixture
def proxy(services: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy(HOST, services.port) as running:
        yield running


@pytest.fixture
def make_bench(services: RedisServer, proxy: FaultProxy) -> Iterator[Callable[..., Bench]]:
    """``make_bench(**settings)``: a new app (its own queue and namespace) on the server,
    store and broker reached through the proxy; the Redis result backend (db 2, direct)
    with ``results=True``."""
    made: list[Bench] = []

    def make(*, results: bool = False, **settings: Any) -> Bench:
        queue = fresh_queue_name()
        if results:
            settings.update(result_backend=services.url(2), task_ignore_result=False)
        app = redis_publisher(
            "colocatedbatch",
            proxy.url(0),
            queue=queue,
            broker_url=proxy.url(1),
            # No x-expires: kombu would send a command of its own beside each message.
            task_queues=[Queue(queue, Exchange(queue), routing_key=queue)],
            **settings,
        )

        @app.task(base=UniqueTask, shared=False, name="cb.job", unique_key=lambda j: j.key)
        def job(key: str, payload: Any = None) -> None:
            return None

        @app.task(shared=False, name="cb.plain")
        def plain(n: int) -> None:
            return None

        @app.task(
            base=UniqueTask,
            shared=False,
            name="cb.order",
            unique_window_key=lambda j: j.rid,
            unique_window=60,
        )
        def order(rid: str, amount: int) -> None:
            return None

        app.finalize()
        bench = Bench(app, queue, redis.Redis.from_url(services.url(1)), proxy, job, plain, order)
        made.append(bench)
        return bench

    yield make
    # A refused batch's error holds its results in a reference cycle: they end (and end
    # their subscriptions) while the server still answers.
    gc.collect()
    for bench in made:
        unique_config.reset(bench.app)
        bench.app.close()
        bench.broker.delete(bench.queue)
        bench.broker.close()


@pytest.fixture
def bench(make_bench: Callable[..., Bench]) -> Bench:
    return make_bench()


def test_a_batch_is_one_script_that_enqueues_only_the_jobs_it_created(bench: Bench) -> None:
    """A duplicate of a held key first, a job without uniqueness after it, a repeat of an
    earlier item: one EVALSHA, and only the published jobs' messages, in order."""
    holder = bench.job.delay("held")
    results, sent = bench.commands(
        lambda: dispatch_many(
            [
                bench.job.s("held"),
                bench.plain.s(1),
                bench.job.s("a"),
                bench.job.s("a"),
                bench.job.s("b"),
            ]
        )
    )
    assert sent == ["EVALSHA"]
    assert [r.disposition for r in results] == [
        Disposition.REUSED,
        Disposition.CREATED,
        Disposition.CREATED,
        Disposition.REUSED,
        Disposition.CREATED,
    ]
    assert results[0].id == holder.id
    assert results[3].id == results[2].id
    assert bench.queued() == [holder.id, results[1].id, results[2].id, results[4].id]
    assert sorted(bench.held().values()) == sorted([holder.id, results[2].id, results[4].id])


def test_a_batch_of_two_apps_publishes_each_job_through_its_own_app(bench: Bench) -> None:
    """An app on another broker and store in the batch: each job reaches its own app's
    queue and holds its key in its own app's store."""
    other = Celery("elsewhere", broker="memory://", set_as_current=False)
    # kombu's in-memory queues are shared by the whole process: one of its own.
    other_queue = fresh_queue_name()
    other.conf.update(
        unique_backend="memory://",
        broker_connection_retry=False,
        task_default_queue=other_queue,
    )

    @other.task(base=UniqueTask, shared=False, name="elsewhere.job", unique_key=lambda j: j.key)
    def elsewhere(key: str) -> None:
        return None

    other.finalize()
    try:
        here, there = dispatch_many([bench.job.s("k"), elsewhere.s("k")])
        assert [k.job_id for k in held_keys(other)] == [there.id]
        with other.connection_for_read() as connection:
            message = connection.SimpleQueue(other_queue).get(timeout=1)
            assert message.headers["id"] == there.id
            message.ack()
    finally:
        unique_config.reset(other)
    assert bench.queued() == [here.id]
    assert list(bench.held().values()) == [here.id]


def test_an_after_task_publish_receiver_sees_only_the_jobs_published(bench: Bench) -> None:
    """A receiver outside this package would see every message built: the store is asked
    first, and kombu publishes the created jobs only."""
    holder = bench.job.delay("held")
    seen: list[str] = []

    def note(headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append((headers or {})["id"])

    signals.after_task_publish.connect(note, weak=False, dispatch_uid="test.batch.after")
    try:
        results = dispatch_many([bench.job.s("held"), bench.job.s("new")])
    finally:
        signals.after_task_publish.disconnect(dispatch_uid="test.batch.after")
    assert results[0].id == holder.id
    assert seen == [results[1].id]
    assert bench.queued() == [holder.id, results[1].id]


def test_a_batch_too_large_for_one_script_is_decided_in_parts_then_published(
    bench: Bench,
) -> None:
    """More claims than one script takes: two scripts decide it, then kombu publishes the
    created jobs (a part's messages could not be taken back if a later part failed)."""
    bench.job.delay("warm")
    items = [bench.job.s(f"p{n}") for n in range(1_001)]
    results, sent = bench.commands(lambda: dispatch_many(items))
    assert sent.count("EVALSHA") == 2
    assert "LPUSH" in sent
    assert {r.disposition for r in results} == {Disposition.CREATED}
    assert bench.queued()[1:] == [r.id for r in results]


def test_a_message_kombu_must_send_itself_makes_the_batch_ask_first(
    make_bench: Callable[..., Bench],
) -> None:
    """An item for a queue that expires comes after a duplicate whose message was built
    already: the store is asked first, the created jobs are published, and the
    duplicate's job is not awaited."""
    bench = make_bench(results=True)
    expiring = fresh_queue_name()
    holder = bench.job.delay("held")
    items = [
        bench.job.s("held").set(task_id="dup-1"),
        bench.job.s("new"),
        bench.job.s("late").set(queue=Queue(expiring, expires=60.0)),
    ]
    try:
        results = dispatch_many(items)
        assert [r.disposition for r in results] == [
            Disposition.REUSED,
            Disposition.CREATED,
            Disposition.CREATED,
        ]
        assert bench.queued() == [holder.id, results[1].id]
        assert bench.queued(expiring) == [results[2].id]
    finally:
        bench.broker.delete(expiring)
    assert results[0].id == holder.id
    awaited = [holder.id, "dup-1", results[1].id, results[2].id]
    assert bench.subscribed(awaited) == [holder.id, results[1].id, results[2].id]


def test_a_conflict_writes_nothing_and_leaves_no_job_awaited(
    make_bench: Callable[..., Bench],
) -> None:
    """All or nothing: no message, no key, and none of the batch's jobs is awaited; told
    to go on, the other items are published and awaited."""
    bench = make_bench(results=True)
    first = bench.order.delay("r1", 10)
    items = [
        bench.job.s("a").set(task_id="a-1"),
        bench.order.s("r1", 99).set(task_id="conflicting-1"),
        bench.plain.s(1).set(task_id="plain-1"),
    ]
    with pytest.raises(UniquenessConflict) as caught:
        dispatch_many(items)
    assert caught.value.index == 1
    assert bench.queued() == [first.id]
    assert list(bench.held().values()) == [first.id]
    assert bench.subscribed(["a-1", "conflicting-1", "plain-1"]) == []
    items = [
        bench.job.s("a").set(task_id="a-2"),
        bench.order.s("r1", 99).set(task_id="conflicting-2"),
        bench.plain.s(1).set(task_id="plain-2"),
    ]
    results = dispatch_many(items, continue_on_conflict=True)
    assert isinstance(results[1], UniquenessConflict)
    assert bench.queued() == [first.id, "a-2", "plain-2"]
    assert bench.subscribed(["a-2", "conflicting-2", "plain-2"]) == ["a-2", "plain-2"]


def test_a_refused_batch_awaits_only_the_job_handed_back_under_its_own_id(
    make_bench: Callable[..., Bench],
) -> None:
    """The batch's jobs are not awaited once it is refused, while the error that tells of
    it lives: duplicates whose ids sort before and after their holder's, a created job,
    one without uniqueness. A duplicate that brings its holder's own id is that job,
    which stays awaited."""
    bench = make_bench(results=True)
    holder = bench.job.apply_async(("k",), task_id="job-b")
    first = bench.order.delay("r1", 10)
    ids = ["job-a", "job-b", "job-c", "job-n", "plain-1", "order-2"]
    items = [
        bench.job.s("k").set(task_id="job-a"),
        bench.job.s("k").set(task_id="job-b"),
        bench.job.s("k").set(task_id="job-c"),
        bench.job.s("new").set(task_id="job-n"),
        bench.plain.s(1).set(task_id="plain-1"),
        bench.order.s("r1", 99).set(task_id="order-2"),
    ]
    with pytest.raises(UniquenessConflict) as caught:
        dispatch_many(items)
    assert caught.value.index == 5
    assert bench.subscribed(ids) == [holder.id]
    assert bench.queued() == [holder.id, first.id]
    assert sorted(bench.held().values()) == sorted([holder.id, first.id])


def test_a_store_that_cannot_be_reached_fails_the_batch_and_leaves_no_job_awaited(
    make_bench: Callable[..., Bench],
) -> None:
    bench = make_bench(results=True)
    bench.plain.delay(0)  # the broker's connection is open; the store has none yet
    bench.proxy.refuse(True)
    with pytest.raises(BackendUnavailable) as caught:
        dispatch_many([bench.job.s("a").set(task_id="a-1"), bench.plain.s(1).set(task_id="p-1")])
    assert not caught.value.maybe_applied
    bench.proxy.refuse(False)
    assert len(bench.queued()) == 1
    assert bench.held() == {}
    assert bench.subscribed(["a-1", "p-1"]) == []


def test_a_store_that_cannot_be_reached_fails_open_once_warned(
    make_bench: Callable[..., Bench], caplog: pytest.LogCaptureFixture
) -> None:
    """With unique_fail_open the batch is published without uniqueness: a repeated item is
    a job of its own."""
    bench = make_bench(unique_fail_open=True)
    bench.plain.delay(0)
    bench.proxy.refuse(True)
    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        results = dispatch_many([bench.job.s("a"), bench.job.s("a")])
    bench.proxy.refuse(False)
    assert {r.disposition for r in results} == {Disposition.CREATED}
    assert bench.queued()[1:] == [r.id for r in results]
    assert len([r for r in caplog.records if "fail-open" in r.getMessage()]) == 1
    assert bench.held() == {}


def test_a_lost_reply_fails_the_batch_even_where_the_app_fails_open(
    make_bench: Callable[..., Bench],
) -> None:
    """The script may have created the jobs and pushed their messages: publishing them
    again without uniqueness would run them twice."""
    bench = make_bench(unique_fail_open=True)
    bench.job.delay("warm")
    bench.proxy.reset_on_reply_to("EVALSHA")
    with pytest.raises(BackendUnavailable) as caught:
        dispatch_many([bench.job.s("a"), bench.job.s("b")])
    assert caught.value.maybe_applied
    queued = bench.queued()[1:]
    assert len(queued) in (0, 2), "the script ran or it did not"
    assert sorted(bench.held().values()) == sorted([bench.queued()[0], *queued])


def test_a_batch_kombu_publishes_goes_out_whole_or_not_at_all(
    make_bench: Callable[..., Bench],
) -> None:
    """Asked first (colocation off), 70 messages in one kombu batch: the last cannot be
    encoded, so none leaves, and no key stays held."""
    bench = make_bench(unique_colocated=False)
    items = [bench.job.s(f"k{n}") for n in range(69)]
    items.append(bench.job.s("k69", payload=object()))
    with pytest.raises(EncodeError):
        dispatch_many(items)
    assert bench.queued() == []
    assert bench.held() == {}
