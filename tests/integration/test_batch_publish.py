"""dispatch_many on the Redis broker: a job's message and its key go out together, or neither does.

kombu's publish batch flushes once it has buffered a number of *transport
commands*, and a message routed to two queues is two commands: a batch sized
by its number of items would flush part-way, and a failure after that would
roll back the keys of jobs already published. The batch never flushes
part-way, so when an item fails to publish, nothing has left.

A queue is declared by the first message routed to it over a connection, not
again by every message (a batch's, or single dispatches'), on both paths.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Producer, Queue
from kombu.exceptions import EncodeError, OperationalError

from celery_unique import Disposition, UniqueResult, UniqueTask, dispatch_many
from celery_unique import config as unique_config
from celery_unique.keys.keyspace import ACTIVE, storage_key
from tests.conftest import fresh_queue_name, redis_publisher

from .test_races import queue_lists

pytestmark = pytest.mark.redis


@pytest.fixture
def fanned(redis_url: str, broker: Any) -> Iterator[tuple[Celery, list[str]]]:
    """An app whose default route reaches two queues: two transport commands per message."""
    names = [fresh_queue_name(), fresh_queue_name()]
    # Topic: for a direct exchange Celery sends straight to the queue, past the bindings.
    exchange = Exchange(f"fan-{uuid.uuid4().hex}", type="topic")
    queues = [Queue(name, exchange, routing_key="both") for name in names]
    app = redis_publisher(
        "batchpub",
        redis_url,
        task_queues=queues,
        task_default_queue=names[0],
        task_default_exchange=exchange.name,
        task_default_exchange_type="topic",
        task_default_routing_key="both",
    )
    app.finalize()
    with app.connection_for_write() as connection:
        for queue in queues:
            queue(connection.default_channel).declare()
    yield app, names
    unique_config.reset(app)
    app.close()
    broker.delete(*(lst for name in names for lst in queue_lists(name)))
    broker.delete(f"_kombu.binding.{exchange.name}")


def test_a_batch_that_fails_part_way_publishes_nothing_and_holds_nothing(
    fanned: tuple[Celery, list[str]], broker: Any
) -> None:
    """Item 3 of 4 cannot be encoded: no message of the batch is out, and no key is held."""
    app, names = fanned

    @app.task(base=UniqueTask, shared=False, name="batchpub.job", unique_key=lambda job: job.key)
    def job(key: str, payload: Any = None) -> None:
        return None

    items = [job.s(f"k{n}") for n in range(2)]
    items += [job.s("k2", payload=object()), job.s("k3")]
    with pytest.raises(EncodeError):
        dispatch_many(items)
    queued = sum(broker.llen(lst) for name in names for lst in queue_lists(name))
    assert queued == 0, "messages of the failed batch were published"
    store = unique_config.runtime(app).store
    namespace = unique_config.runtime(app).namespace
    held = [store.get(storage_key(namespace, ACTIVE, job.name, f"k{n}")) for n in range(4)]
    assert held == [None] * 4, "keys of the failed batch are still held"
    # A batch that publishes: every message reaches both queues, one key per job.
    dispatch_many([job.s(f"ok{n}") for n in range(5)])
    assert [sum(broker.llen(lst) for lst in queue_lists(name)) for name in names] == [5, 5]


def test_a_batch_that_fails_part_way_on_rabbitmq_holds_only_the_keys_of_jobs_sent(
    redis_url: str, rabbitmq_url: str
) -> None:
    """RabbitMQ takes a batch's messages one by one: when item 3 of 4 cannot be encoded,
    items 1 and 2 are out and keep their keys, and items 3 and 4 hold none."""
    app = redis_publisher("batchrabbit", redis_url, broker_url=rabbitmq_url)

    @app.task(base=UniqueTask, shared=False, name="batchrabbit.job", unique_key=lambda j: j.key)
    def job(key: str, payload: Any = None) -> None:
        return None

    (queue,) = app.conf.task_queues
    try:
        items = [job.s("k0"), job.s("k1"), job.s("k2", payload=object()), job.s("k3")]
        with pytest.raises(EncodeError):
            dispatch_many(items)
        sent = _take_job_ids(app, queue)
        rt = unique_config.runtime(app)
        held = [
            rt.store.get(storage_key(rt.namespace, ACTIVE, job.name, f"k{n}")) for n in range(4)
        ]
        assert len(sent) == 2, "the items before the one that failed are published"
        assert [h and h.job_id for h in held] == [*sent, None, None]
    finally:
        with app.connection_for_write() as connection:
            queue(connection.default_channel).delete()
        unique_config.reset(app)
        app.close()


@pytest.mark.parametrize("nth", [1, 2, 4])
def test_a_batch_whose_connection_breaks_part_way_on_rabbitmq_holds_only_the_keys_of_jobs_sent(
    redis_url: str, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    """The connection to RabbitMQ breaks as item ``nth`` of 4 is published (publishes not
    retried): the items before it are out and keep their keys; it and the items after it
    are not, and hold none."""
    app = redis_publisher(
        "batchbroken", redis_url, broker_url=rabbitmq_url, task_publish_retry=False
    )

    @app.task(base=UniqueTask, shared=False, name="batchbroken.job", unique_key=lambda j: j.key)
    def job(key: str) -> None:
        return None

    attempted = _breaking_on_publish(app, monkeypatch, nth)
    (queue,) = app.conf.task_queues
    try:
        with pytest.raises(OperationalError):
            dispatch_many([job.s(f"k{n}") for n in range(4)])
        assert len(attempted) == nth
        sent = _take_job_ids(app, queue)
        assert sent == attempted[: nth - 1], "the items before the broken publish are out"
        rt = unique_config.runtime(app)
        held = [
            rt.store.get(storage_key(rt.namespace, ACTIVE, job.name, f"k{n}")) for n in range(4)
        ]
        assert [h and h.job_id for h in held] == [*sent] + [None] * (4 - len(sent))
    finally:
        with app.connection_for_write() as connection:
            queue(connection.default_channel).delete()
        unique_config.reset(app)
        app.close()


def test_a_batch_whose_connection_breaks_on_rabbitmq_is_published_whole_when_retried(
    redis_url: str, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With Celery's publish retries (the default), kombu connects again and publishes the
    item whose connection broke: every item is out, and every key is held by its job."""
    app = redis_publisher("batchretried", redis_url, broker_url=rabbitmq_url)

    @app.task(base=UniqueTask, shared=False, name="batchretried.job", unique_key=lambda j: j.key)
    def job(key: str) -> None:
        return None

    attempted = _breaking_on_publish(app, monkeypatch, 3)
    (queue,) = app.conf.task_queues
    try:
        results = dispatch_many([job.s(f"k{n}") for n in range(4)])
        created = [
            r.id
            for r in results
            if isinstance(r, UniqueResult) and r.disposition is Disposition.CREATED
        ]
        assert _take_job_ids(app, queue) == attempted == created
        rt = unique_config.runtime(app)
        held = [
            rt.store.get(storage_key(rt.namespace, ACTIVE, job.name, f"k{n}")) for n in range(4)
        ]
        assert [h and h.job_id for h in held] == attempted
    finally:
        with app.connection_for_write() as connection:
            queue(connection.default_channel).delete()
        unique_config.reset(app)
        app.close()


def _breaking_on_publish(app: Celery, monkeypatch: pytest.MonkeyPatch, nth: int) -> list[str]:
    """Break the connection to the broker as ``app`` publishes its ``nth`` message from now
    on, where kombu writes it (past the publish gate). Returns the ids of the messages whose
    publish was attempted, in order."""
    attempted: list[str] = []
    send = app.amqp.send_task_message

    def breaking(producer: Any, name: str, message: Any, **options: Any) -> Any:
        attempted.append(message.headers["id"])
        if len(attempted) == nth:
            producer.connection.connection.transport.sock.shutdown(socket.SHUT_RDWR)
        return send(producer, name, message, **options)

    monkeypatch.setattr(app.amqp, "send_task_message", breaking)
    return attempted


def _take_job_ids(app: Celery, queue: Queue) -> list[str]:
    """The ids of the jobs waiting in ``queue``, oldest first (taken off it)."""
    ids: list[str] = []
    with app.connection_for_read() as connection, connection.SimpleQueue(queue) as waiting:
        while True:
            try:
                message = waiting.get(timeout=1.0)
            except waiting.Empty:
                return ids
            ids.append(message.headers["id"])
            message.ack()


@dataclass
class Declaring:
    """An app whose two queues are bound to a topic exchange, and the queues it declared."""

    app: Celery
    names: list[str]
    job: Any
    declared: list[str]

    def queued(self, broker: Any) -> list[int]:
        return [sum(broker.llen(lst) for lst in queue_lists(name)) for name in self.names]


@pytest.fixture(params=["auto", False], ids=["one-script", "asked-first"])
def declaring(
    request: pytest.FixtureRequest, redis_url: str, broker: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Declaring]:
    names = [fresh_queue_name(), fresh_queue_name()]
    exchange = Exchange(f"declared-{uuid.uuid4().hex}", type="topic")
    app = redis_publisher(
        "batchdeclare",
        redis_url,
        task_queues=[Queue(name, exchange, routing_key=f"to.{name}") for name in names],
        task_default_queue=names[0],
        unique_colocated=request.param,
    )

    @app.task(base=UniqueTask, shared=False, name="batchdeclare.job", unique_key=lambda j: j.key)
    def job(key: str) -> None:
        return None

    declared: list[str] = []
    maybe_declare = Producer.maybe_declare

    def noting(self: Producer, entity: Any, *args: Any, **kwargs: Any) -> Any:
        declared.append(entity.name)
        return maybe_declare(self, entity, *args, **kwargs)

    monkeypatch.setattr(Producer, "maybe_declare", noting)
    yield Declaring(app, names, job, declared)
    unique_config.reset(app)
    app.close()
    broker.delete(*(lst for name in names for lst in queue_lists(name)))
    broker.delete(f"_kombu.binding.{exchange.name}")


def test_a_batch_declares_each_queue_once_and_every_message_lands(
    declaring: Declaring, broker: Any
) -> None:
    """Two queues first used by the batch: each is declared (its binding written) by its
    first message only, and every message reaches its queue."""
    names, job = declaring.names, declaring.job
    results = dispatch_many([job.s(f"k{n}").set(queue=names[n % 2]) for n in range(10)])
    assert len({result.id for result in results}) == 10
    assert sorted(declaring.declared) == sorted(names), "each queue declared by its first message"
    assert declaring.queued(broker) == [5, 5]


def test_a_unique_dispatch_declares_its_queue_once_per_connection(
    declaring: Declaring, broker: Any
) -> None:
    """kombu's cache of declared queues is asked first: a queue the connection declared is
    not declared again by every message, and one that reconnected declares again."""
    queue, job = declaring.names[1], declaring.job
    for n in range(3):
        assert job.apply_async((f"s{n}",), queue=queue).disposition is Disposition.CREATED
    assert declaring.declared == [queue]
    with declaring.app.producer_or_acquire() as producer:
        producer.connection.declared_entities.clear()  # what kombu does as it reconnects
    assert job.apply_async(("s3",), queue=queue).disposition is Disposition.CREATED
    assert declaring.declared == [queue, queue]
    assert declaring.queued(broker) == [0, 4]
