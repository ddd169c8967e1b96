"""Real processes to kill: ``celery worker`` subprocesses and dedicated ``redis-server`` s.

Workers run the real prefork pool (``--pool=prefork --concurrency=2``), so
which signal fires in the worker's main process and which in a pool child is
Celery's own doing, not a test double's. Each worker is started in a session
of its own: killing its process group kills the main process and its children
together, as a crashed host or an OOM kill of the whole unit would. Its app
module is written into the test's temporary directory and rebuilds the app
from the test's :class:`~tests.faults._apps.Spec`.

The tests' Redis is a ``redis-server`` of their own (:func:`services`), not
the shared one on port 6379: other test runs flush that one's databases at
any moment, which would free keys under a test's feet. Db 0 holds the store
(a namespace per test) and the marks tasks leave; db 1 is the broker (a
queue per test). Tests that stop a server start another one, on a free port,
for the part they stop. Every wait is bounded, and every process a test
starts is killed when it ends.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_unique import config as unique_config
from celery_unique.keys import keyspace
from celery_unique.stores.redis import RedisStore
from tests import polling
from tests.conftest import HOST, fresh_queue_name
from tests.faultproxy import FaultProxy
from tests.faults._apps import JOB, Spec, plain_app, unique_app
from tests.processes import RedisServer, Worker, free_port, require_redis_server

__all__ = ["RedisServer", "Worker", "eventually"]


def eventually(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """``tests.polling.eventually`` with the longer wait fault tests need by default."""
    return polling.eventually(check, timeout, what)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start more redis-servers, to stop (each on a free port); all are killed at teardown.

    Arguments are more ``redis-server`` options.
    """
    require_redis_server()
    servers: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        server = RedisServer(free_port(), tmp_path, args)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def marks(services: RedisServer) -> Iterator[Any]:
    """A client on the database where tasks leave their marks (and the store keeps its keys)."""
    client = redis.Redis.from_url(services.url())
    yield client
    client.close()


_APP_MODULE = """\
from tests.faults._apps import Spec, {builder}

app = {builder}(Spec.from_json({spec!r}))
"""


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """Start a ready worker for a spec (``plain=True``: without the plugin); all killed after."""
    workers: list[Worker] = []

    def start(
        spec: Spec, *, plain: bool = False, concurrency: int = 2, env: dict[str, str] | None = None
    ) -> Worker:
        name = f"faults{len(workers)}-{uuid.uuid4().hex[:8]}"
        module = f"faultapp_{name.replace('-', '_')}"
        builder = "plain_app" if plain else "unique_app"
        (tmp_path / f"{module}.py").write_text(
            _APP_MODULE.format(builder=builder, spec=spec.to_json())
        )
        worker = Worker(tmp_path, module, [spec.queue], name, concurrency=concurrency, env=env)
        workers.append(worker)
        worker.wait_ready()
        return worker

    yield start
    for worker in workers:
        worker.close()


@pytest.fixture
def proxy(services: RedisServer) -> Iterator[FaultProxy]:
    """A loopback fault proxy in front of the test's Redis server."""
    with FaultProxy(HOST, services.port) as running:
        yield running


@pytest.fixture
def make_spec(services: RedisServer) -> Callable[..., Spec]:
    """A spec on a fresh queue (broker: db 1) and namespace (store and marks: db 0)."""

    def make(**changes: Any) -> Spec:
        namespace = f"faults-{uuid.uuid4().hex[:12]}"
        fields: dict[str, Any] = {
            "broker_url": services.url(1),
            "queue": fresh_queue_name(),
            "store_url": services.url(0),
            "namespace": namespace,
            "marks_url": services.url(0),
            "marks": f"marks-{namespace}",
        }
        return Spec(**{**fields, **changes})

    return make


@pytest.fixture
def spec(make_spec: Callable[..., Spec], proxy: FaultProxy) -> Spec:
    """Broker (db 1) and store (db 0) both reached through the proxy: one server (a module
    may define its own)."""
    return make_spec(
        broker_url=proxy.url(1), store_url=f"{proxy.url(0)}?socket_timeout=1", lease_s=300
    )


@contextmanager
def producer(spec: Spec, *, plain: bool = False) -> Iterator[Celery]:
    """The test process's own app for ``spec``; its store and broker connections closed after."""
    app = plain_app(spec) if plain else unique_app(spec)
    try:
        yield app
    finally:
        unique_config.reset(app)
        app.close()


def task_of(app: Celery, name: str = JOB) -> Any:
    """The app's task ``name``, typed loosely: its ``apply_async`` takes uniqueness options."""
    return app.tasks[name]


@contextmanager
def open_store(url: str) -> Iterator[RedisStore]:
    store = RedisStore.from_url(url)
    try:
        yield store
    finally:
        store.close()


def job_key(spec: Spec, key: str, task: str = JOB) -> str:
    """The storage key of ``key`` given to a dispatch of ``task``."""
    return keyspace.storage_key(spec.namespace, keyspace.ACTIVE, task, key)


@dataclass(frozen=True)
class OneKey:
    """Dispatches of the fault tests' job with one ``active`` key, and who holds that key."""

    task: Any
    store: RedisStore
    key: str
    storage_key: str

    def dispatch(self, **kwargs: Any) -> Any:
        """``faults.job`` with ``kwargs``, keyed ``self.key`` while active."""
        return self.task.apply_async(kwargs=kwargs, unique_key=self.key, unique_while="active")

    def holder(self) -> str | None:
        """The id of the job holding the key, if any."""
        held = self.store.get(self.storage_key)
        return None if held is None else held.job_id


@contextmanager
def one_key(spec: Spec, key: str) -> Iterator[OneKey]:
    """A producer for ``spec`` dispatching with ``key``, and the store to look at it."""
    with producer(spec) as app, open_store(spec.store_url) as store:
        yield OneKey(task_of(app), store, key, job_key(spec, key))


def starts(marks: Any, spec: Spec) -> list[tuple[str, int, int, bool]]:
    """``(job id, pid, run number, carried keys)`` of every start of a job, in order."""
    return [tuple(json.loads(raw)) for raw in marks.lrange(f"{spec.marks}:started", 0, -1)]


def follow_runs(marks: Any, spec: Spec) -> list[tuple[str, int, int, int]]:
    """``(job id, version, start ns, end ns)`` of every run of ``faults.follow`` that
    ended, in order."""
    return [tuple(json.loads(raw)) for raw in marks.lrange(f"{spec.marks}:follow", 0, -1)]


def finished(marks: Any, spec: Spec) -> list[str]:
    """Ids of the jobs that ran to their end, in order."""
    return [raw.decode() for raw in marks.lrange(f"{spec.marks}:finished", 0, -1)]


def queue_length(spec: Spec) -> int:
    """How many messages wait in the spec's queue on its (Redis) broker."""
    client = redis.Redis.from_url(spec.broker_url)
    try:
        return int(client.llen(spec.queue))
    finally:
        client.close()
