"""A store behind Redis Sentinel: dispatches through a failover, errors only as backend_unavailable.

A master, a replica and a sentinel, each a ``redis-server`` of the test's own
on loopback. The store URL names the sentinel and the master's name; a
``SENTINEL FAILOVER`` swaps master and replica while producers dispatch.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from celery_unique import BackendUnavailable, Disposition
from tests.processes import RedisServer, free_port, require_redis_server

from ._apps import Spec
from .conftest import eventually, producer, task_of

pytestmark = pytest.mark.slow

MASTER = "uniquestore"


class Sentinels:
    """A master, a replica and one sentinel watching them."""

    def __init__(self, directory: Path, start: Callable[..., RedisServer]) -> None:
        self.master = start()
        self.replica = start("--replicaof", "127.0.0.1", str(self.master.port))
        port = free_port()
        config = directory / "sentinel.conf"
        config.write_text(
            f"port {port}\nbind 127.0.0.1\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 5000\n"
        )
        # A sentinel's configuration file comes first, and it rewrites it.
        self.sentinel = subprocess.Popen(
            ["redis-server", str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.port = port
        self.admin = redis.Redis(host="127.0.0.1", port=port)
        eventually(self._answers, 15, "the sentinel to start")
        eventually(self._sees_replica, 30, "the sentinel to see the replica")

    def _answers(self) -> bool:
        try:
            return bool(self.admin.ping())
        except redis.ConnectionError:
            return False

    def _sees_replica(self) -> bool:
        return bool(self.admin.sentinel_slaves(MASTER))

    def master_port(self) -> int:
        return int(self.admin.sentinel_get_master_addr_by_name(MASTER)[1])

    def url(self, db: int = 0) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{MASTER}/{db}?socket_timeout=2"

    def close(self) -> None:
        self.admin.close()
        self.sentinel.kill()
        self.sentinel.wait(10)


@pytest.fixture
def sentinels(tmp_path: Path, redis_server: Callable[..., RedisServer]) -> Iterator[Sentinels]:
    require_redis_server()
    running = Sentinels(tmp_path, redis_server)
    yield running
    running.close()


def test_dispatches_go_on_through_a_sentinel_failover(
    sentinels: Sentinels, make_spec: Callable[..., Spec]
) -> None:
    """Before, during and after SENTINEL FAILOVER: created or reused, else backend_unavailable."""
    spec = make_spec(store_url=sentinels.url())
    outcomes: Counter[str] = Counter()
    errors: list[BaseException] = []
    stop = threading.Event()
    with producer(spec) as app:
        task = task_of(app)
        held = task.apply_async(unique_key="before", unique_while="active")
        assert held.disposition is Disposition.CREATED

        def dispatch() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    result = task.apply_async(unique_key=f"k{n % 5}", unique_while="active")
                    outcomes[result.disposition.value] += 1
                except BackendUnavailable:
                    outcomes["backend_unavailable"] += 1
                except BaseException as error:  # anything else is a failure of the test
                    errors.append(error)
                time.sleep(0.01)

        worker = threading.Thread(target=dispatch)
        worker.start()
        time.sleep(1.0)
        before = sentinels.master_port()
        began = time.monotonic()
        sentinels.admin.sentinel_failover(MASTER)
        eventually(lambda: sentinels.master_port() != before, 30, "the failover")
        switched = time.monotonic() - began
        time.sleep(3.0)
        stop.set()
        worker.join(10)
        after = task.apply_async(unique_key="before", unique_while="active")
        assert (after.disposition, after.id) == (Disposition.REUSED, held.id)
        fresh = task.apply_async(unique_key="after-failover", unique_while="active")
        assert fresh.disposition is Disposition.CREATED
    assert errors == []
    assert outcomes["created"] + outcomes["reused"] > 50
    print(
        f"\nfailover: master switched in {switched:.1f} s; dispatches meanwhile: {dict(outcomes)}"
    )


def test_a_sentinel_url_without_a_master_name_is_refused() -> None:
    """The URL must name the master the sentinels watch."""
    from celery_unique.exceptions import ImproperlyConfigured
    from celery_unique.stores.redis import RedisStore

    with pytest.raises(ImproperlyConfigured, match="names no master"):
        RedisStore.from_url("redis+sentinel://:secret@127.0.0.1:26379")
