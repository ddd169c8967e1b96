"""The broker stopped when a dispatch publishes: the key reserved for it is given back.

The broker is a ``redis-server`` of the test's own; the store stays up. The
producer is told not to retry a publish, so it fails at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kombu.exceptions import OperationalError

from celery_unique import Disposition
from celery_unique.keys import keyspace

from ._apps import JOB, Spec
from .conftest import RedisServer, job_key, open_store, producer, queue_length, task_of

FAIL_FAST = {
    "broker_connection_retry": False,
    "broker_connection_max_retries": 1,
    "task_publish_retry_policy": {"max_retries": 1, "interval_start": 0, "interval_step": 0.1},
}

#: Per-dispatch options of each kind of key, and the storage key they reserve.
KEYS: dict[str, dict[str, Any]] = {
    "queued": {"unique_key": "k", "unique_while": "queued"},
    "active": {"unique_key": "k", "unique_while": "active"},
    "exists": {"unique_key": "k", "unique_while": "exists"},
    "window": {"unique_window_key": "k", "unique_window": 600},
}


def reserved_key(spec: Spec, kind: str) -> str:
    if kind == "window":
        return keyspace.storage_key(spec.namespace, keyspace.WINDOW, JOB, "k")
    return job_key(spec, "k")


@pytest.mark.parametrize("kind", list(KEYS))
def test_broker_down_at_publish_rolls_the_reservation_back(
    kind: str, make_spec: Callable[..., Spec], redis_server: Callable[[], RedisServer]
) -> None:
    """The publish raises and the key is free; once the broker is back, a new job is created."""
    broker = redis_server()
    spec = make_spec(broker_url=broker.url(), settings=FAIL_FAST)
    key = reserved_key(spec, kind)
    with producer(spec) as app, open_store(spec.store_url) as store:
        job = task_of(app)
        # A first publish opens the producer's broker connection before the broker goes.
        assert job.apply_async(unique_key="warm-up").disposition is Disposition.CREATED
        broker.stop()

        with pytest.raises(OperationalError):
            job.apply_async(**KEYS[kind])
        assert store.get(key) is None

        broker.start()
        created = job.apply_async(**KEYS[kind])
        assert created.disposition is Disposition.CREATED
        held = store.get(key)
        assert held is not None
        assert held.job_id == created.id
        assert queue_length(spec) == 1  # the new broker holds that job and nothing else
