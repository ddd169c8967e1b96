"""``dispatch_many`` with store and broker on one Redis server: one script call in all.

Every item's message is built first; one script decides the batch and pushes
the messages of the jobs it created, in order. What lands in the broker is
compared with what kombu's own publish batch writes for the same items (a lost
reply is tested beside one dispatch's, in ``test_colocated``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import signals
from kombu import Queue

from celery_unique import BackendUnavailable, Disposition, UniquenessConflict, dispatch_many
from tests.faultproxy import FaultProxy
from tests.processes import RedisServer

from ._apps import Spec
from .conftest import eventually, job_key, producer, task_of
from .test_colocated import (
    broker_of,
    new_messages,
    random_options,
    routed,
    same_lists,
    sent_by,
    warm,
)

pytestmark = pytest.mark.slow


def keyed(task: Any, key: str, *args: Any, **options: Any) -> Any:
    return task.s(*args).set(unique_key=key, unique_while="active", **options)


def test_a_batch_is_one_script_call_in_all(
    spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    """Created jobs, duplicates (of a held key, of an earlier item) and an item without
    uniqueness: one EVALSHA, and exactly the published items' messages, in order."""
    broker = broker_of(services)
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        held = task.apply_async(unique_key="held", unique_while="active")
        queued = broker.llen(spec.queue)
        items = [keyed(task, f"b{n}") for n in range(40)]
        items.insert(10, keyed(task, "held"))
        items.insert(20, keyed(task, "b3"))
        items.insert(30, task.s())
        results, commands = sent_by(proxy, lambda: dispatch_many(items))
        assert commands == ["EVALSHA"], "the decisions carried the messages"
        assert results[10].disposition is Disposition.REUSED
        assert results[10].id == held.id
        assert results[20].disposition is Disposition.REUSED
        assert results[20].id == results[3].id
        published = [r for n, r in enumerate(results) if n not in (10, 20)]
        assert all(r.disposition is Disposition.CREATED for r in published)
        sent = new_messages(broker, spec.queue, queued)
        assert [m["headers"]["id"] for m in sent] == [r.id for r in published]
        store = redis.Redis.from_url(services.url(0))
        assert store.get(job_key(spec, "b39")) is not None


def test_a_batch_too_large_for_one_script_is_decided_in_parts_then_published(
    spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    """1,500 items: more than one script takes, so the parts are decided first (two
    scripts, each seeing the one before) and kombu publishes the created jobs' messages
    after: a part's messages could not be taken back if a later part were refused."""
    broker = broker_of(services)
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        queued = broker.llen(spec.queue)
        items = [keyed(task, f"p{n}") for n in range(1_500)]
        items[1_200] = keyed(task, "p7")  # repeats an item of the first part
        results, commands = sent_by(proxy, lambda: dispatch_many(items))
        assert commands.count("EVALSHA") == 2
        assert results[1_200].disposition is Disposition.REUSED
        assert results[1_200].id == results[7].id
        sent = new_messages(broker, spec.queue, queued)
        assert [m["headers"]["id"] for m in sent] == [
            r.id for n, r in enumerate(results) if n != 1_200
        ]


def test_a_conflict_writes_and_pushes_nothing_unless_told_to_go_on(
    spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    broker, store = broker_of(services), redis.Redis.from_url(services.url(0))
    window = {"unique_window_key": "order-1", "unique_window": 60}
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        first = task.apply_async((0.0,), **window)
        queued = broker.llen(spec.queue)
        items = [keyed(task, "c0"), task.s(1.0).set(**window), keyed(task, "c2")]
        with pytest.raises(UniquenessConflict) as conflict:
            sent_by(proxy, lambda: dispatch_many(items))
        assert conflict.value.index == 1
        assert conflict.value.conflicting_job_id == first.id
        assert broker.llen(spec.queue) == queued, "a failed batch published nothing"
        assert store.get(job_key(spec, "c0")) is None, "a failed batch held a key"
        results, commands = sent_by(proxy, lambda: dispatch_many(items, continue_on_conflict=True))
        assert commands == ["EVALSHA"]
        assert isinstance(results[1], UniquenessConflict)
        sent = new_messages(broker, spec.queue, queued)
        assert [m["headers"]["id"] for m in sent] == [results[0].id, results[2].id]


def test_batch_messages_are_byte_for_byte_what_kombus_batch_writes(
    spec: Spec, services: RedisServer
) -> None:
    """Randomized batches through both paths land identically, list by list, in order."""
    rng = random.Random(20261203)
    with routed(spec, services) as bench:
        compared = 0
        for batch in range(40):
            options = [random_options(rng, n, bench.queues) for n in range(25)]

            def dispatch(batch: int = batch, options: list[dict[str, Any]] = options) -> None:
                bench.store.delete(*(job_key(spec, f"k{batch}-{n}") for n in range(25)))
                items = [
                    keyed(bench.task, f"k{batch}-{n}", task_id=f"job-{batch}-{n}", **opts)
                    if n % 5
                    else bench.task.s(n, "é").set(task_id=f"job-{batch}-{n}", **opts)
                    for n, opts in enumerate(options)
                ]
                assert all(r.disposition is Disposition.CREATED for r in dispatch_many(items))

            compared += same_lists(*bench.written(dispatch))
        assert compared > 700, compared


def test_a_batch_asks_first_where_it_cannot_be_exact(
    make_spec: Any, proxy: FaultProxy, services: RedisServer
) -> None:
    """An item for a queue kombu expires (it sends more than the message), a foreign
    after_task_publish receiver, task-sent events: the store is asked first and kombu
    publishes the batch; the results are the same."""
    spec = make_spec(
        broker_url=proxy.url(1),
        store_url=proxy.url(0),
        settings={"task_queues": [Queue("plain-q"), Queue("expiring", expires=600.0)]},
    )
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        for queue in ("plain-q", "expiring"):  # a first publish declares its queue
            task.apply_async(unique_key=f"declare-{queue}", queue=queue)

        def batch(tag: str, **options: Any) -> list[str]:
            items = [keyed(task, f"{tag}{n}", queue="plain-q") for n in range(3)]
            items.append(keyed(task, f"{tag}-last", **options))
            results, commands = sent_by(proxy, lambda: dispatch_many(items))
            assert all(r.disposition is Disposition.CREATED for r in results)
            return commands

        assert batch("one") == ["EVALSHA"]
        commands = batch("expiring", queue="expiring")
        assert commands[0] == "EVALSHA", commands
        assert "PEXPIRE" in commands, commands
        seen: list[str] = []

        def foreign(sender: Any = None, headers: Any = None, **_: Any) -> None:
            seen.append(headers["id"])

        signals.after_task_publish.connect(foreign, weak=False, dispatch_uid="test.after")
        try:
            commands = batch("after")
            assert commands[0] == "EVALSHA", commands
            assert "LPUSH" in commands, commands
            assert len(seen) == 4, "the signal fired once per published job"
        finally:
            signals.after_task_publish.disconnect(dispatch_uid="test.after")
        app.conf.task_send_sent_event = True
        commands = batch("events")
        assert commands[0] == "EVALSHA", commands
        assert "LPUSH" in commands, commands


def test_a_push_the_server_refuses_leaves_no_message_and_no_key(
    spec: Spec, services: RedisServer
) -> None:
    """A later item's queue is not a list: the script refuses before its first push."""
    broker, store = broker_of(services), redis.Redis.from_url(services.url(0))
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        odd = f"{spec.queue}-odd"
        task.apply_async(unique_key="declare-odd", queue=odd)  # declared once per process
        broker.delete(odd)
        broker.set(odd, "not a list")
        queued = broker.llen(spec.queue)
        with pytest.raises(BackendUnavailable, match="WRONGTYPE"):
            dispatch_many([keyed(task, "r0"), keyed(task, "r1", queue=odd)])
        assert broker.llen(spec.queue) == queued, "a message went out without its key"
        assert store.get(job_key(spec, "r0")) is None
        broker.delete(odd)


def test_a_worker_runs_every_job_the_batch_script_enqueued(
    spec: Spec, start_worker: Callable[..., Any], services: RedisServer
) -> None:
    """A real prefork worker consumes the batch's messages and frees every key at the end."""
    store = redis.Redis.from_url(services.url(0))
    keys = [f"ran{n}" for n in range(10)]
    with producer(spec) as app:
        task = task_of(app)
        results = dispatch_many([keyed(task, key) for key in keys])
        assert all(r.disposition is Disposition.CREATED for r in results)
        assert all(store.get(job_key(spec, key)) is not None for key in keys)
        start_worker(spec)
        eventually(
            lambda: all(store.get(job_key(spec, key)) is None for key in keys),
            30.0,
            "every job to run and end",
        )
