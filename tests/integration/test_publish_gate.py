"""Nothing reaches the broker, or runs eagerly, unless the store said "created", on every path.

The app publishes to a queue no worker consumes on the real Redis broker, so
the queue's lists hold exactly what was published; the store is the real
Redis. Each way of dispatching (``producer=``, ``connection=``,
``send_task``, a group, a chain, eager mode, ``.apply()``) is tried with a
key already held: the receipt says REUSED and the queue does not grow (or the
body does not run), and ``before_task_publish`` never hears of the message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest
from celery import Celery, chain, group, signals
from celery.exceptions import AlwaysEagerIgnored
from kombu import Exchange, Producer, Queue

from celery_unique import (
    Disposition,
    GroupMemberReused,
    UniquenessConflict,
    UniqueTask,
    dispatch_many,
)
from celery_unique import config as unique_config
from celery_unique.keys.keyspace import ACTIVE, storage_key
from tests.conftest import fresh_queue_name, redis_publisher

from .test_races import queue_lists

pytestmark = pytest.mark.redis


@pytest.fixture
def app(redis_url: str, broker: Any) -> Iterator[Celery]:
    """A real Redis store and broker; its queue has no consumer."""
    app = redis_publisher("gate", redis_url)
    app.finalize()
    yield app
    unique_config.reset(app)
    app.close()
    queue = app.conf.task_default_queue
    broker.delete(*queue_lists(queue), f"_kombu.binding.{queue}")


@pytest.fixture
def announced() -> Iterator[list[str]]:
    """Job ids ``before_task_publish`` announced (it fires only for messages that go out)."""
    ids: list[str] = []

    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        ids.append((headers or {}).get("id", ""))

    signals.before_task_publish.connect(record, weak=False, dispatch_uid="test.gate")
    yield ids
    signals.before_task_publish.disconnect(dispatch_uid="test.gate")


@pytest.fixture
def ran() -> list[int]:
    return []


@pytest.fixture
def job(app: Celery, ran: list[int]) -> Any:
    @app.task(
        base=UniqueTask,
        shared=False,
        name="gate.job",
        unique_key=lambda job: f"tenant:{job.tenant}",
        unique_while="active",
    )
    def job(tenant: int, note: str = "") -> None:
        ran.append(tenant)

    return job


def queued(app: Celery, broker: Any) -> int:
    return sum(broker.llen(name) for name in queue_lists(app.conf.task_default_queue))


def test_given_producer_publishes_only_created_jobs(
    app: Celery, broker: Any, job: Any, announced: list[str]
) -> None:
    """``producer=``: the reused dispatch touches the producer's queue not at all."""
    with app.producer_or_acquire() as producer:
        first = job.apply_async((1,), producer=producer)
        second = job.apply_async((1,), producer=producer)
    assert (first.disposition, second.disposition) == (Disposition.CREATED, Disposition.REUSED)
    assert second.id == first.id
    assert queued(app, broker) == 1
    assert announced == [first.id]


def test_given_connection_publishes_only_created_jobs(
    app: Celery, broker: Any, job: Any, announced: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """``connection=``: Celery builds a producer of its own, and the gate still holds."""
    with caplog.at_level(logging.ERROR, logger="celery_unique"), app.connection_for_write() as conn:
        first = job.apply_async((2,), connection=conn)
        second = job.apply_async((2,), connection=conn)
    assert (first.disposition, second.disposition) == (Disposition.CREATED, Disposition.REUSED)
    assert queued(app, broker) == 1
    assert announced == [first.id]
    assert not [r for r in caplog.records if "without passing the uniqueness gate" in r.message]


def test_send_task_of_a_declared_unique_task_is_decided_like_delay(
    app: Celery, broker: Any, job: Any, announced: list[str]
) -> None:
    """``app.send_task(name)`` of a task declaring a key applies it: one message, a receipt."""
    first = app.send_task(job.name, (3,))
    second = app.send_task(job.name, (3,), kwargs={"note": "again"})
    assert (first.disposition, second.disposition) == (Disposition.CREATED, Disposition.REUSED)
    assert second.id == first.id
    assert queued(app, broker) == 1
    assert announced == [first.id]


def test_send_task_keeps_its_own_semantics_in_eager_mode(
    app: Celery, broker: Any, job: Any, ran: list[int]
) -> None:
    """Celery's send_task never runs eagerly; with uniqueness it still publishes, decided."""
    app.conf.task_always_eager = True
    with pytest.warns(AlwaysEagerIgnored):
        first = app.send_task(job.name, (4,))
    with pytest.warns(AlwaysEagerIgnored):
        second = app.send_task(job.name, (4,))
    assert (first.disposition, second.disposition) == (Disposition.CREATED, Disposition.REUSED)
    assert ran == []
    assert queued(app, broker) == 1


def test_a_group_publishes_one_member_per_key(
    app: Celery, broker: Any, job: Any, announced: list[str]
) -> None:
    """Group members deduplicate one by one: the second member is reused, not published."""
    with pytest.warns(GroupMemberReused):
        group(job.s(5), job.s(5), job.s(6)).apply_async()
    assert queued(app, broker) == 2
    assert len(announced) == 2


def test_a_chain_whose_first_step_is_held_publishes_nothing(
    app: Celery, broker: Any, job: Any, announced: list[str]
) -> None:
    """A chain's first step goes through the gate: a held key means no message at all."""
    held = job.delay(7)
    before = queued(app, broker)
    with pytest.warns(UserWarning, match="not attached"):
        result = chain(job.si(7, note="chained"), job.si(8)).apply_async()
    assert queued(app, broker) == before
    assert announced == [held.id]
    assert result.parent is None or result.parent.id == held.id or result.id != held.id


def test_eager_mode_never_runs_a_reused_or_refused_job(
    app: Celery, broker: Any, job: Any, ran: list[int]
) -> None:
    """``task_always_eager``: a reused dispatch returns the holder without running the body."""

    @app.task(
        base=UniqueTask,
        shared=False,
        name="gate.order",
        unique_window_key=lambda job: job.request_id,
        unique_window=60,
    )
    def order(request_id: str, amount: int) -> None:
        ran.append(amount)

    held = job.delay(9)  # published: the key is held by a job that waits in the queue
    app.conf.task_always_eager = True
    reused = job.delay(9, note="eager")
    assert (reused.disposition, reused.id) == (Disposition.REUSED, held.id)
    first = order.delay("R-1", 10)
    with pytest.raises(UniquenessConflict):
        order.delay("R-1", 11)
    again = order.delay("R-1", 10)
    assert (again.disposition, again.id) == (Disposition.REUSED, first.id)
    assert ran == [10], "only the created eager job ran"
    assert queued(app, broker) == 1


def test_apply_never_runs_a_reused_job(app: Celery, broker: Any, job: Any, ran: list[int]) -> None:
    """``.apply()`` decides first: a held key returns the holder, the body does not run."""
    held = job.delay(12)
    result = job.apply((12,))
    assert (result.disposition, result.id) == (Disposition.REUSED, held.id)
    assert ran == []
    created = job.apply((13,))
    assert created.disposition is Disposition.CREATED
    assert ran == [13]


@pytest.fixture
def lasting(redis_url: str, broker: Any) -> Iterator[Celery]:
    """As ``app``, on a queue kombu does not expire: where store and broker share a
    server, a created job's message travels with the store's decision (kombu sends a
    queue it expires itself, after asking the store)."""
    name = fresh_queue_name()
    queue = Queue(name, Exchange(name, type="direct", durable=False), routing_key=name)
    app = redis_publisher("lasting", redis_url, queue=name, task_queues=(queue,))
    app.finalize()
    yield app
    unique_config.reset(app)
    app.close()
    broker.delete(*queue_lists(name), f"_kombu.binding.{name}")


#: Every way a unique job leaves, and whether the store is asked before its message is
#: built (``True``) or as the message leaves, in the script that enqueues it (``False``).
WAYS = {
    "asked-first": True,
    "colocated": False,
    "held-recently": True,
    "send_task": False,
    "batch-asked-first": True,
    "batch-colocated": False,
}


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize(
    "interruption", [KeyboardInterrupt, gevent.Timeout], ids=["KeyboardInterrupt", "gevent.Timeout"]
)
def test_a_publish_interrupted_by_a_base_exception_frees_the_key(
    lasting: Celery,
    broker: Any,
    way: str,
    interruption: type[BaseException],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C or gevent's ``Timeout`` raised by kombu's publish, on every way a job
    leaves, reaches the caller as it was raised, and the key reserved for the job that
    never left is free again: no message, no key, and the next dispatch creates."""
    app = lasting

    @app.task(base=UniqueTask, shared=False, name="gate.interrupted", unique_key=lambda j: j.key)
    def job(key: str) -> None:
        return None

    if way.endswith("asked-first"):
        app.conf.unique_colocated = False
    rt = unique_config.runtime(app)
    keys = [storage_key(rt.namespace, ACTIVE, job.name, key) for key in ("k1", "k2")]
    if way == "held-recently":
        # A key this process found held is asked for before the message is built.
        job.delay("k1")
        assert job.delay("k1").disposition is Disposition.REUSED
        rt.store.delete(keys[0])
    batch = way.startswith("batch")
    before = queued(app, broker)
    raised = interruption()
    #: The holder of each key, as the store had it when kombu was asked to publish.
    seen: list[list[str | None]] = []
    publish = Producer.publish

    def interrupted(self: Producer, *args: Any, **kwargs: Any) -> Any:
        seen.append([held.job_id if (held := rt.store.get(key)) else None for key in keys])
        if len(seen) == (2 if batch else 1):
            raise raised
        return publish(self, *args, **kwargs)

    monkeypatch.setattr(Producer, "publish", interrupted)
    send: dict[str, Callable[[], Any]] = {
        "send_task": lambda: app.send_task(job.name, ("k1",)),
        "batch-asked-first": lambda: dispatch_many([job.s("k1"), job.s("k2")]),
        "batch-colocated": lambda: dispatch_many([job.s("k1"), job.s("k2")]),
    }
    with pytest.raises(interruption) as caught:
        send.get(way, lambda: job.delay("k1"))()
    monkeypatch.undo()

    assert caught.value is raised
    # The path was the one named: store and broker share a server unless told not to;
    # asked first, the store held the keys as kombu began to publish (taken back since);
    # else the decision was to travel with the message, and nothing was held yet.
    assert bool(rt.colocation) is not way.endswith("asked-first")
    held_then = seen[-1][: 2 if batch else 1]
    assert all(held_then) if WAYS[way] else not any(held_then), seen
    assert [rt.store.get(key) for key in keys] == [None, None]
    assert queued(app, broker) == before
    assert job.delay("k1").disposition is Disposition.CREATED
    assert queued(app, broker) == before + 1
