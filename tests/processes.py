"""Real processes tests start and kill: ``redis-server`` s and ``celery worker`` subprocesses.

Workers run a real pool (``--pool=prefork`` unless told otherwise), each in a
session of its own: killing its process group kills the main process and its
children together, as a crashed host or an OOM kill of the whole unit would.
Every wait is bounded, and every process is killed by whoever started it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

import pytest

from tests import polling
from tests.conftest import HOST, in_ci

REPO = Path(__file__).resolve().parents[1]
#: How long a worker may take to start (import Celery, fork its pool, connect).
WORKER_START_S = 60.0
#: How long a redis-server may take to accept connections.
SERVER_START_S = 15.0
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


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

    def __init__(self, port: int, directory: Path, args: Sequence[str] = ()) -> None:
        self.port = port
        self.directory = directory
        #: More ``redis-server`` options (``--maxmemory 1mb``, ``--replicaof ...``).
        self.args = list(args)
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
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        process = self.process
        polling.eventually(
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


class RabbitMQNode:
    """A RabbitMQ node of one test: its own name, port, data and config, so that
    stopping or restarting it never touches the machine's own broker.

    The server runs as the ``rabbitmq`` user (Debian's ``rabbitmq-server`` switches
    to it), so its directory is one of its own in the system's temporary directory
    (a test's ``tmp_path`` sits under a directory only root may enter), handed to
    that user, and removed when the node stops.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.directory = Path(tempfile.mkdtemp(prefix=f"celery-unique-rabbitmq-{port}-"))
        self.name = f"celery-unique-{port}@localhost"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self) -> str:
        return f"amqp://guest:guest@{HOST}:{self.port}//"

    def start(self, attempts: int = 3) -> None:
        """Boot the node, and wait until it serves; on new ports if a boot fails (a port
        taken meanwhile), saying what the server printed when none succeeds."""
        failures: list[str] = []
        for _ in range(attempts):
            if self._boot(failures):
                return
            self.stop()
            self.port = free_port()
            self.name = f"celery-unique-{self.port}@localhost"
        pytest.fail("RabbitMQ node did not start:\n" + "\n".join(failures))

    def _boot(self, failures: list[str]) -> bool:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "enabled_plugins").write_text("[].\n")
        (self.directory / "rabbitmq.conf").write_text(f"listeners.tcp.local = {HOST}:{self.port}\n")
        with suppress(KeyError, PermissionError):
            shutil.chown(self.directory, "rabbitmq", "rabbitmq")
            for path in self.directory.iterdir():
                shutil.chown(path, "rabbitmq", "rabbitmq")
        env = {
            **os.environ,
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq.conf"),
            "RABBITMQ_MNESIA_BASE": str(self.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.directory / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
        }
        # In the foreground, in a session of its own: what it prints is kept, for a
        # boot that fails.
        with tempfile.TemporaryFile() as output:
            self.process = subprocess.Popen(
                ["rabbitmq-server"],
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and self.process.poll() is None:
                # await_startup fails at once until the node has registered its name.
                if self.ctl("await_startup", "--timeout", "20", check=False).returncode == 0:
                    return True
                time.sleep(0.5)
            output.seek(0)
            printed = output.read().decode(errors="replace")[-2000:]
        failures.append(f"{self.name} (exit {self.process.poll()}): {printed}")
        return False

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``rabbitmqctl`` against this node."""
        return subprocess.run(
            ["rabbitmqctl", "-n", self.name, *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def restart_app(self) -> None:
        """Stop and start the broker application: every connection is dropped."""
        self.ctl("stop_app")
        self.ctl("start_app")

    def stop(self) -> None:
        self.ctl("stop", check=False)
        if self.process is not None:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            self.process = None
        shutil.rmtree(self.directory, ignore_errors=True)


def rabbitmq_node_available() -> bool:
    return shutil.which("rabbitmq-server") is not None and shutil.which("rabbitmqctl") is not None


def free_cluster_port() -> int:
    """A free port whose cluster-bus port (+10000) is free too, both below the ephemeral range."""
    for _ in range(100):
        port = random.randrange(20_000, 22_700)
        with socket.socket() as node, socket.socket() as bus:
            try:
                node.bind((HOST, port))
                bus.bind((HOST, port + 10_000))
            except OSError:
                continue
            return port
    pytest.fail("no free pair of ports for a cluster node")


class RedisCluster:
    """A Redis Cluster of ``masters`` ``redis-server`` s (no replicas), in ``directory``."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        for _ in range(masters):
            port = free_cluster_port()
            folder = directory / str(port)
            folder.mkdir()
            self.nodes.append(
                RedisServer(port, folder, ["--cluster-enabled", "yes", "--cluster-config-file",
                                           "nodes.conf"])
            )  # fmt: skip

    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.nodes[0].port}/"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"{HOST}:{node.port}" for node in self.nodes]
        first = str(self.nodes[0].port)
        subprocess.run(
            ["redis-cli", "-p", first, "--cluster", "create", *addresses,
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, check=True, timeout=60,
        )  # fmt: skip

        def ready() -> bool:
            info = subprocess.run(
                ["redis-cli", "-p", first, "cluster", "info"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            return "cluster_state:ok" in info.stdout

        polling.eventually(ready, timeout=SERVER_START_S, what="the cluster's slots")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(signal.SIGTERM)


def require_redis_server() -> None:
    """Skip (fail when ``CI=true``) without a ``redis-server`` binary to start."""
    if shutil.which("redis-server") is None:
        message = "redis-server is not installed: the fault tests start their own"
        if in_ci():
            pytest.fail(f"{message} [CI=true]", pytrace=False)
        pytest.skip(message)


class Worker:
    """A ``celery worker`` subprocess in a process group of its own."""

    def __init__(
        self,
        app_dir: Path,
        module: str,
        queues: Sequence[str],
        name: str,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = app_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        environment = {
            **os.environ,
            **(env or {}),
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
                f"--pool={pool}",
                f"--concurrency={concurrency}",
                "--loglevel=INFO",
                "-Q",
                ",".join(queues),
                "-n",
                f"{name}@%h",
                "--without-mingle",
                "--without-gossip",
                *extra_args,
            ],
            cwd=app_dir,
            env=environment,
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
        polling.eventually(
            lambda: not self.alive() or " ready." in self.log(),
            timeout=timeout,
            what=f"worker {self.name} to be ready",
        )
        assert self.alive(), f"worker {self.name} exited:\n{self.log()}"

    def children(self) -> list[int]:
        """Pids of the worker's pool children (processes of its group but the main one)."""
        return [pid for pid in group_members(self.process.pid) if pid != self.process.pid]

    def stop(self, timeout: float = 30.0) -> None:
        """A warm shutdown (SIGTERM); SIGKILL if it takes longer than ``timeout``."""
        if self.alive():
            with suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole worker: its main process and every pool child."""
        if self.alive() or group_members(self.process.pid):
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        # Pool children die with the group; wait until none is left.
        polling.eventually(
            lambda: not group_members(self.process.pid), 10, "the worker's process group"
        )

    def close(self) -> None:
        self.kill()
        self._log.close()


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes of group ``pgid`` (zombies waiting to be reaped are not)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members
