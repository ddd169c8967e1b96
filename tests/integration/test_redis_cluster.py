"""The Redis store on a real three-node Redis Cluster passes the whole store contract.

Every script's keys share the namespace's hash tag, so each call lands on one
slot; a cluster refuses any script that touches keys of two slots, so this
suite failing would show a layout mistake at once.
"""

from __future__ import annotations

import random
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


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """Node ports whose cluster-bus port (+10000) is free too, both below the ephemeral range.

    Below 32768 no outgoing connection can take a port between the probe and
    the server's bind.
    """
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(20_000, 22_700)
        if port not in ports and _bindable(port) and _bindable(port + 10_000):
            ports.append(port)
    return ports


def _cli(port: int, *args: str) -> str:
    command = ["redis-cli", "-p", str(port), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout


def _start_node(port: int, folder: Path) -> subprocess.Popen[bytes]:
    folder.mkdir()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
         "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
         "--save", "", "--appendonly", "no", "--logfile", "redis.log"],
        cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while _cli(port, "ping").strip() != "PONG":
        if server.poll() is not None or time.monotonic() > deadline:
            log = folder / "redis.log"
            detail = log.read_text() if log.exists() else "(no log)"
            server.kill()
            pytest.fail(f"redis-server on port {port} did not start:\n{detail}")
        time.sleep(0.05)
    return server


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
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            servers.append(_start_node(port, root / str(port)))
        nodes = [f"127.0.0.1:{port}" for port in ports]
        _cli(ports[0], "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes")
        deadline = time.monotonic() + 20
        while "cluster_state:ok" not in _cli(ports[0], "cluster", "info"):
            assert time.monotonic() < deadline, "the cluster did not become ready"
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
