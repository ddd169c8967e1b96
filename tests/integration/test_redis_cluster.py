"""The Redis store on a real three-node Redis Cluster passes the whole store contract.

Every script's keys share the namespace's hash tag, so each call lands on one
slot; a cluster refuses any script that touches keys of two slots, so this
suite failing would show a layout mistake at once.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_unique.stores.base import Store
from celery_unique.stores.redis import RedisStore
from tests.conftest import in_ci
from tests.contract import test_store_contract as contract


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A three-master cluster of redis-server processes started for this module."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        message = "redis-server/redis-cli are not installed"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    root: Path = tmp_path_factory.mktemp("cluster")
    ports = _free_ports(3)
    servers = []
    for port in ports:
        node = root / str(port)
        node.mkdir()
        servers.append(
            subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],
                cwd=node,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        for port in ports:
            deadline = time.monotonic() + 10
            while (
                subprocess.run(
                    ["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True
                ).stdout.strip()
                != "PONG"
            ):
                assert time.monotonic() < deadline, f"redis-server on {port} did not start"
                time.sleep(0.05)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 15
        while (
            "cluster_state:ok"
            not in subprocess.run(
                ["redis-cli", "-p", str(ports[0]), "cluster", "info"],
                capture_output=True,
                text=True,
            ).stdout
        ):
            assert time.monotonic() < deadline, "cluster did not become ready"
            time.sleep(0.1)
        yield f"redis+cluster://127.0.0.1:{ports[0]}/"
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=10)


@pytest.fixture
def store(cluster_url: str) -> Iterator[Store]:
    """The Redis store on the cluster, emptied before each test."""
    built = RedisStore.from_url(cluster_url)
    built.client.flushall()
    yield built
    built.close()


CONTRACT = [name for name in dir(contract) if name.startswith("test_")]


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_on_redis_cluster(name: str, store: Store) -> None:
    """Each contract test holds on a Redis Cluster."""
    getattr(contract, name)(store)
