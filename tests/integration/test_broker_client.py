"""A unique job's message on kombu's Redis transport goes out through a client its channel keeps.

kombu builds a new redis-py client for every command it sends to a Redis
broker. For a unique job's message, the channel keeps one client (per pool:
kombu replaces its pool as it reconnects) and kombu sends the same commands
through it; every other message takes kombu's way unchanged. The store is
asked first here (``unique_colocated = False``), as with a store on another
server, so every unique message is one of kombu's puts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from celery import Celery

from celery_unique import Disposition, UniqueTask
from celery_unique import config as unique_config
from tests.conftest import redis_publisher

from .test_races import queue_lists

pytestmark = pytest.mark.redis


@dataclass
class Publishing:
    app: Celery
    queue: str
    unique: Any
    plain: Any
    #: The connection pool of every redis-py client built while the test runs.
    clients: list[Any] = field(default_factory=list)

    def channel(self) -> Any:
        with self.app.producer_or_acquire() as producer:
            return producer.channel

    def broker_clients(self) -> int:
        """Clients built on the producer channel's current pool."""
        pool = self.channel().pool
        return sum(1 for built in self.clients if built is pool)

    def queued_ids(self, broker: Any) -> list[str]:
        messages = reversed(broker.lrange(self.queue, 0, -1))  # kombu pushes to the left
        return [json.loads(raw)["headers"]["id"] for raw in messages]


@pytest.fixture
def publishing(
    redis_url: str, broker: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Publishing]:
    app = redis_publisher(
        "brokerclient",
        redis_url,
        unique_colocated=False,
        broker_pool_limit=1,  # one producer, so one channel, for the whole test
    )

    @app.task(base=UniqueTask, unique_key=lambda job: f"n{job.n}", shared=False)
    def unique(n: int) -> None:
        """Never runs: the test reads the queue."""

    @app.task(shared=False)
    def plain(n: int) -> None:
        """Never runs: the test reads the queue."""

    found = Publishing(app, app.conf.task_default_queue, unique, plain)
    built = redis.Redis.__init__

    def noting(client: Any, *args: Any, **kwargs: Any) -> None:
        built(client, *args, **kwargs)
        found.clients.append(client.connection_pool)

    monkeypatch.setattr(redis.Redis, "__init__", noting)
    yield found
    unique_config.reset(app)
    app.close()
    broker.delete(*queue_lists(found.queue))


def test_unique_messages_go_out_through_one_client_and_plain_ones_through_kombus(
    publishing: Publishing, broker: Any
) -> None:
    """Five unique jobs: one client on the broker's pool; five plain ones: one (or more)
    each, as kombu builds a client for each command it sends."""
    unique = [publishing.unique.delay(n) for n in range(5)]
    assert {result.disposition for result in unique} == {Disposition.CREATED}
    assert publishing.broker_clients() == 1
    plain = [publishing.plain.delay(n) for n in range(5)]
    assert publishing.broker_clients() >= 1 + 5, "a plain message takes kombu's way unchanged"
    assert publishing.queued_ids(broker) == [result.id for result in unique + plain]


def test_a_reconnected_channel_sends_through_a_client_of_its_new_pool(
    publishing: Publishing, broker: Any
) -> None:
    first = publishing.unique.delay(1)
    channel = publishing.channel()
    kept = channel._celery_unique_client
    channel._disconnect_pools()  # what kombu does as the connection is lost
    second = publishing.unique.delay(2)
    assert channel._celery_unique_client is not kept
    assert channel._celery_unique_client.connection_pool is channel.pool
    assert publishing.queued_ids(broker) == [first.id, second.id]
