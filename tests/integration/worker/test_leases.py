"""A live worker renews its jobs' leases; keys are not lost while a job runs."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import WorkController

from celery_unique import Disposition, UniqueTask
from celery_unique.stores.redis import RedisStore

from .conftest import active_key, eventually

LEASE_S = 1


@pytest.fixture
def celery_config(celery_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The broker-parametrized settings with a one-second lease."""
    return {**celery_config, "unique_lease": LEASE_S}


@pytest.mark.parametrize("scope", ["active", "exists"])
def test_a_job_running_longer_than_its_lease_keeps_its_key(
    scope: str,
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
) -> None:
    """A job running three leases long still holds its key: the worker renews it."""
    marks = redis.Redis.from_url(redis_url)

    @celery_app.task(
        base=UniqueTask, name=f"leases.slow.{scope}", unique_key="slow", unique_while=scope
    )
    def slow() -> str:
        marks.set("slow:running", 1)
        time.sleep(LEASE_S * 3)
        return "done"

    celery_worker.reload()
    key = active_key(slow.name, "slow")
    first = slow.delay()
    eventually(lambda: redis_client.exists("slow:running"), what="the job to start")
    time.sleep(LEASE_S * 2)
    held = store.get(key)
    assert held is not None
    assert held.job_id == first.id
    assert slow.delay().disposition is Disposition.REUSED
    assert first.get(timeout=15) == "done"


def test_an_unrenewed_key_lapses_after_its_lease(
    celery_app: Celery, store: RedisStore, redis_client: Any
) -> None:
    """With no worker holding the job, nothing renews the key and it frees itself."""

    @celery_app.task(
        base=UniqueTask, name="leases.orphan", unique_key="orphan", unique_while="active"
    )
    def orphan() -> None:
        return None

    first = orphan.delay()
    assert orphan.delay().id == first.id
    eventually(
        lambda: store.get(active_key(orphan.name, "orphan")) is None, timeout=5, what="lease expiry"
    )
    assert orphan.delay().id != first.id
