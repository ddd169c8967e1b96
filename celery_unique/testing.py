"""Helpers for testing your own tasks with uniqueness on.

Point an app at a private in-memory store, run tasks eagerly or on a test
worker, and look at the keys held::

    from celery_unique import testing

    def test_recalc_is_deduplicated(app):
        with testing.unique_store(app, broker="memory://") as store:
            first, second = recalc.delay(7), recalc.delay(7)
            assert second.duplicate and second.id == first.id
            assert testing.held_keys() == ["proj.tasks.recalc:7"]
            assert [k.job_id for k in testing.held_keys()] == [first.id]

Eager mode (``task_always_eager``) keeps the same semantics, so a key held
by an eagerly run job is already released when ``delay()`` returns (unless
its scope is ``exists`` or it is a window key).

With pytest, the plugin :mod:`celery_unique.pytest_plugin` (loaded by
itself once celery-unique is installed) gives the same as fixtures:
``unique_store`` and ``unique_eager``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery
from celery._state import get_current_app

from celery_unique import config
from celery_unique.install import install
from celery_unique.keys import keyspace
from celery_unique.stores.base import HeldKey, KeyKind, Store
from celery_unique.stores.memory import MemoryStore

__all__ = [
    "HeldKeyName",
    "MemoryStore",
    "held_keys",
    "reset_store",
    "unique_store",
    "wait_released",
]

#: Celery settings :func:`unique_store` may change, and puts back afterwards.
_SAVED = (
    "unique_backend",
    "unique_namespace",
    "task_always_eager",
    "broker_url",
    "broker_read_url",
    "broker_write_url",
    "result_backend",
)

#: The apps of the ``unique_store`` blocks open now, innermost last.
_active: list[Celery] = []


@contextmanager
def unique_store(
    app: Celery,
    url: str = "memory://",
    *,
    eager: bool | None = None,
    broker: str | None = None,
    namespace: str | None = None,
) -> Iterator[Store]:
    """Use a fresh store (memory by default) for ``app`` inside the block.

    * ``eager=True`` also turns on ``task_always_eager`` for the block.
    * ``broker`` also moves the app's broker there for the block;
      ``broker="memory://"`` (kombu's in-memory transport) moves its result
      backend to ``cache+memory://`` as well, so that a dispatch reaches no
      service (a message stays in this process; a Redis result backend would
      be contacted by every dispatch). Without it the app's broker is left as
      it is: a dispatch that is not eager publishes to it.
    * ``namespace`` gives the keys a namespace of their own (for a shared
      store such as Redis: ``unique_namespace``).

    The app's previous settings come back afterwards, with its connections.
    """
    # Only what the app itself was told: a setting read from Django's settings (or
    # any config_from_object source) must keep following its source afterwards.
    changes = app.conf.changes
    assert changes is not None  # a loaded configuration always has its layer of changes
    names = _spellings(app, _SAVED)
    saved = {name: changes[name] for name in names if name in changes}
    config.reset(app)
    _set(app, unique_backend=url)
    if namespace is not None:
        _set(app, unique_namespace=namespace)
    if eager is not None:
        _set(app, task_always_eager=eager)
    if broker is not None:
        _use_broker(app, broker)
    install(app)
    _active.append(app)
    try:
        yield config.runtime(app).store
    finally:
        _active.remove(app)
        config.reset(app)
        for name in names:
            if name in saved:
                changes[name] = saved[name]
            else:
                changes.pop(name, None)
        if broker is not None:
            _drop_connections(app)


def _use_broker(app: Celery, broker: str) -> None:
    _set(app, broker_url=broker, broker_read_url=None, broker_write_url=None)
    if broker.startswith("memory://"):
        _set(app, result_backend="cache+memory://")
    _drop_connections(app)


def _spellings(app: Celery, names: Iterable[str]) -> list[str]:
    """``names`` and, for an app configured with a namespace (Django's ``CELERY``), their
    prefixed spellings (``CELERY_BROKER_URL``)."""
    prefix = getattr(app, "namespace", None)
    spelled = list(names)
    if prefix:
        spelled += [f"{prefix}_{name.upper()}" for name in names]
    return spelled


def _set(app: Celery, **values: Any) -> None:
    """Set ``values`` under both spellings: up to Celery 5.6, a namespaced source's
    ``CELERY_BROKER_URL`` is read before a change made as ``broker_url``."""
    app.conf.update(
        {spelled: value for name, value in values.items() for spelled in _spellings(app, [name])}
    )


def _drop_connections(app: Celery) -> None:
    """Make the app open its broker connections and result backend again, from its settings.

    Celery keeps them once made (a connection pool, a producer pool, a
    backend per thread) and forgets them only after a fork; the pools
    themselves stay in kombu's registry, keyed by URL.
    """
    app._pool = None  # type: ignore[attr-defined]
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
    app._backend_cache = None  # type: ignore[attr-defined]
    local = app._local  # type: ignore[attr-defined]
    if local is not None and hasattr(local, "backend"):
        del local.backend


def testing_namespace(app: Celery) -> str:
    """A namespace no other test shares: the app's own, with a random suffix."""
    base = config.setting(app, "unique_namespace") or app.main or "celery"
    return f"{base}-test-{uuid.uuid4().hex[:12]}"


class HeldKeyName(str):
    """A held key's display name (``task:key``, or the bare key when shared by every
    task), with the key's record as ``held`` and its fields as attributes (``job_id``,
    ``kind``, ``task``, ``finished``, ...; ``key`` and ``storage_key`` are the key as
    the store holds it)."""

    __slots__ = ("held",)
    held: HeldKey

    def __new__(cls, held: HeldKey) -> HeldKeyName:
        _, _, scope, key = keyspace.split_storage_key(held.key)
        name = super().__new__(cls, keyspace.display_key(scope, key))
        name.held = held
        return name

    @property
    def job_id(self) -> str:
        return self.held.job_id

    @property
    def kind(self) -> KeyKind:
        return self.held.kind

    @property
    def task(self) -> str:
        return self.held.task

    @property
    def storage_key(self) -> str:
        """The key as the store holds it (``unique:v1:...``, with a ``\\x1f``)."""
        return self.held.key

    #: ``HeldKey.key``, for code written when ``held_keys()`` returned records.
    key = storage_key

    def __getattr__(self, name: str) -> Any:
        # The record's other fields (scope, expires_in_ms, since_ms, ...).
        if name == "held":
            raise AttributeError(name)
        return getattr(self.held, name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (HeldKeyName, (self.held,))

    @property
    def finished(self) -> bool:
        return self.held.finished


def held_keys(app: Celery | None = None, kind: KeyKind | None = None) -> list[HeldKeyName]:
    """Every key the app's store holds now in the app's namespace, sorted.

    Each is its display name, a ``str`` such as ``"proj.tasks.recalc:7"``,
    carrying ``job_id``, ``kind``, ``task``, ``storage_key``, ``finished`` and
    the whole record as ``held``. ``app`` defaults to the app of the innermost
    :func:`unique_store` block (or fixture), else Celery's current app.
    """
    rt = config.runtime(_app(app))
    return sorted(
        (
            HeldKeyName(held)
            for prefix in keyspace.namespace_prefixes(rt.namespace)
            for held in rt.store.scan(kind=kind, prefix=prefix)
        ),
        key=lambda name: name.storage_key,
    )


def reset_store(app: Celery | None = None) -> None:
    """Forget every key of the app's namespace (between tests sharing one store)."""
    rt = config.runtime(_app(app))
    for name in held_keys(app):
        rt.store.delete(name.storage_key)


def wait_released(result: Any, timeout: float = 10.0, *, app: Celery | None = None) -> None:
    """Wait until the job of ``result`` (a receipt, or a job id) holds no active key.

    That is, until its ``queued``/``active`` key is released, or its
    ``exists`` key is kept for its retention because the job finished. Window
    keys are remembered for their whole window by design and are not waited
    for. A job run on a worker releases its keys a moment after its result is
    ready; this waits for that moment. Raises ``TimeoutError`` naming the keys
    still held after ``timeout`` seconds.
    """
    job_id = result if isinstance(result, str) else result.id
    if app is None and not isinstance(result, str):
        app = getattr(result, "app", None)
    deadline = time.monotonic() + timeout
    while True:
        holding = [
            name
            for name in held_keys(app, kind=KeyKind.ACTIVE)
            if name.job_id == job_id and not name.finished
        ]
        if not holding:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} still holds {', '.join(holding)} after {timeout} s")
        time.sleep(0.02)


def _app(app: Celery | None) -> Celery:
    if app is not None:
        return app
    if _active:
        return _active[-1]
    return get_current_app()
