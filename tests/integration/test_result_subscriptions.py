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
from celery import Celery
from celery.utils import uuid

from celery_unique import Disposition, UniqueTask, colocated
from celery_unique import config as unique_config
from celery_unique.config import runtime
from tests.conftest import redis_celery_config, redis_publisher
from tests.polling import eventually

from .test_races import queue_lists

pytestmark = pytest.mark.redis

DUPLICATES = 30


@pytest.fixture
def app(redis_url: str, broker: Any) -> Iterator[Celery]:
    """Store and broker on one Redis server, with the Redis result backend; no worker."""
    app = redis_publisher(
        "subscriptions",
        redis_url,
        result_backend=redis_celery_config()["result_backend"],
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


def test_duplicates_decided_as_their_message_leaves_leave_no_result_subscription(
    app: Celery, broker: Any
) -> None:
    """30 co-located duplicates, each of another held key: none stays subscribed."""

    @app.task(base=UniqueTask, shared=False, name="subscriptions.job", unique_key=lambda j: j.n)
    def job(n: int) -> None:
        pass

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
