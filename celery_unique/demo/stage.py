"""The demo's app, its tasks, the jobs it holds and watches, and what its store holds.

The one module of the demo that reaches into the library's internals (the
runtime configuration, the key layout, the store's records): every scene asks
:class:`Demo` instead, and sees the library only through its public API.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from celery import Celery, Task, signals
from celery.utils import uuid

from celery_unique import Payload, UniqueTask, config
from celery_unique.demo.report import Labels
from celery_unique.keys import keyspace
from celery_unique.stores.base import HeldKey, KeyKind, Scope, Store

#: How long the demo waits for any one thing to happen before it gives up.
TIMEOUT_S = 10.0
SCOPES = ("queued", "active", "exists")
RETENTION = timedelta(seconds=60)
WINDOW = timedelta(hours=24)


class DemoError(RuntimeError):
    """Something the demo waited for did not happen in time."""


# -- the stage: a worker whose jobs the demo can hold and watch --------------------------


class Stage:
    """Holds chosen jobs at their start and tells when a job started or finished.

    The tasks call :meth:`checkpoint` first thing; a job whose id was passed to
    :meth:`hold` waits there until :meth:`let_go`. Starts and ends are seen
    through Celery's ``task_prerun``/``task_postrun`` signals; the worker
    releases keys a moment later (once the message is acknowledged), which
    the waits watch in the store.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Event] = {}
        self._started: dict[str, threading.Event] = {}
        self._finished: dict[str, threading.Event] = {}

    def _event(self, table: dict[str, threading.Event], job_id: str) -> threading.Event:
        with self._lock:
            return table.setdefault(job_id, threading.Event())

    def hold(self, job_id: str) -> None:
        self._event(self._gates, job_id)

    def let_go(self, job_id: str) -> None:
        self._event(self._gates, job_id).set()

    def checkpoint(self, job_id: str) -> None:
        with self._lock:
            gate = self._gates.get(job_id)
        if gate is not None and not gate.wait(TIMEOUT_S):
            raise DemoError(f"job {job_id} was held for more than {TIMEOUT_S} s")

    def _on_prerun(self, task_id: str | None = None, **_: Any) -> None:
        if task_id:
            self._event(self._started, task_id).set()

    def _on_postrun(self, task_id: str | None = None, **_: Any) -> None:
        if task_id:
            self._event(self._finished, task_id).set()

    def wait_started(self, job_id: str, store: Store | None = None) -> None:
        """Wait until the job started (and, with ``store``, its ``queued`` key was released)."""
        self._wait(self._started, job_id, "start")
        if store is not None:
            self._settle(
                store, lambda held: held.job_id == job_id and held.scope is Scope.QUEUED, job_id
            )

    def wait_finished(self, job_ids: Sequence[str], store: Store | None = None) -> None:
        """Wait until the jobs ran to their end and the worker released what they held.

        The worker releases a job's keys once its message is acknowledged, a
        moment after the job's last signal: with ``store``, wait for that too.
        """
        for job_id in job_ids:
            self._wait(self._finished, job_id, "finish")
        if store is not None:
            self._settle(
                store,
                lambda held: (
                    held.job_id in job_ids and held.kind is KeyKind.ACTIVE and not held.finished
                ),
                ", ".join(job_ids),
            )

    @staticmethod
    def _settle(store: Store, held_still: Callable[[HeldKey], bool], jobs: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while any(held_still(held) for held in store.scan()):
            if time.monotonic() > deadline:
                raise DemoError(f"the keys of {jobs} were not released")
            time.sleep(0.005)

    def _wait(self, table: dict[str, threading.Event], job_id: str, what: str) -> None:
        if not self._event(table, job_id).wait(TIMEOUT_S):
            raise DemoError(f"job {job_id} did not {what} within {TIMEOUT_S} s")

    @contextmanager
    def watching(self) -> Iterator[None]:
        uid = f"celery_unique.demo.{id(self)}"
        signals.task_prerun.connect(self._on_prerun, weak=False, dispatch_uid=uid + ".pre")
        signals.task_postrun.connect(self._on_postrun, weak=False, dispatch_uid=uid + ".post")
        try:
            yield
        finally:
            for gate in list(self._gates.values()):
                gate.set()  # never leave the worker stuck
            signals.task_prerun.disconnect(dispatch_uid=uid + ".pre")
            signals.task_postrun.disconnect(dispatch_uid=uid + ".post")


# -- the app and its tasks ---------------------------------------------------------------


@dataclass
class Demo:
    """The app, its tasks, the stage and the running tally."""

    app: Celery
    stage: Stage
    tasks: dict[str, UniqueTask]
    #: A plain task that keeps the worker busy (see :meth:`worker_busy`).
    occupy: Task[Any, Any]
    published: list[str] = field(default_factory=list)

    @property
    def store(self) -> Store:
        return config.runtime(self.app).store

    def store_keys(self) -> int:
        return sum(1 for _ in self.store.scan())

    def held(self, task: UniqueTask, key: str, *, window: bool = False) -> HeldKey | None:
        kind = keyspace.WINDOW if window else keyspace.ACTIVE
        namespace = config.runtime(self.app).namespace
        return config.runtime(self.app).store.get(
            keyspace.storage_key(namespace, kind, task.name, key)
        )

    def close(self) -> None:
        """Drop the app's runtime configuration, which closes the store."""
        config.reset(self.app)

    @contextmanager
    def worker_busy(self) -> Iterator[None]:
        """Keep the (single) worker busy with another job, so new jobs wait in the queue."""
        job_id = uuid()
        self.stage.hold(job_id)
        self.occupy.apply_async(task_id=job_id)
        self.stage.wait_started(job_id)
        try:
            yield
        finally:
            self.stage.let_go(job_id)


def build_app(store_url: str, stage: Stage) -> Demo:
    """An app on the in-memory broker with the given store, and the demo's tasks."""
    app = Celery("demo", broker="memory://localhost/", set_as_current=False)
    app.conf.update(
        unique_backend=store_url,
        broker_connection_retry_on_startup=False,
        # kombu's in-memory transport polls; the default 1 s would make the tour slow.
        broker_transport_options={"polling_interval": 0.01},
        worker_hijack_root_logger=False,
    )
    tasks: dict[str, UniqueTask] = {}

    def recalculate(self: Task[Any, Any], tenant_id: int) -> str:
        stage.checkpoint(self.request.id or "")
        return f"stats of tenant {tenant_id}"

    for scope in SCOPES:
        tasks[scope] = app.task(
            name=f"demo.recalculate_{scope}",
            base=UniqueTask,
            bind=True,
            shared=False,
            unique_key=lambda job: f"tenant:{job.tenant_id}",
            unique_while=scope,
            unique_retention=RETENTION,
        )(recalculate)

    @app.task(
        name="demo.send_digest",
        base=UniqueTask,
        bind=True,
        shared=False,
        unique_key=Payload(only=[".user_id", ".template"]),
    )
    def send_digest(self: Task[Any, Any], user_id: int, template: str, requested_at: str) -> None:
        stage.checkpoint(self.request.id or "")

    @app.task(
        name="demo.place_order",
        base=UniqueTask,
        bind=True,
        shared=False,
        unique_window_key=lambda job: job.request_id,
        unique_window=WINDOW,
    )
    def place_order(self: Task[Any, Any], order_id: str, amount: int, request_id: str) -> None:
        stage.checkpoint(self.request.id or "")

    @app.task(name="demo.export", base=UniqueTask, shared=False)
    def export(tenant_id: int) -> None:
        return None

    @app.task(
        name="demo.notify",
        base=UniqueTask,
        shared=False,
        unique_key=lambda job: f"user:{job.user_name}",
    )
    def notify(user_name: str) -> None:
        return None

    @app.task(name="demo.occupy", bind=True, shared=False)
    def occupy(self: Task[Any, Any]) -> None:
        stage.checkpoint(self.request.id or "")

    tasks.update(payload=send_digest, window=place_order, export=export, notify=notify)
    app.finalize()
    return Demo(app=app, stage=stage, tasks=tasks, occupy=occupy)


# -- what the store holds, in words ------------------------------------------------------


def _ceil_duration(ms: int | None) -> str:
    """A remaining time rounded up, so that a fresh 60 s reads "60 s", not "59 s"."""
    if ms is None:
        return "no expiry"
    seconds = math.ceil(ms / 1000)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{math.ceil(seconds / 60)} min"
    return f"{math.ceil(seconds / 3600)} h"


def describe(held: HeldKey | None, labels: Labels) -> str:
    """The store's view of a key, in words: ``free``, ``held by J1``, ..."""
    if held is None:
        return "free"
    who = labels(held.job_id)
    if held.kind.value == "window":
        return f"points at {who}, {_ceil_duration(held.expires_in_ms)} left"
    if held.finished:
        return f"held by {who} (finished; kept {_ceil_duration(held.expires_in_ms)} more)"
    return f"held by {who}"
