"""What the dispatch benchmarks share: the app and its tasks, the Redis databases, counters.

Every benchmarked task takes the same arguments ``(tenant_id, n)`` and ignores
its result (no result backend), so each row measures the same publish and only
the uniqueness layer differs. ``n`` comes from one counter for the whole run,
so "fresh key per dispatch" holds across rows and rounds.

Databases on the benchmark's Redis server (flushed by the benchmark itself):
12 is the broker, 13 the uniqueness store (celery-unique, celery-once and
celery-singleton all keep their keys there), 14 a second store that holds
a million keys while latency is compared against the empty one.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import itertools
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import celery
import kombu
import redis
from celery import Celery
from redis.connection import AbstractConnection

import celery_unique
from celery_unique import Payload, UniqueTask

BROKER_DB = 12
STORE_DB = 13
FULL_STORE_DB = 14
QUEUE = "bench"
NAMESPACE = "bench"
TENANT = 7

#: One counter for every ``n`` handed to a task in this process.
numbers = itertools.count()


def fresh() -> int:
    return next(numbers)


@dataclass
class Tasks:
    """One task per benchmark row, all with the signature ``(tenant_id, n)``."""

    plain: Any
    selector: Any
    #: ``selector`` in an app whose dispatches ask the store before publishing.
    separate: Any
    literal: Any
    held: Any
    window: Any
    payload: Any
    once: Any
    singleton: Any
    #: ``unique_on_duplicate``: "latest" and "debounce", created and reused (``held_*``).
    latest: Any
    debounce: Any
    held_latest: Any
    held_debounce: Any
    #: Like ``selector`` with a task name of a real project's length (memory only).
    long_name: Any


@dataclass
class Bench:
    """An app wired to the benchmark's databases, its tasks and admin clients."""

    app: Celery
    tasks: Tasks
    broker: redis.Redis
    store: redis.Redis
    store_db: int


def db_url(base: str, db: int) -> str:
    parts = urlsplit(base)
    return f"{parts.scheme}://{parts.netloc}/{db}"


def _app(name: str, broker_url: str, store_url: str) -> Celery:
    app = Celery(name, broker=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=QUEUE,
        task_ignore_result=True,
        result_backend=None,
        unique_backend=store_url,
        unique_namespace=NAMESPACE,
        # celery-once and celery-singleton keep their locks on the same server and db.
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": store_url, "default_timeout": 3600},
        },
        singleton_backend_url=store_url,
        singleton_lock_expiry=3600,
    )
    return app


def build(base_url: str, *, store_db: int = STORE_DB, name: str = "bench") -> Bench:
    """A Celery app publishing to ``BROKER_DB`` with its uniqueness store in ``store_db``."""
    broker_url = db_url(base_url, BROKER_DB)
    store_url = db_url(base_url, store_db)
    app = _app(name, broker_url, store_url)
    # The same app, except that its dispatches ask the store before publishing: what
    # a store on another server than the broker costs (``unique_colocated=False``).
    separate = _app(f"{name}_separate", broker_url, store_url)
    separate.conf.unique_colocated = False
    tasks = Tasks(
        plain=_define(app, "plain"),
        selector=_define(app, "selector", base=UniqueTask, unique_key=lambda job: f"order:{job.n}"),
        separate=_define(
            separate, "selector", base=UniqueTask, unique_key=lambda job: f"order:{job.n}"
        ),
        literal=_define(app, "literal", base=UniqueTask),
        held=_define(app, "held", base=UniqueTask, unique_key="held"),
        window=_define(
            app,
            "window",
            base=UniqueTask,
            unique_window_key=lambda job: f"request:{job.n}",
            unique_window=3600,
        ),
        payload=_define(app, "payload", base=UniqueTask, unique_key=Payload()),
        latest=_define(app, "latest", **_follows("latest", lambda job: f"order:{job.n}")),
        debounce=_define(app, "debounce", **_follows("debounce", lambda job: f"order:{job.n}")),
        held_latest=_define(app, "held_latest", **_follows("latest", "held")),
        held_debounce=_define(app, "held_debounce", **_follows("debounce", "held")),
        once=_define(app, "once", base=_once_base(), once={"graceful": True}),
        singleton=_define(app, "singleton", base=_singleton_base()),
        long_name=_define(
            app,
            "orders.tasks.recalculate_tenant_stats",
            base=UniqueTask,
            unique_key=lambda job: f"order:{job.n}",
        ),
    )
    return Bench(
        app=app,
        tasks=tasks,
        broker=redis.Redis.from_url(broker_url),
        store=redis.Redis.from_url(store_url),
        store_db=store_db,
    )


def _follows(policy: str, key: Any) -> dict[str, Any]:
    """Options of a task whose held job follows its duplicates (``unique_on_duplicate``)."""
    debounce = {"unique_debounce": 60, "unique_debounce_max": 600} if policy == "debounce" else {}
    return {
        "base": UniqueTask,
        "unique_key": key,
        "unique_while": "active",
        "unique_on_duplicate": policy,
        **debounce,
    }


def _define(app: Celery, name: str, **options: Any) -> Any:
    def job(tenant_id: int, n: int) -> None:
        """The work is irrelevant: only dispatch is measured."""

    job.__name__ = f"{name.rpartition('.')[2]}_job"
    decorate: Any = app.task(name=f"{app.main}.{name}", shared=False, ignore_result=True, **options)
    return decorate(job)


def _once_base() -> Any:
    from celery_once import QueueOnce

    return QueueOnce


def _singleton_base() -> Any:
    from celery_singleton import Singleton

    return Singleton


def reset_broker(bench: Bench) -> None:
    """Drop queued messages but keep kombu's bindings (flushing them breaks routing)."""
    bench.broker.delete(*[QUEUE + suffix for suffix in ("", *_priority_suffixes())])


def _priority_suffixes() -> list[str]:
    return [f"\x06\x16{step}" for step in (3, 6, 9)]


class RoundTrips:
    """Counts request/response exchanges per Redis database in this process.

    Wraps redis-py's ``send_packed_command``: one call writes one command or a
    whole pipeline, and waits for its replies before the next, so the number of
    calls is the number of round trips (a pipeline counts once).
    """

    def __init__(self) -> None:
        self.counts: collections.Counter[int] = collections.Counter()
        self._original: Any = None

    def __enter__(self) -> RoundTrips:
        original: Any = AbstractConnection.send_packed_command
        counts = self.counts

        def counted(connection: Any, command: Any, check_health: bool = True) -> Any:
            counts[int(getattr(connection, "db", 0) or 0)] += 1
            return original(connection, command, check_health)

        self._original = original
        AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        AbstractConnection.send_packed_command = self._original  # type: ignore[method-assign]


def monitor_commands(
    base_url: str, action: Callable[[], None], dbs: Iterable[int]
) -> dict[int, int]:
    """Commands the server receives from clients for each of ``dbs`` while ``action`` runs.

    Reads the server's own ``MONITOR`` feed: commands run inside a script
    (``[db lua]``) are not client commands and are left out.
    """
    wanted = {int(db) for db in dbs}
    counts: dict[int, int] = dict.fromkeys(wanted, 0)
    sock = raw_socket(base_url)
    try:
        sock.sendall(resp(b"MONITOR"))
        buffer = _read_until(sock, b"+OK\r\n", b"")
        marker = b"END-OF-SAMPLE-%d" % os.getpid()
        action()
        with redis.Redis.from_url(db_url(base_url, min(wanted))) as client:
            client.echo(marker)
        while marker not in buffer:
            buffer += sock.recv(1 << 16)
    finally:
        sock.close()
    for line in buffer.split(b"\r\n"):
        start = line.find(b" [")
        if start < 0 or b" lua]" in line[:80]:
            continue
        db = line[start + 2 : line.find(b" ", start + 2)]
        if db.isdigit() and int(db) in wanted and marker not in line:
            counts[int(db)] += 1
    return counts


def _read_until(sock: socket.socket, token: bytes, buffer: bytes) -> bytes:
    while token not in buffer:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("Redis closed the MONITOR connection")
        buffer += chunk
    return buffer[buffer.index(token) + len(token) :]


def raw_socket(base_url: str, db: int | None = None) -> socket.socket:
    """A plain TCP connection to the server (no client library), on ``db`` if given."""
    parts = urlsplit(base_url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if db is not None:
        sock.sendall(resp(b"SELECT", str(db).encode()))
        _read_until(sock, b"+OK\r\n", b"")
    return sock


def resp(*parts: bytes) -> bytes:
    """One command in the Redis protocol."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def bulk_set(base_url: str, db: int, items: Iterator[tuple[bytes, bytes, int]]) -> int:
    """``SET key value PX ttl`` for every item, pipelined over a raw socket; returns the count."""
    sock = raw_socket(base_url, db)
    total = 0
    try:
        while True:
            chunk = [
                resp(b"SET", key, value, b"PX", str(ttl).encode())
                for key, value, ttl in itertools.islice(items, 10_000)
            ]
            if not chunk:
                return total
            sock.sendall(b"".join(chunk))
            expected, received = 5 * len(chunk), 0  # every reply is "+OK\r\n"
            while received < expected:
                data = sock.recv(1 << 20)
                if not data:
                    raise ConnectionError("Redis closed the connection during a bulk load")
                if data.count(b"-") and b"-ERR" in data:
                    raise RuntimeError(data.decode(errors="replace"))
                received += len(data)
            total += len(chunk)
    finally:
        sock.close()


def like(
    template_key: bytes, template_value: bytes, ttl: int, count: int, tag: str
) -> Iterator[tuple[bytes, bytes, int]]:
    """``count`` keys laid out like ``template_key``/``template_value``, each with its own job.

    The value's fields (kind, finished, job id, task, fingerprint, policy, see
    ``stores/lua/common.lua``) keep their lengths; the job id and a non-empty
    fingerprint are made distinct per key, as real ones are.
    """
    head, sep, _ = template_key.rpartition(b"\x1f")
    prefix = head + sep
    fields = template_value.split(b"\x1f")
    for i in range(count):
        value = template_value
        if len(fields) == 6:
            job = b"%08x-%04x-4000-8000-%012x" % (i, len(tag), i)
            fingerprint = fields[4] and (b"%032x" % i)[-len(fields[4]) :]
            value = b"\x1f".join([fields[0], fields[1], job, fields[3], fingerprint, fields[5]])
        yield prefix + b"%s:%d" % (tag.encode(), i), value, ttl


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def timed(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def timed_cpu(function: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds spent in ``function``.

    Wall minus CPU is time spent waiting: for Redis replies, and for the
    scheduler to run this process again after each wait.
    """
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall, time.process_time() - cpu


def machine(client: redis.Redis) -> dict[str, Any]:
    """Where the numbers come from."""
    info = client.info("server")
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    parser = "hiredis" if importlib.util.find_spec("hiredis") else "pure Python"
    return {
        "cores": os.cpu_count(),
        "cpu": model or platform.processor() or platform.machine(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "redis_server": info.get("redis_version"),
        "redis_py": redis.__version__,
        "redis_parser": parser,
        "celery": celery.__version__,
        "kombu": getattr(kombu, "__version__", "?"),
        "celery_unique": celery_unique.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def compare(
    cases: dict[str, Callable[[], object] | None], n: int, rounds: int
) -> dict[str, tuple[float, float] | None]:
    """Median (wall, CPU) microseconds per call of each case: ``rounds`` turns of ``n`` calls.

    Cases take turns (order rotated each round), so a busy moment of the
    machine is shared among them; ``None`` cases are reported as ``None``.
    """
    live = {name: case for name, case in cases.items() if case is not None}
    for case in live.values():
        for _ in range(min(n, 200)):
            case()
    walls: dict[str, list[float]] = {name: [] for name in live}
    cpus: dict[str, list[float]] = {name: [] for name in live}
    names = list(live)
    for number in range(rounds):
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            case = live[name]

            def loop(case: Callable[[], object] = case) -> None:
                for _ in range(n):
                    case()

            wall, cpu = timed_cpu(loop)
            walls[name].append(wall / n * 1e6)
            cpus[name].append(cpu / n * 1e6)
    return {
        name: (median(walls[name]), median(cpus[name])) if name in live else None for name in cases
    }
