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
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_unique import config as unique_config
from celery_unique import keyspace
from celery_unique.stores.redis import RedisStore
from tests import polling
from tests.conftest import HOST, fresh_queue_name, in_ci
from tests.faults._apps import JOB, Spec, plain_app, unique_app

REPO = Path(__file__).resolve().parents[2]
#: How long a worker may take to start (import Celery, fork its pool, connect).
WORKER_START_S = 60.0
#: How long a redis-server may take to accept connections.
SERVER_START_S = 15.0
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def eventually(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """``tests.polling.eventually`` with the longer wait fault tests need by default."""
    return polling.eventually(check, timeout, what)


def free_port() -> int:
    """A free port below the ephemeral range.

    A server stopped and started again reuses its port; in between, an outgoing
    connection of any process could be given a port of the ephemeral range,
    and the server could not come back.
    """
    try:
        low = int(_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(max(1024, low - 10_000), low)
        with socket.socket() as probe:
            try:
                probe.bind((HOST, port))
            except OSError:
                continue
            return port
    pytest.fail("no free port below the ephemeral range")


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


class RedisServer:
    """A ``redis-server`` of one test, on a port of its own; stopped and started at will."""

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://{HOST}:{self.port}/{db}"

    def start(self) -> None:
        assert self.process is None, "already running"
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                HOST,
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        process = self.process
        eventually(
            lambda: process.poll() is not None or _accepts(self.port),
            timeout=SERVER_START_S,
            what=f"redis-server on port {self.port}",
        )
        assert process.poll() is None, f"redis-server on port {self.port} exited"

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing is answered."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop the server with ``sig`` and wait until it is gone."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None


def require_redis_server() -> None:
    """Skip (fail when ``CI=true``) without a ``redis-server`` binary to start."""
    if shutil.which("redis-server") is None:
        message = "redis-server is not installed: the fault tests start their own"
        if in_ci():
            pytest.fail(f"{message} [CI=true]", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The fault tests' own Redis: store and marks in db 0, broker in db 1."""
    require_redis_server()
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    """Start more redis-servers, to stop (each on a free port); all are killed at teardown."""
    require_redis_server()
    servers: list[RedisServer] = []

    def start() -> RedisServer:
        server = RedisServer(free_port(), tmp_path)
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


class Worker:
    """A ``celery worker`` subprocess (prefork, 2 children) in a process group of its own."""

    def __init__(self, app_dir: Path, module: str, spec: Spec, name: str) -> None:
        self.name = name
        self.log_path = app_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(app_dir), str(REPO)]),
            "PYTHONUNBUFFERED": "1",
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                module,
                "worker",
                "--pool=prefork",
                "--concurrency=2",
                "--loglevel=INFO",
                "-Q",
                spec.queue,
                "-n",
                f"{name}@%h",
                "--without-mingle",
                "--without-gossip",
            ],
            cwd=app_dir,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float = WORKER_START_S) -> None:
        """Wait for the worker's "ready" line; fail with its log if it dies first."""
        eventually(
            lambda: not self.alive() or " ready." in self.log(),
            timeout=timeout,
            what=f"worker {self.name} to be ready",
        )
        assert self.alive(), f"worker {self.name} exited:\n{self.log()}"

    def kill(self) -> None:
        """SIGKILL the whole worker: its main process and every pool child."""
        if self.alive():
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        # Pool children die with the group; wait until none is left.
        eventually(lambda: not _group_alive(self.process.pid), 10, "the worker's process group")

    def close(self) -> None:
        self.kill()
        self._log.close()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting to be reaped do not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in ("Z", "X"):
            return True
    return False


_APP_MODULE = """\
from tests.faults._apps import Spec, {builder}

app = {builder}(Spec.from_json({spec!r}))
"""


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """Start a ready worker for a spec (``plain=True``: without the plugin); all killed after."""
    workers: list[Worker] = []

    def start(spec: Spec, *, plain: bool = False) -> Worker:
        name = f"faults{len(workers)}-{uuid.uuid4().hex[:8]}"
        module = f"faultapp_{name.replace('-', '_')}"
        builder = "plain_app" if plain else "unique_app"
        (tmp_path / f"{module}.py").write_text(
            _APP_MODULE.format(builder=builder, spec=spec.to_json())
        )
        worker = Worker(tmp_path, module, spec, name)
        workers.append(worker)
        worker.wait_ready()
        return worker

    yield start
    for worker in workers:
        worker.close()


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
