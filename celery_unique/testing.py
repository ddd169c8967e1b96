"""Helpers for testing your own tasks with uniqueness on.

Point an app at a private in-memory store, run tasks eagerly or on a test
worker, and look at the keys held::

    from celery_unique import testing

    def test_recalc_is_deduplicated(app):
        with testing.unique_store(app) as store:
            first, second = recalc.delay(7), recalc.delay(7)
            assert second.duplicate and second.id == first.id
            assert [k.job_id for k in testing.held_keys(app)] == [first.id]

Eager mode (``task_always_eager``) keeps the same semantics, so a key held
by an eagerly run job is already released when ``delay()`` returns (unless
its scope is ``exists`` or it is a window key).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from celery import Celery

from celery_unique import config
from celery_unique.install import install
from celery_unique.stores.base import HeldKey, KeyKind, Store
from celery_unique.stores.memory import MemoryStore

__all__ = ["MemoryStore", "held_keys", "reset_store", "unique_store"]


@contextmanager
def unique_store(
    app: Celery, url: str = "memory://", *, eager: bool | None = None
) -> Iterator[Store]:
    """Use a fresh store (memory by default) for ``app`` inside the block.

    ``eager=True`` also turns on ``task_always_eager`` for the block. The
    app's previous settings come back afterwards.
    """
    saved = {name: app.conf.get(name) for name in ("unique_backend", "task_always_eager")}
    config.reset(app)
    app.conf.unique_backend = url
    if eager is not None:
        app.conf.task_always_eager = eager
    install(app)
    try:
        yield config.runtime(app).store
    finally:
        config.reset(app)
        app.conf.update(saved)


def held_keys(app: Celery, kind: KeyKind | None = None) -> list[HeldKey]:
    """Every key the app's store holds now in the app's namespace, sorted by key."""
    from celery_unique.keyspace import namespace_prefixes

    rt = config.runtime(app)
    return sorted(
        (
            held
            for prefix in namespace_prefixes(rt.namespace)
            for held in rt.store.scan(kind=kind, prefix=prefix)
        ),
        key=lambda h: h.key,
    )


def reset_store(app: Celery) -> None:
    """Forget every key of the app's namespace (between tests sharing one store)."""
    rt = config.runtime(app)
    for held in held_keys(app):
        rt.store.delete(held.key)
