"""Where the store's script pushes a message, on a server store and broker share.

kombu decides where a message goes (the list of its queue, with the transport's
global key prefix, in the broker's database), that it goes nowhere (no queue
bound where it was routed), or that it publishes it itself (a fanout
exchange); the script must push it exactly there, or the store must decide the
dispatch alone and kombu publish after it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import pytest
import redis
from kombu import Exchange, Queue
from kombu.common import Broadcast

from celery_unique import Disposition, dispatch_many
from celery_unique import config as unique_config
from tests.faultproxy import FaultProxy
from tests.processes import RedisServer

from ._apps import Spec
from .conftest import job_key, producer, task_of
from .test_colocated import sent_by, warm, without_tag

pytestmark = pytest.mark.slow


def test_the_message_goes_to_the_queue_under_kombus_global_key_prefix(
    spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    """The script pushes to the prefixed list kombu's own publish writes, and the same
    bytes."""
    prefixed = replace(
        spec,
        settings={
            **spec.settings,
            "broker_transport_options": {"global_keyprefix": "pfx:"},
        },
    )
    broker, store = redis.Redis.from_url(services.url(1)), redis.Redis.from_url(services.url(0))
    with producer(prefixed) as app:
        task = task_of(app)
        warm(task)
        rt = unique_config.runtime(app)
        colocation = rt.colocation
        assert colocation, "store and broker share a server"
        broker.delete(f"pfx:{spec.queue}")
        written: list[list[bytes]] = []
        for path in (colocation, None):
            rt.colocation = path  # None: ask the store, then let kombu publish
            store.delete(job_key(spec, "k"))
            sent, commands = sent_by(
                proxy, lambda: task.apply_async((1,), unique_key="k", task_id="job-1")
            )
            assert sent.disposition is Disposition.CREATED
            assert commands == (["EVALSHA"] if path else ["EVALSHA", "LPUSH"])
            written.append(cast("list[bytes]", broker.lrange(f"pfx:{spec.queue}", 0, -1)))
            broker.delete(f"pfx:{spec.queue}")
        rt.colocation = colocation
    assert broker.exists(spec.queue) == 0, "a message went to the list kombu does not read"
    ours, kombus = written
    assert len(ours) == len(kombus) == 1
    assert without_tag(ours[0]) == without_tag(kombus[0])


def test_the_message_goes_to_the_brokers_database_zero(
    make_spec: Callable[..., Spec], proxy: FaultProxy, services: RedisServer
) -> None:
    """Store and broker both in database 0: the queue the script pushes to is database 0's."""
    spec = make_spec(broker_url=proxy.url(0), store_url=proxy.url(0))
    broker = redis.Redis.from_url(services.url(0))
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        assert unique_config.runtime(app).colocation, "store and broker share a server"
        queued = broker.llen(spec.queue)
        created, commands = sent_by(proxy, lambda: task.apply_async(unique_key="zero"))
        assert created.disposition is Disposition.CREATED
        assert commands == ["EVALSHA"]
        assert broker.llen(spec.queue) == queued + 1
        pushed = broker.lindex(spec.queue, 0)
        assert pushed is not None
        assert json.loads(pushed)["headers"]["id"] == created.id


def test_a_message_routed_to_no_queue_is_still_decided_by_the_store(
    make_spec: Callable[..., Spec],
    proxy: FaultProxy,
    services: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kombu drops a message no queue is bound for, so no push carries the decision: the
    store decides the dispatch on its own, as the job leaves (never reported as a job
    that bypassed the gate), its key is held, and no list gets a message."""
    exchange = Exchange("routed", type="direct")
    spec = make_spec(
        broker_url=proxy.url(1),
        store_url=proxy.url(0),
        settings={"task_queues": [Queue("bound", exchange, routing_key="rk.bound")]},
    )
    broker, store = redis.Redis.from_url(services.url(1)), redis.Redis.from_url(services.url(0))
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        task.apply_async(unique_key="declare", queue="bound")  # declares the binding
        queued = broker.llen("bound")
        created, commands = sent_by(
            proxy,
            lambda: task.apply_async(
                unique_key="nowhere", exchange="routed", routing_key="rk.none"
            ),
        )
        assert created.disposition is Disposition.CREATED
        assert commands.count("EVALSHA") == 1, commands
        assert "LPUSH" not in commands, commands
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        held = store.get(job_key(spec, "nowhere"))
        assert held is not None, "the store was never asked"
        assert created.id.encode() in held
        assert broker.llen("bound") == queued
        again = task.apply_async(unique_key="nowhere", exchange="routed", routing_key="rk.none")
        assert again.disposition is Disposition.REUSED
        assert again.id == created.id


def fanout_spec(make_spec: Callable[..., Spec], proxy: FaultProxy) -> Spec:
    return make_spec(
        broker_url=proxy.url(1),
        store_url=proxy.url(0),
        settings={"task_queues": [Queue("plain-q"), Broadcast("everyone")]},
    )


def declare_fanout(app: Any) -> None:
    """kombu keeps exchange types in the process, per connection: without ``everyone``
    declared on the producer's own, kombu routes its messages as a direct exchange's."""
    with app.producer_or_acquire() as publisher:
        Broadcast("everyone")(publisher.channel).declare()


def test_a_fanout_message_is_published_by_kombu_after_the_decision_or_alone(
    make_spec: Callable[..., Spec], proxy: FaultProxy, services: RedisServer
) -> None:
    spec, store = fanout_spec(make_spec, proxy), redis.Redis.from_url(services.url(0))
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        declare_fanout(app)
        created, commands = sent_by(
            proxy, lambda: task.apply_async(unique_key="fan", queue="everyone")
        )
        assert created.disposition is Disposition.CREATED
        assert commands == ["EVALSHA", "PUBLISH"]
        held = store.get(job_key(spec, "fan"))
        assert held is not None
        assert created.id.encode() in held
        reused, commands = sent_by(
            proxy, lambda: task.apply_async(unique_key="fan", queue="everyone")
        )
        assert reused.disposition is Disposition.REUSED
        assert commands == ["EVALSHA"], "a duplicate publishes nothing"
        _, commands = sent_by(proxy, lambda: task.apply_async(queue="everyone"))
        assert commands == ["PUBLISH"], "a job without uniqueness is kombu's alone"


def test_a_batch_with_a_fanout_message_asks_first_and_kombu_publishes_it(
    make_spec: Callable[..., Spec], proxy: FaultProxy, services: RedisServer
) -> None:
    """kombu must publish a fanout message itself: the batch cannot travel with its
    decisions, so the store decides it first, and kombu publishes what it created."""
    spec, broker = fanout_spec(make_spec, proxy), redis.Redis.from_url(services.url(1))
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        declare_fanout(app)
        task.apply_async(unique_key="declare", queue="plain-q")
        queued = broker.llen("plain-q")
        items = [
            task.s().set(unique_key="b0", queue="plain-q"),
            task.s().set(unique_key="b1", queue="everyone"),
        ]
        results, commands = sent_by(proxy, lambda: dispatch_many(items))
        assert [r.disposition for r in results] == [Disposition.CREATED] * 2
        assert commands[0] == "EVALSHA", commands
        assert commands.count("EVALSHA") == 1, commands
        assert {"LPUSH", "PUBLISH"} <= set(commands), commands
        assert broker.llen("plain-q") == queued + 1
        again, commands = sent_by(proxy, lambda: dispatch_many(items))
        assert [r.disposition for r in again] == [Disposition.REUSED] * 2
        assert not {"LPUSH", "PUBLISH"} & set(commands), commands
        assert broker.llen("plain-q") == queued + 1
