"""Real workers on real brokers, with the uniqueness store on the real Redis.

``celery_config`` is parametrized over the broker: every test that takes the
``celery_app``/``celery_worker`` fixtures runs once on Redis and once on
RabbitMQ. The store is always Redis db 9 (``redis_url``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from celery import Celery

from celery_unique import config as unique_config
from celery_unique.keys import keyspace
from celery_unique.stores import cleanup
from celery_unique.stores.base import HeldKey
from celery_unique.stores.redis import RedisStore
from celery_unique.worker import fates
from tests.conftest import redis_celery_config
from tests.polling import eventually

NAMESPACE = "it"

__all__ = ["NAMESPACE", "active_key", "eventually", "holder", "settled"]


@pytest.fixture(params=["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def broker(request: pytest.FixtureRequest) -> str:
    """The broker of this run of the test."""
    return str(request.param)


@pytest.fixture
def celery_config(broker: str, request: pytest.FixtureRequest, redis_url: str) -> Mapping[str, Any]:
    """Celery settings for one broker, with the uniqueness store on Redis db 9."""
    settings = {
        **redis_celery_config(),
        "unique_backend": redis_url,
        "unique_namespace": NAMESPACE,
        "task_acks_late": False,
        "worker_prefetch_multiplier": 1,
    }
    if broker == "rabbitmq":
        settings["broker_url"] = request.getfixturevalue("rabbitmq_url")
    return settings


@pytest.fixture
def celery_worker_parameters() -> Mapping[str, Any]:
    """Skip the ping round trip; shut down quickly."""
    return {"perform_ping_check": False, "shutdown_timeout": 30}


@pytest.fixture
def store(redis_url: str, redis_client: Any) -> Iterator[RedisStore]:
    """The store the app and worker use, emptied before the test."""
    built = RedisStore.from_url(redis_url)
    yield built
    built.close()


@pytest.fixture(autouse=True)
def _fresh_runtime(celery_app: Celery) -> Iterator[None]:
    """Each test starts with an empty queue and an app runtime built from its own settings.

    Jobs a test leaves queued would otherwise reach the next test's worker first.
    """
    unique_config.reset(celery_app)
    _purge(celery_app)
    yield
    _purge(celery_app)
    unique_config.reset(celery_app)


def _purge(app: Celery) -> None:
    """Empty the app's queue, on a new connection if the broker dropped the first one."""
    for attempt in range(3):
        try:
            app.control.purge()
            return
        except OSError:
            if attempt == 2:
                raise
            time.sleep(1.0)


def active_key(task_name: str, key: str) -> str:
    """The storage key of an active key declared on ``task_name``."""
    return keyspace.storage_key(NAMESPACE, keyspace.ACTIVE, task_name, key)


def holder(store: RedisStore, key: str) -> HeldKey | None:
    return store.get(key)


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """``settled(job_id)`` waits until this process's worker decided what the end of a
    delivery of the job means for its keys, and sent every write that decision owed:
    whatever that delivery's end could do to the store is done."""
    decided: set[str] = set()
    check = fates.Fate.check

    def noting(fate: fates.Fate) -> None:
        check(fate)
        if fate.decided:
            decided.add(fate.job_id)

    monkeypatch.setattr(fates.Fate, "check", noting)

    def wait(job_id: str) -> None:
        eventually(lambda: job_id in decided, what=f"the end of job {job_id} to be decided")
        assert cleanup.flush(10), "the worker still owes writes"

    return wait
