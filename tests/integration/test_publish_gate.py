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
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chain, group, signals
from celery.exceptions import AlwaysEagerIgnored

from celery_unique import (
    Disposition,
    GroupMemberReused,
    UniquenessConflict,
    UniqueTask,
)
from celery_unique import config as unique_config
from tests.conftest import redis_publisher

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
