"""celery_unique.testing: the store swap, held keys by display name, waiting for a release."""

from __future__ import annotations

import pickle
import threading

import pytest
from celery import Celery

from celery_unique import UniqueTask, testing
from celery_unique.stores.base import KeyKind, Store


def test_held_keys_are_display_names_carrying_their_records(
    app: Celery, unique_store: Store
) -> None:
    """``held_keys()`` reads as ``task:key`` (a shared key bare), never a storage key."""

    @app.task(shared=False, base=UniqueTask, unique_key=lambda job: f"customer:{job.name}")
    def recalc(name: str) -> None: ...

    @app.task(shared=False, base=UniqueTask, unique_key="nightly", unique_prefix=False)
    def nightly() -> None: ...

    first, job = recalc.delay("ada"), nightly.delay()
    assert testing.held_keys() == ["nightly", f"{recalc.name}:customer:ada"]
    assert testing.held_keys(app) == testing.held_keys()
    shared, scoped = testing.held_keys()
    assert (scoped.job_id, scoped.kind, scoped.task) == (first.id, KeyKind.ACTIVE, recalc.name)
    assert shared.job_id == job.id
    assert "\x1f" in scoped.storage_key
    assert "\x1f" not in scoped
    assert [held.job_id for held in testing.held_keys(kind=KeyKind.WINDOW)] == []


def test_unique_store_with_a_memory_broker_puts_the_broker_back(app: Celery) -> None:
    """``broker="memory://"`` moves the broker and results for the block only."""
    app.conf.update(broker_url="redis://127.0.0.1:1/0", result_backend="redis://127.0.0.1:1/1")
    with testing.unique_store(app, broker="memory://"):
        assert app.pool.connection.transport.driver_type == "memory"
        assert type(app.backend).__name__ == "CacheBackend"
    assert (app.pool.connection.transport_cls, app.pool.connection.port) == ("redis", 1)
    assert type(app.backend).__name__ == "RedisBackend"
    assert (app.conf.broker_url, app.conf.result_backend) == (
        "redis://127.0.0.1:1/0",
        "redis://127.0.0.1:1/1",
    )


def test_wait_released_returns_once_the_key_is_released(app: Celery, unique_store: Store) -> None:
    """It waits for the release (here by another thread, as a worker would release)."""

    @app.task(shared=False, base=UniqueTask, unique_key="k", unique_while="active")
    def job() -> None: ...

    queued = job.delay()
    (held,) = testing.held_keys()
    releaser = threading.Timer(0.1, unique_store.release, (queued.id, held.storage_key))
    releaser.start()
    try:
        testing.wait_released(queued, timeout=10)
    finally:
        releaser.join()
    assert testing.held_keys() == []


def test_wait_released_names_the_keys_still_held(app: Celery, unique_store: Store) -> None:
    """A job that keeps its key past the timeout: TimeoutError with its display key."""

    @app.task(shared=False, base=UniqueTask, unique_key="k", unique_while="active")
    def job() -> None: ...

    queued = job.delay()
    with pytest.raises(TimeoutError, match=f"{job.name}:k"):
        testing.wait_released(queued.id, timeout=0.05)


def test_unique_eager_keeps_an_exists_key_and_wait_released_accepts_it(
    app: Celery, unique_eager: Store
) -> None:
    """An ``exists`` key kept after its job finished is released as far as waiting goes."""

    @app.task(
        shared=False, base=UniqueTask, unique_key="k", unique_while="exists", unique_retention=60
    )
    def job() -> str:
        return "ran"

    done = job.delay()
    testing.wait_released(done, timeout=1)
    assert [held.finished for held in testing.held_keys()] == [True]


def test_held_keys_keep_the_record_fields_older_code_read(app: Celery, unique_store: Store) -> None:
    """``.key`` is still the storage key and every record field reads through; copies too."""

    @app.task(shared=False, base=UniqueTask, unique_key="k", unique_while="active")
    def job() -> None: ...

    job.delay()
    (held,) = testing.held_keys()
    assert held.key == held.storage_key == held.held.key
    assert (held.scope, held.expires_in_ms) == (held.held.scope, held.held.expires_in_ms)
    again = pickle.loads(pickle.dumps(held))
    assert (again, again.held) == (held, held.held)


def test_unique_store_leaves_settings_read_from_a_source_following_it() -> None:
    """Settings the app reads from ``config_from_object`` (Django's settings) are not frozen
    by the block: a later change of the source (``override_settings``) still reaches it."""

    class Settings:
        unique_backend = "memory://"
        broker_url = "memory://"

    app = Celery("sourced", set_as_current=False)
    app.config_from_object(Settings)
    with testing.unique_store(app, eager=True, broker="memory://", namespace="other"):
        assert (app.conf.get("unique_namespace"), app.conf.task_always_eager) == ("other", True)
    Settings.unique_backend = "sqlite:///elsewhere.db"
    assert app.conf.unique_backend == "sqlite:///elsewhere.db"
    assert (app.conf.get("unique_namespace"), app.conf.task_always_eager) == (None, False)
