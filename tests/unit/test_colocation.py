"""Which deployments share one Redis server between the store and the broker.

The decision is read from the app's settings alone (no server is reached): the
broker's URL as kombu reads it against the store's connection pool. The startup
log says which way dispatches go, and why.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery

from celery_unique import config as unique_config
from celery_unique.dispatch import colocated

#: What the log says when a dispatch asks the store first, after the reason.
ASKED_FIRST = "celery-unique: dispatches ask the store before publishing ({})"
DIFFERENT_SERVERS = "the store and the broker are different Redis servers"
DIFFERENT_USERS = "the store and the broker connect to their Redis server as different users"


def decided(broker: str, store: str, **settings: Any) -> tuple[Any, list[str]]:
    """The app's colocation (asked twice) and what was logged of it."""
    app = Celery("colocation", broker=broker, set_as_current=False)
    app.conf.update(unique_backend=store, **settings)
    handler = _Lines()
    logger = logging.getLogger(colocated.logger.name)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        rt = unique_config.runtime(app)
        found = colocated.colocation(app, rt)
        assert colocated.colocation(app, rt) is found, "worked out once per app"
        return found, handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        unique_config.reset(app)
        app.close()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def shared(where: str) -> list[str]:
    return [
        f"celery-unique: store and broker share the Redis server {where}; a created "
        "dispatch reserves its keys and enqueues its message in one round trip"
    ]


@pytest.mark.parametrize(
    ("broker", "store", "where"),
    [
        ("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6379/0", "127.0.0.1:6379"),
        ("redis://127.0.0.1:6379/1", "redis://localhost/0", "localhost:6379"),
        ("redis://localhost/1", "redis://127.0.0.1:6379/0", "127.0.0.1:6379"),
        ("redis://127.0.0.1:6380/1", "redis://localhost:6380/0", "localhost:6380"),
        ("redis+socket:///tmp/shared.sock", "unix:///tmp/shared.sock", "/tmp/shared.sock"),
        (
            "redis://alice:pw@127.0.0.1:6379/1",
            "redis://alice:pw@127.0.0.1:6379/0",
            "127.0.0.1:6379",
        ),
        ("redis://:pw@127.0.0.1:6379/1", "redis://:pw@127.0.0.1:6379/0", "127.0.0.1:6379"),
    ],
    ids=[
        "same-address",
        "localhost-store",
        "localhost-broker",
        "port",
        "socket",
        "user",
        "password",
    ],
)
def test_a_broker_on_the_stores_server_as_its_user_is_colocated(
    broker: str, store: str, where: str
) -> None:
    found, logged = decided(broker, store)
    assert isinstance(found, colocated.Colocation)
    assert found.where == where
    assert logged == shared(where)


def test_tls_on_both_sides_is_colocated() -> None:
    found, logged = decided(
        "rediss://127.0.0.1:6379/1",
        "rediss://127.0.0.1:6379/0",
        broker_use_ssl={"ssl_cert_reqs": "none"},
    )
    assert found is not None
    assert found.server[3] is True
    assert logged == shared("127.0.0.1:6379")


@pytest.mark.parametrize(
    ("broker", "store", "why"),
    [
        ("redis://127.0.0.1:6380/1", "redis://127.0.0.1:6379/0", DIFFERENT_SERVERS),
        ("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6380/0", DIFFERENT_SERVERS),
        ("redis://127.0.0.1/1", "redis://127.0.0.1:6380/0", DIFFERENT_SERVERS),
        ("redis://10.1.2.3:6379/1", "redis://127.0.0.1:6379/0", DIFFERENT_SERVERS),
        ("redis://192.168.0.9:6379/1", "redis://127.0.0.1:6379/0", DIFFERENT_SERVERS),
        ("redis://redis.internal:6379/1", "redis://127.0.0.1:6379/0", DIFFERENT_SERVERS),
        ("redis+socket:///tmp/shared.sock", "unix:///tmp/other.sock", DIFFERENT_SERVERS),
        ("redis+socket:///tmp/shared.sock", "redis://127.0.0.1:6379/0", DIFFERENT_SERVERS),
        ("redis://127.0.0.1:6379/1", "unix:///tmp/shared.sock", DIFFERENT_SERVERS),
        ("redis://127.0.0.1:6379/1", "rediss://127.0.0.1:6379/0", DIFFERENT_USERS),
        ("redis://bob:pw@127.0.0.1:6379/1", "redis://alice:pw@127.0.0.1:6379/0", DIFFERENT_USERS),
        ("redis://alice:pw@127.0.0.1:6379/1", "redis://127.0.0.1:6379/0", DIFFERENT_USERS),
        ("redis://alice:x@127.0.0.1:6379/1", "redis://alice:pw@127.0.0.1:6379/0", DIFFERENT_USERS),
        ("redis://127.0.0.1:6379/1", "redis://:pw@127.0.0.1:6379/0", DIFFERENT_USERS),
    ],
    ids=[
        "broker-port",
        "store-port",
        "default-port",
        "lower-host",
        "higher-host",
        "host-name",
        "socket-path",
        "socket-broker",
        "socket-store",
        "tls",
        "user",
        "broker-user-only",
        "password",
        "store-password-only",
    ],
)
def test_another_server_or_user_asks_the_store_first(broker: str, store: str, why: str) -> None:
    found, logged = decided(broker, store)
    assert found is None
    assert logged == [ASKED_FIRST.format(why)]


def test_unique_colocated_false_asks_the_store_first() -> None:
    found, logged = decided(
        "redis://127.0.0.1:6379/1", "redis://127.0.0.1:6379/0", unique_colocated=False
    )
    assert found is None
    assert logged == [ASKED_FIRST.format("unique_colocated is False")]


def test_a_store_other_than_one_redis_server_asks_first() -> None:
    found, logged = decided("redis://127.0.0.1:6379/1", "memory://")
    assert found is None
    assert logged == [ASKED_FIRST.format("the store is not a single Redis server")]


def test_a_store_that_cannot_be_opened_asks_first() -> None:
    # A cluster client asks its nodes as it is built; nothing listens on port 1.
    found, logged = decided("redis://127.0.0.1:6379/1", "redis+cluster://127.0.0.1:1/")
    assert found is None
    assert len(logged) == 1
    # The error's name depends on redis-py's version (RedisClusterException in 6.4).
    assert logged[0].startswith(
        "celery-unique: dispatches ask the store before publishing (the store cannot be "
        "opened now (the Redis store failed: RedisCluster"
    )
    assert "127.0.0.1:1" in logged[0]


def test_a_broker_on_another_transport_asks_first() -> None:
    found, logged = decided("memory://", "redis://127.0.0.1:6379/0")
    assert found is None
    assert logged == [ASKED_FIRST.format("the broker is not kombu's Redis transport (Transport)")]


def test_a_broker_whose_transport_cannot_be_loaded_asks_first() -> None:
    found, logged = decided("nosuch://", "redis://127.0.0.1:6379/0")
    assert found is None
    assert logged == [
        ASKED_FIRST.format("the broker's transport cannot be loaded ('No such transport: nosuch')")
    ]
