"""A job that is not published leaves nothing registered in the producer's result backend.

Celery's Redis result backend subscribes to a job's result channel as it sends
the message. Where the store and the broker share a Redis server, the store
decides as the message leaves, after that subscription: a duplicate, never
published, must not keep one (a process dispatching duplicates would gather
them without end).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals
from celery.utils import uuid
from kombu import Exchange, Queue

from celery_unique import (
    Disposition,
    UniquenessConflict,
    UniqueTask,
    dispatch_many,
)
from celery_unique import config as unique_config
from celery_unique.config import runtime
from celery_unique.dispatch import colocated
from tests.conftest import redis_celery_config, redis_publisher
from tests.polling import eventually

from .test_races import queue_lists

pytestmark = pytest.mark.redis

DUPLICATES = 30


@pytest.fixture(params=["plain", "expiring"], ids=["queue", "expiring-queue"])
def app(request: pytest.FixtureRequest, redis_url: str, broker: Any) -> Iterator[Celery]:
    """Store and broker on one Redis server, with the Redis result backend; no worker.

    A batch's messages travel with its decisions to a plain queue; to a queue that
    expires (kombu must send those itself) the batch asks the store first, after
    building its first message."""
    settings = redis_celery_config()
    if request.param == "plain":
        name = settings["task_default_queue"]
        settings["task_queues"] = [Queue(name, Exchange(name), routing_key=name)]
    app = redis_publisher(
        "subscriptions",
        redis_url,
        queue=settings["task_default_queue"],
        task_queues=settings["task_queues"],
        result_backend=settings["result_backend"],
        task_ignore_result=False,
    )
    app.finalize()
    yield app
    unique_config.reset(app)
    app.close()
    queue = app.conf.task_default_queue
    broker.delete(*queue_lists(queue), f"_kombu.binding.{queue}")


def subscribers(client: Any, job_ids: list[str]) -> int:
    """How many subscriptions the server counts on the result channels of ``job_ids``."""
    channels = [f"celery-task-meta-{job_id}" for job_id in job_ids]
    return sum(count for _, count in client.pubsub_numsub(*channels))


def define(app: Celery) -> tuple[Any, Any]:
    """A task keyed by ``n`` while queued, and one keyed by a request id for a minute."""

    @app.task(base=UniqueTask, shared=False, name="subscriptions.job", unique_key=lambda j: j.n)
    def job(n: str) -> None:
        pass

    @app.task(
        base=UniqueTask,
        shared=False,
        name="subscriptions.order",
        unique_window_key=lambda j: j.rid,
        unique_window=60,
    )
    def order(rid: str, amount: int) -> None:
        pass

    return job, order


def test_duplicates_decided_as_their_message_leaves_leave_no_result_subscription(
    app: Celery, broker: Any
) -> None:
    """30 co-located duplicates, each of another held key: none stays subscribed."""
    job, _ = define(app)
    assert colocated.suits(app, runtime(app))
    holders = [job.apply_async((str(n),)) for n in range(DUPLICATES)]
    assert {holder.disposition for holder in holders} == {Disposition.CREATED}
    consumer = app.backend.result_consumer
    # Published jobs are subscribed to: the count below is not empty by accident.
    held = [holder.id for holder in holders]
    eventually(lambda: subscribers(broker, held) == DUPLICATES, what="subscriptions")

    candidates = [uuid() for _ in range(DUPLICATES)]
    for n, candidate in enumerate(candidates):
        duplicate = job.apply_async((str(n),), task_id=candidate)
        assert (duplicate.disposition, duplicate.id) == (Disposition.REUSED, holders[n].id)
    eventually(lambda: subscribers(broker, candidates) == 0, what="no subscription left")
    assert not {consumer._get_key_for_task(c) for c in candidates} & consumer.subscribed_to


def test_a_batch_decided_as_its_messages_leave_keeps_only_published_subscriptions(
    app: Celery, broker: Any
) -> None:
    """dispatch_many builds every message before the store decides: the duplicates' and
    (all or nothing) a refused batch's jobs are subscribed to no more."""
    job, order = define(app)
    assert colocated.suits_batch(app, runtime(app))
    holders = [job.apply_async((str(n),)) for n in range(DUPLICATES)]
    fresh = [uuid() for _ in range(DUPLICATES)]
    duplicates = [uuid() for _ in range(DUPLICATES)]
    results = dispatch_many(
        [job.s(f"new{n}").set(task_id=fresh[n]) for n in range(DUPLICATES)]
        + [job.s(str(n)).set(task_id=duplicates[n]) for n in range(DUPLICATES)]
    )
    assert [r.id for r in results] == fresh + [h.id for h in holders]
    eventually(lambda: subscribers(broker, duplicates) == 0, what="no duplicate subscribed")
    eventually(lambda: subscribers(broker, fresh) == DUPLICATES, what="created ones subscribed")

    order.delay("r1", 10)
    refused = [uuid() for _ in range(3)]
    with pytest.raises(UniquenessConflict):
        dispatch_many(
            [
                job.s("other").set(task_id=refused[0]),
                job.s("0").set(task_id=refused[1]),
                order.s("r1", 11).set(task_id=refused[2]),
            ]
        )
    eventually(lambda: subscribers(broker, refused) == 0, what="no refused job subscribed")


def test_a_dispatch_under_the_id_of_the_job_it_meets_keeps_that_jobs_subscription(
    app: Celery, broker: Any
) -> None:
    """A caller's retry under the holder's own id is handed that job: the result this
    process waits for is still the holder's, and stays subscribed."""
    job, _ = define(app)
    holder = job.apply_async(("mine",))
    again = job.apply_async(("mine",), task_id=holder.id)
    assert (again.disposition, again.id) == (Disposition.REUSED, holder.id)
    consumer = app.backend.result_consumer
    assert consumer._get_key_for_task(holder.id) in consumer.subscribed_to
    eventually(lambda: subscribers(broker, [holder.id]) == 1, what="the holder subscribed")


def test_a_created_job_whose_publish_failed_leaves_no_subscription(
    app: Celery, broker: Any
) -> None:
    """Celery subscribes to a job's result just before its message leaves: a publish that
    fails there leaves a job that will never run, and nothing to wait for."""
    job, _ = define(app)
    failing = uuid()

    def fail(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if (headers or {}).get("id") == failing:
            raise KeyboardInterrupt

    signals.before_task_publish.connect(fail, weak=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            job.apply_async(("failing",), task_id=failing)
    finally:
        signals.before_task_publish.disconnect(fail)
    consumer = app.backend.result_consumer
    assert consumer._get_key_for_task(failing) not in consumer.subscribed_to
    created = job.apply_async(("failing",))
    assert created.disposition is Disposition.CREATED, "its key was freed"
    eventually(lambda: subscribers(broker, [created.id]) == 1, what="the next job subscribed")
    assert subscribers(broker, [failing]) == 0
