"""One worker on one broker, with its app, store and marks: what delivery-path tests play on."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_unique import config as unique_config
from celery_unique.keys import keyspace
from celery_unique.stores.redis import RedisStore
from tests.conftest import fresh_queue_name, require_service, service_port
from tests.paths import _app
from tests.processes import RedisServer, Worker

#: The lease of every key (seconds): what frees the key of a message the broker
#: drops without a word. Longer than any job's wait in the queue.
LEASE_S = 15.0
#: How long an ``exists`` key is kept after its job (``result_expires``).
RETENTION_S = 3.0
#: Pool processes (or threads) of the worker, and messages it reserves per process:
#: together more than a pass's jobs, so no message waits in the broker (where
#: RabbitMQ would drop one that expires before a worker took it).
CONCURRENCY = 24
PREFETCH = 4


@dataclass
class Pass:
    """One worker, one broker: the context every cell of a pass shares."""

    broker: str
    pool: str
    spec: dict[str, Any]
    app: Celery
    store: RedisStore
    marks: Any
    worker: Worker

    def broker_client(self) -> Any:
        """A client on the Redis broker's database (Redis passes only)."""
        assert self.spec["broker_url"].startswith("redis://")
        return redis.Redis.from_url(self.spec["broker_url"])

    def storage_key(self, key: str) -> str:
        return keyspace.storage_key(self.spec["namespace"], keyspace.ACTIVE, "", key)

    def runs(self, job_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        ns = self.spec["namespace"]
        starts = [json.loads(raw) for raw in self.marks.lrange(f"{ns}:s:{job_id}", 0, -1)]
        ends = [json.loads(raw) for raw in self.marks.lrange(f"{ns}:e:{job_id}", 0, -1)]
        return starts, ends


@pytest.fixture
def matrix_pass(services: RedisServer, tmp_path: Path) -> Iterator[Callable[..., Pass]]:
    """Start a worker for one broker and pool (``visibility_timeout_s``: the Redis
    broker's, an hour unless given); everything is stopped afterwards."""
    started: list[tuple[Worker, Celery, RedisStore, Any]] = []

    def start(broker: str, pool: str, visibility_timeout_s: float = 3600) -> Pass:
        if broker == "rabbitmq":
            require_service("rabbitmq")
            broker_url = f"amqp://guest:guest@127.0.0.1:{service_port('rabbitmq')}//"
        else:
            broker_url = services.url(1)
        namespace = f"paths-{uuid.uuid4().hex[:10]}"
        spec = {
            "broker_url": broker_url,
            "queue": fresh_queue_name(),
            "idle_queue": fresh_queue_name(),
            "store_url": services.url(0),
            "marks_url": services.url(0),
            "namespace": namespace,
            "lease_s": LEASE_S,
            "retention_s": RETENTION_S,
            "prefetch": PREFETCH,
            "visibility_timeout_s": visibility_timeout_s,
        }
        module = f"pathsapp_{namespace.replace('-', '_')}"
        (tmp_path / f"{module}.py").write_text(
            "import json, os\nfrom tests.paths._app import build\n"
            "app = build(json.loads(os.environ['PATHS_SPEC']))\n"
        )
        worker = Worker(
            tmp_path,
            module,
            [spec["queue"]],
            f"paths-{pool}-{uuid.uuid4().hex[:6]}",
            pool=pool,
            concurrency=CONCURRENCY,
            extra_args=["--without-heartbeat"],
            env={"PATHS_SPEC": json.dumps(spec)},
        )
        app = _app.build(spec, producer=True)
        store = RedisStore.from_url(spec["store_url"])
        # Every cell samples in a thread of its own: more cells than redis-py's
        # default of 100 connections.
        marks = redis.Redis.from_url(spec["marks_url"], max_connections=1024)
        started.append((worker, app, store, marks))
        worker.wait_ready()
        return Pass(broker, pool, spec, app, store, marks, worker)

    yield start
    for worker, app, store, marks in started:
        worker.close()
        unique_config.reset(app)
        app.close()
        store.close()
        marks.close()
