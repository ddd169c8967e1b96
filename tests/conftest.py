"""Services and Celery workers shared by every test folder.

Services
--------
Redis, RabbitMQ and PostgreSQL run on 127.0.0.1 (``scripts/services ensure
redis rabbitmq postgres`` starts them). A test that needs one either marks it
(``@pytest.mark.redis``, ``rabbitmq``, ``postgres``) or requests one of the
fixtures below; requesting a fixture adds the marker automatically, so
``pytest -m "not redis"`` deselects everything that needs Redis. A missing
service skips the test locally and FAILS it when ``CI=true``: CI never skips
silently. Ports can be moved with ``TEST_REDIS_PORT`` etc., as in
``scripts/services``.

Redis databases: ``redis_url`` / ``redis_client`` use db 9 (flushed at session
start, and before every test that takes ``redis_client``). Celery's broker and
result backend use db 10 (``celery_redis_url``), never flushed: flushing the
broker's database under a running worker deletes kombu's ``_kombu.binding.*``
keys and the worker silently stops receiving messages, so the store's database
and the broker's must differ. Instead, every Celery config built by
``redis_celery_config()`` gets a queue of its own
(``celery-unique-tests-<pid>-<n>``), so messages left by another test (ETA,
revoked or expired jobs), by an aborted run, or by a run going on at the same
time never reach this test's worker.

Celery workers (legacy fixtures)
--------------------------------
pytest-celery 1.x replaces Celery's legacy ``celery_worker`` fixture with a
Docker-based one that cannot run here, so pyproject.toml's ``addopts`` carry
``-p no:celery -p celery.contrib.pytest``: pytest-celery's plugin is not
loaded and Celery's own fixtures are. Available fixtures:

* ``celery_app`` + ``celery_worker`` (function scope): a fresh app configured
  from ``celery_config`` and a worker in a thread (solo pool) for one test.
  Preferred: tests stay independent.
* ``celery_session_app`` + ``celery_session_worker`` (session scope): one app
  and one worker for the whole run, configured by whichever ``celery_config``
  the first test that uses them sees. While it lives it consumes the default
  queue; do not let it share a queue with function-scoped workers (give each
  side its own ``redis_celery_config()``), or messages reach the wrong app.

Configuration:

* ``celery_config`` (defined below, session scope): ``redis_celery_config()``,
  i.e. Redis broker and result backend on db 10 and one queue for the
  session. Override it with a function-scoped fixture of the same name in a
  folder's conftest or a module to get a new app config (and queue) per test,
  e.g. ``{**redis_celery_config(), "unique_backend": redis_url}``; for a
  RabbitMQ broker replace ``broker_url`` with ``rabbitmq_url``. One test can
  add settings with ``@pytest.mark.celery(task_acks_late=True, ...)``
  (``celery_app`` only; the session app takes the marker of its first user).
* ``celery_includes``: modules imported before the worker starts. It contains
  ``celery.contrib.testing.tasks``, because ``start_worker`` sends the
  ``celery.ping`` task and asserts it is registered
  (``celery_worker_parameters`` returning ``{"perform_ping_check": False}``
  drops that check and saves a round trip).
* ``celery_worker_parameters``: keyword arguments of ``start_worker`` /
  ``WorkController`` (``perform_ping_check``, ``shutdown_timeout``, ``queues``
  ...). Ours sets ``shutdown_timeout=30``: with an ETA/countdown job held, the
  worker's event loop can take 10 s to notice the stop request (seen with
  RabbitMQ), and Celery's default of 10 s then fails the teardown at random.

Tasks defined after the worker started (``@celery_app.task`` inside the test
body, the usual pattern) are unknown to it until ``celery_worker.reload()``;
tasks defined in an included module or before the ``celery_worker`` fixture
runs need nothing. See tests/integration/test_worker_smoke.py for a minimal
example. Results: ``result.get(timeout=...)`` always with a timeout.

Celery's fixtures drop rather than close some Redis/AMQP connections; the
teardown of tests that use them ignores ResourceWarning and runs the garbage
collector (``pytest_runtest_teardown`` below), so that ``filterwarnings =
error`` does not fail some later test at random. Connections of
celery-unique's own objects must still be closed by the code that opens them.
"""

from __future__ import annotations

import gc
import itertools
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Generator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery import Celery

HOST = "127.0.0.1"

#: A project of its own, with its own pytest.ini: run by test_example_user_project.py.
collect_ignore = ["example_user_project"]

#: Test runs side by side on one Redis (the version matrix runs two cells at a
#: time) each take their own pair of databases: slot n uses 9 + 2n and 10 + 2n.
REDIS_SLOT = int(os.environ.get("CELERY_UNIQUE_TEST_REDIS_SLOT", "0"))
if not 0 <= REDIS_SLOT <= 2:
    raise ValueError(f"CELERY_UNIQUE_TEST_REDIS_SLOT must be 0, 1 or 2, not {REDIS_SLOT}")
#: Redis database used by store tests (``redis_url`` / ``redis_client``).
REDIS_TEST_DB = 9 + 2 * REDIS_SLOT
#: Redis database used as Celery broker and result backend by worker tests.
CELERY_REDIS_DB = 10 + 2 * REDIS_SLOT
#: RabbitMQ drops a test queue left without consumers this long (milliseconds).
TEST_QUEUE_EXPIRES_MS = 600_000

_queue_numbers = itertools.count(1)

_DEFAULT_PORTS = {"redis": 6379, "rabbitmq": 5672, "postgres": 5432, "mariadb": 3306}

#: Fixtures that need a service; requesting one (even indirectly) adds the marker.
_FIXTURE_MARKERS = {
    "redis_url": "redis",
    "redis_client": "redis",
    "celery_redis_url": "redis",
    "celery_worker": "redis",
    "celery_session_worker": "redis",
    "rabbitmq_url": "rabbitmq",
    "postgres_dsn": "postgres",
}

#: Fixtures that start an in-thread worker.
_WORKER_FIXTURES = frozenset({"celery_worker", "celery_session_worker"})
#: Fixtures whose teardown leaves Celery/kombu connections for the garbage collector.
_CELERY_FIXTURES = _WORKER_FIXTURES | {"celery_app", "celery_session_app"}

_seen_up: set[tuple[str, int]] = set()


def in_ci() -> bool:
    """Whether this run is CI's, where a missing service is an error."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def service_port(name: str) -> int:
    """The port of a service, honouring ``TEST_<NAME>_PORT``."""
    return int(os.environ.get(f"TEST_{name.upper()}_PORT", _DEFAULT_PORTS[name]))


def require_service(name: str, host: str = HOST, port: int | None = None) -> None:
    """Return when ``host:port`` accepts TCP; else skip, or fail when ``CI=true``."""
    port = service_port(name) if port is None else port
    if (host, port) in _seen_up:
        return
    try:
        with socket.create_connection((host, port), timeout=2):
            pass
    except OSError as exc:
        error = exc
    else:
        _seen_up.add((host, port))
        return
    message = (
        f"{name} is not reachable on {host}:{port} ({error}); "
        f"start it with `scripts/services ensure {name}`"
    )
    if in_ci():
        pytest.fail(f"{message} [CI=true: a missing service fails the run]", pytrace=False)
    pytest.skip(message)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, give this worker a ``redis-server`` of its own.

    Workers side by side would flush each other's test database and read each
    other's keys on the shared server (whose three slots are taken by the
    version matrix's cells running beside the suite). A private server per
    worker, on a free port below the ephemeral range, needs no slot: every
    fixture reaches it through ``TEST_REDIS_PORT``, and so do the workers and
    producers the tests start as subprocesses.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER") or "TEST_REDIS_PORT" in os.environ:
        return
    import shutil
    import tempfile
    from pathlib import Path

    from tests.processes import RedisServer, free_port

    if shutil.which("redis-server") is None:
        raise pytest.UsageError(
            "pytest -n needs redis-server on PATH: each worker runs one of its own"
        )
    directory = Path(tempfile.mkdtemp(prefix="celery-unique-xdist-redis-"))
    server = RedisServer(free_port(), directory)
    server.start()
    os.environ["TEST_REDIS_PORT"] = str(server.port)

    def stop() -> None:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)

    config.add_cleanup(stop)


#: Set by the version matrix's cells (noxfile.py), where every test run applies: a test
#: that does not is deselected there, with its reason, and a skip fails the run.
_NO_SKIPS = os.environ.get("CELERY_UNIQUE_TEST_NO_SKIPS") == "1"
_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _NO_SKIPS and report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _skipped and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _skipped:
        terminalreporter.write_sep(
            "=", "skipped where every test must run (deselect one that does not apply)", red=True
        )
        for nodeid in _skipped:
            terminalreporter.write_line(nodeid)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that requests a service fixture with that service's marker."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        for marker in sorted({_FIXTURE_MARKERS[n] for n in names if n in _FIXTURE_MARKERS}):
            if item.get_closest_marker(marker) is None:
                item.add_marker(marker)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Check the services a test is marked with before any of its fixtures runs.

    Also recover from an in-thread worker that failed to stop in time (see
    ``_reap_stuck_workers``; any test may start one, with ``start_worker``).
    """
    for name in _DEFAULT_PORTS:
        if item.get_closest_marker(name) is not None:
            require_service(name)
    _reap_stuck_workers()


def _reap_stuck_workers(timeout: float = 30.0) -> None:
    """Wait for in-thread workers told to stop; then clear the process globals they leave.

    When a worker thread outlives ``shutdown_timeout``, Celery's test helper
    raises but leaves its stop flag set (every later worker would exit at
    once while ``start_worker`` waits for it forever) and the stuck worker
    still owns kombu's current event loop and the pidbox queue of this
    process's node name (a new worker would hang or be refused).
    """
    from celery.worker import state

    if state.should_terminate is None and state.should_stop is None:
        return
    from celery.worker import WorkController
    from kombu.asynchronous import set_event_loop

    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        if isinstance(getattr(target, "__self__", None), WorkController):
            thread.join(max(0.0, deadline - time.monotonic()))
    state.should_stop = None
    state.should_terminate = None
    set_event_loop(None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    """Reclaim the sockets Celery's test app and worker leave behind, without ResourceWarnings.

    Celery's legacy fixtures drop (do not close) the result backend's Redis
    connections and pub/sub, the in-thread worker's thread-local backend and a
    broker connection opened by ``start_worker``. With ``filterwarnings =
    error`` their ``unclosed <socket>`` ResourceWarning, raised whenever the
    garbage collector gets to them, fails some later, unrelated test. So for
    tests using those fixtures (and the last test, when session fixtures end)
    teardown runs with ResourceWarning ignored and ends with a collection.
    """
    if nextitem is not None and _CELERY_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
        return (yield)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            return (yield)
        finally:
            gc.collect()


def _redis_url(db: int) -> str:
    return f"redis://{HOST}:{service_port('redis')}/{db}"


def _flushdb(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def fresh_queue_name() -> str:
    """A queue name used by no other test, in this run or any other."""
    return f"celery-unique-tests-{os.getpid()}-{next(_queue_numbers)}"


def redis_publisher(name: str, store_url: str, *, queue: str | None = None, **conf: Any) -> Celery:
    """An app publishing to the Redis test broker, with its store at ``store_url``, a
    namespace of its own (unless ``unique_namespace`` is given) and no result backend:
    a created job would subscribe to its result channel. ``conf`` overrides the rest."""
    from celery import Celery

    settings = redis_celery_config(queue)
    del settings["result_backend"]
    app = Celery(name, set_as_current=False)
    app.conf.update(
        settings,
        unique_backend=store_url,
        unique_namespace=f"{name}-{uuid.uuid4().hex}",
        task_ignore_result=True,
    )
    app.conf.update(conf)
    return app


def redis_celery_config(queue: str | None = None) -> dict[str, Any]:
    """Celery settings: Redis broker and result backend on db 10, a queue of its own.

    Each call names a new default queue (unless ``queue`` is given), so a
    message one test leaves behind (an ETA job, a revoked or expired one)
    never reaches another test's worker. On RabbitMQ the queue expires
    (``x-expires``) ten minutes after its last consumer left, and its exchange
    goes with it; on Redis leftovers stay in db 10, reaching no one.
    """
    from kombu import Exchange, Queue

    name = queue or fresh_queue_name()
    exchange = Exchange(name, type="direct", durable=False, auto_delete=True)
    url = _redis_url(CELERY_REDIS_DB)
    return {
        "broker_url": url,
        "result_backend": url,
        "task_default_queue": name,
        "task_default_exchange": name,
        "task_default_routing_key": name,
        "task_queues": (
            Queue(
                name,
                exchange,
                routing_key=name,
                queue_arguments={"x-expires": TEST_QUEUE_EXPIRES_MS},
            ),
        ),
        "broker_connection_retry_on_startup": False,
        "worker_hijack_root_logger": False,
    }


#: How long a finished test file's owed store writes get to land before they are dropped.
OWED_WRITES_LAND_S = 2.0


@pytest.fixture(autouse=True, scope="module")
def _owed_writes_end_with_their_file() -> Iterator[None]:
    """Store writes a test file left owed (to its private servers, proxies, apps) end with it.

    Owed writes are per process: without this, the next file run by the same process
    (under pytest-xdist, any file) would find them, and a test that waits until this
    process owes nothing would wait on a store long gone.
    """
    yield
    from celery_unique.stores import cleanup

    if not cleanup.flush(OWED_WRITES_LAND_S):
        cleanup.discard()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of the Redis test database (db 9), flushed once at session start."""
    require_service("redis")
    url = _redis_url(REDIS_TEST_DB)
    _flushdb(url)
    return url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[Any]:
    """A redis-py client on the test database, flushed before the test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def celery_redis_url() -> str:
    """URL of the Redis database Celery's broker and backend use (db 10; never flushed)."""
    require_service("redis")
    return _redis_url(CELERY_REDIS_DB)


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """AMQP URL of the local RabbitMQ (guest/guest, default vhost)."""
    require_service("rabbitmq")
    return f"amqp://guest:guest@{HOST}:{service_port('rabbitmq')}//"


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """DSN of the local PostgreSQL database ``test`` (user postgres, trust auth)."""
    require_service("postgres")
    return f"postgresql://postgres@{HOST}:{service_port('postgres')}/test"


@pytest.fixture(scope="session")
def celery_config() -> Mapping[str, Any]:
    """Default settings of the legacy Celery app fixtures (see ``redis_celery_config``).

    Connects to nothing by itself: only a worker or a publish does.
    """
    return redis_celery_config()


@pytest.fixture(scope="session")
def celery_worker_parameters() -> Mapping[str, Any]:
    """Keyword arguments of the legacy worker fixtures' ``start_worker``.

    ``shutdown_timeout`` is 30 s, not Celery's 10: while the worker holds an
    ETA/countdown job its event loop polls for up to 10 s before it sees the
    stop request, and a worker thread that outlives the timeout fails the test.
    Keep at least that in overrides.
    """
    return {"shutdown_timeout": 30}


@pytest.fixture(scope="session")
def celery_includes() -> tuple[str, ...]:
    """Modules the legacy worker fixtures import first (``celery.ping`` for the ping check)."""
    return ("celery.contrib.testing.tasks",)


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A ``redis-server`` of the session's own (``tests.processes.RedisServer``).

    For tests whose workers and keys must not be disturbed by anything else
    using the shared Redis: db 0 for stores and marks, db 1 for a broker.
    """
    from tests.processes import RedisServer, free_port, require_redis_server

    require_redis_server()
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
