"""Configuration checks on real apps: each misconfiguration found, a correct app left alone.

The app-level checks run in this process on apps built for each test; the
store checks ask the real Redis (and a redis-server of their own, started
with an evicting ``maxmemory-policy``); ``celery unique check`` and the check
at worker start run as subprocesses, the fleet check against real workers.
"""

from __future__ import annotations

import json
import logging
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_unique import UniqueTask, checks
from celery_unique import config as unique_config
from celery_unique.checks.at_start import check_at_worker_start
from tests.conftest import fresh_queue_name, redis_celery_config
from tests.integration.test_cli import run_celery
from tests.processes import RedisServer, Worker, free_port, require_redis_server

UNREACHABLE = "redis://127.0.0.1:1/0"


@pytest.fixture
def make_app(redis_url: str) -> Iterator[Callable[..., Celery]]:
    """Apps on the real Redis (broker, backend and store), each in a namespace of its own."""
    apps: list[Celery] = []

    def make(name: str = "checked", **settings: Any) -> Celery:
        app = Celery(name, set_as_current=False)
        app.conf.update(
            {
                **redis_celery_config(),
                "unique_backend": redis_url,
                "unique_namespace": f"checks-{uuid.uuid4().hex[:8]}",
                **settings,
            }
        )
        apps.append(app)
        return app

    yield make
    for app in apps:
        unique_config.reset(app)
        app.close()


def keyed(app: Celery, name: str = "keyed", **options: Any) -> Any:
    """A UniqueTask holding an active key by its argument (more options override)."""
    declared = {"unique_key": lambda job: job.tag, "unique_while": "active", **options}

    @app.task(base=UniqueTask, name=name, shared=False, **declared)
    def task(tag: str) -> str:
        return tag

    return task


def ids(app: Celery, **kwargs: Any) -> list[str]:
    return [each.id for each in checks.run(app, **kwargs)]


def test_a_correct_app_has_no_finding(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    keyed(app)
    assert checks.run(app) == []


def test_unique_options_on_a_plain_task_are_an_error(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    @app.task(name="forgot", shared=False, unique_key=lambda job: job.tag, unique_while="active")
    def forgot(tag: str) -> None: ...

    [found] = checks.run(app)
    assert (found.id, found.subject, found.is_error) == ("celery_unique.E020", "forgot", True)
    assert "unique_key, unique_while" in found.message


def test_an_invalid_declaration_is_reported_as_itself(make_app: Callable[..., Celery]) -> None:
    """A task refused as the checks define it (lazily, as @shared_task tasks are): E014,
    naming the task and the option, not E013 for the check that happened to define it."""
    app = make_app()
    keyed(app)

    @app.task(base=UniqueTask, name="malformed", shared=False, unique_while="sometimes")
    def malformed() -> None: ...

    [found] = checks.run(app)
    assert (found.id, found.subject, found.is_error) == ("celery_unique.E014", "malformed", True)
    assert found.message.startswith(
        "task malformed is declared with invalid uniqueness options (invalid_declaration): "
        "unique_while must be one of"
    )
    assert "correct the option the message names" in found.hint


def test_a_lease_shorter_than_the_redelivery_window_warns(
    make_app: Callable[..., Celery], rabbitmq_url: str
) -> None:
    app = make_app(unique_lease=60)
    keyed(app)
    [found] = checks.run(app)
    assert found.id == "celery_unique.W021"
    assert "60 s" in found.message
    assert "3600 s" in found.message
    longer = make_app(unique_lease=600, broker_transport_options={"visibility_timeout": 300})
    keyed(longer)
    assert ids(longer) == []
    on_rabbitmq = make_app(
        unique_lease=60,
        broker_url=rabbitmq_url,
        broker_transport_options={"confirm_publish": True},
    )
    keyed(on_rabbitmq)
    assert ids(on_rabbitmq) == []  # RabbitMQ delivers again as soon as the worker is gone


def test_rabbitmq_without_publisher_confirms_warns(
    make_app: Callable[..., Celery], rabbitmq_url: str
) -> None:
    """A publish RabbitMQ never took returns all the same: its key would wait for the lease."""
    app = make_app(broker_url=rabbitmq_url)
    keyed(app, unique_while="queued")
    [found] = checks.run(app)
    assert (found.id, found.subject) == ("celery_unique.W028", "broker_transport_options")
    assert "confirm_publish" in found.hint
    confirmed = make_app(
        broker_url=rabbitmq_url, broker_transport_options={"confirm_publish": True}
    )
    keyed(confirmed, unique_while="queued")
    assert ids(confirmed) == []
    assert ids(make_app()) == []  # a Redis broker: nothing to confirm


def test_exists_retention_past_result_expiry_warns(make_app: Callable[..., Celery]) -> None:
    app = make_app(result_expires=3600)
    keyed(app, unique_while="exists", unique_retention=7200)
    keyed(app, name="short", unique_while="exists", unique_retention=60)
    assert [(each.id, each.subject) for each in checks.run(app)] == [
        ("celery_unique.W022", "keyed")
    ]


def test_no_result_for_the_reaper_warns(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    keyed(app, ignore_result=True)
    keyed(app, name="queued_only", unique_while="queued", ignore_result=True)
    assert [(each.id, each.subject) for each in checks.run(app)] == [
        ("celery_unique.W023", "keyed")
    ]
    no_backend = make_app(result_backend=None)
    no_backend.conf.result_backend = "disabled"
    keyed(no_backend)
    assert [(each.id, each.subject) for each in checks.run(no_backend)] == [
        ("celery_unique.W023", "result_backend")
    ]


def test_a_store_url_of_no_known_kind_is_an_error(make_app: Callable[..., Celery]) -> None:
    app = make_app(unique_backend="mongodb://user:secret@db:27017/x")
    keyed(app)
    [found] = checks.run(app)
    assert found.id == "celery_unique.E001"
    assert "secret" not in found.message


def test_an_unreachable_store_is_an_error_or_under_fail_open_a_warning(
    make_app: Callable[..., Celery],
) -> None:
    closed = make_app(unique_backend="redis://:hunter2@127.0.0.1:1/0")
    keyed(closed)
    [found] = checks.run(closed)
    assert found.id == "celery_unique.E012"
    assert "127.0.0.1:1" in found.message
    assert "hunter2" not in found.message
    assert ids(closed, store=False) == []
    assert "cannot be reached" in found.message
    assert "correct the host and port" in found.hint
    opened = make_app(unique_backend=UNREACHABLE, unique_fail_open=True)
    keyed(opened)
    assert ids(opened) == ["celery_unique.W012"]


def test_a_store_refusing_the_login_is_named_as_such(
    make_app: Callable[..., Celery], redis_url: str
) -> None:
    """E012 names the cause: a login the store refuses is not an unreachable store."""
    refused = redis_url.replace("redis://", "redis://nobody:wrong@", 1)
    app = make_app(unique_backend=refused)
    keyed(app)
    [found] = checks.run(app)
    assert found.id == "celery_unique.E012"
    assert "refuses the credentials it is given" in found.message
    assert "cannot be reached" not in found.message
    assert "wrong" not in found.message
    assert "correct the user name and password" in found.hint


def test_two_apps_sharing_a_namespace_warn(make_app: Callable[..., Celery]) -> None:
    first = make_app("billing")
    keyed(first, name="billing.charge")
    assert ids(first) == []
    assert ids(first) == []  # checking again is no collision with itself
    second = make_app("shipping", unique_namespace=first.conf.unique_namespace)
    keyed(second, name="shipping.send")
    [found] = checks.run(second)
    assert found.id == "celery_unique.W025"
    assert (
        f"the key namespace {first.conf.unique_namespace!r} on this store is also used by "
        "app 'billing', with other unique tasks than app 'shipping': the keys of these apps "
        "share one space"
    ) in found.message
    alone = make_app("shipping")
    keyed(alone, name="shipping.send")
    assert ids(alone) == []


def test_one_app_name_with_other_tasks_is_not_told_apart(make_app: Callable[..., Celery]) -> None:
    """The registry keeps one entry per app name: a new task set under it is a deploy, not W025."""
    first = make_app("billing")
    keyed(first, name="billing.charge")
    assert ids(first) == []
    again = make_app("billing", unique_namespace=first.conf.unique_namespace)
    keyed(again, name="billing.refund")
    assert ids(again) == []


@pytest.fixture
def hset_refused(redis_url: str) -> Iterator[str]:
    """A store URL whose Redis user may run any command but HSET: an ACL user of the test's
    own, on the shared server, deleted after it."""
    client = redis.Redis.from_url(redis_url)
    user, password = f"celery-unique-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    client.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
    client.execute_command("ACL", "SETUSER", user, "-hset")
    try:
        yield redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
    finally:
        client.execute_command("ACL", "DELUSER", user)
        client.close()


def test_a_check_that_raises_is_a_finding_and_the_others_still_report(
    make_app: Callable[..., Celery], hset_refused: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store refusing the registry's HSET: that check is E013, every other one reports."""
    app = make_app(unique_backend=hset_refused, unique_lease=60)
    keyed(app)

    @app.task(name="forgot", shared=False, unique_key=lambda job: job.tag, unique_while="active")
    def forgot(tag: str) -> None: ...

    found = checks.run(app)
    assert [each.id for each in found] == [
        "celery_unique.E020",
        "celery_unique.W021",
        "celery_unique.E013",
    ]
    unfinished = found[-1]
    assert unfinished.subject == "unique_namespace"
    assert "the check for celery_unique.W025 could not finish" in unfinished.message
    assert "hset" in unfinished.message.lower()
    password = hset_refused.rsplit("@", 1)[0].rsplit(":", 1)[1]
    assert all(password not in each.message for each in found)
    # At worker start too, each of them is logged (none is lost to the one that raised).
    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        check_at_worker_start(app)
    logged = [record.getMessage().split()[0] for record in caplog.records]
    assert logged == ["celery_unique.E020", "celery_unique.W021", "celery_unique.E013"]


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_a_store_that_evicts_keys_is_an_error(
    make_app: Callable[..., Celery], tmp_path: Path, policy: str
) -> None:
    require_redis_server()
    server = RedisServer(
        free_port(), tmp_path, ["--maxmemory", "100mb", "--maxmemory-policy", policy]
    )
    server.start()
    try:
        app = make_app(unique_backend=server.url(0))
        keyed(app)
        [found] = checks.run(app)
        assert found.id == "celery_unique.E026"
        assert policy in found.message
        assert "104857600" in found.message
        server_ok = make_app(unique_backend=server.url(1))
        keyed(server_ok)
        redis.Redis.from_url(server.url()).config_set("maxmemory-policy", "noeviction")
        assert ids(server_ok) == []
    finally:
        server.stop()


def test_a_store_user_refused_config_get_is_a_warning_not_an_unfinished_check(
    make_app: Callable[..., Celery], tmp_path: Path
) -> None:
    """An ACL user limited to its keys may not run CONFIG GET: the eviction check cannot
    tell and says so as W029 (a warning, which ``unique_strict_checks`` does not turn
    into a stopped worker), instead of E013, and the password stays masked."""
    require_redis_server()
    server = RedisServer(free_port(), tmp_path, ["--maxmemory", "100mb"])
    server.start()
    try:
        admin = redis.Redis.from_url(server.url())
        admin.execute_command(
            "ACL", "SETUSER", "keysonly", "on", ">s3cret-pw", "~*", "&*", "+@all", "-config"
        )
        admin.close()
        app = make_app(
            unique_backend=server.url(0).replace("redis://", "redis://keysonly:s3cret-pw@")
        )
        keyed(app)
        [found] = checks.run(app)
        assert found.id == "celery_unique.W029"
        assert "could not read maxmemory-policy" in found.message
        assert "s3cret-pw" not in found.message
    finally:
        server.stop()


# -- as users run them -------------------------------------------------------------

PROJECT = """
from celery import Celery, shared_task

from celery_unique import UniqueTask

app = Celery("{name}")
app.conf.update(
    broker_url={broker!r},
    result_backend={broker!r},
    task_default_queue={queue!r},
    unique_backend={store!r},
    unique_namespace={namespace!r},
    unique_lease={lease!r},
    unique_strict_checks={strict!r},
)


@app.task(base=UniqueTask, unique_key=lambda job: job.order_id, unique_while="active")
def ship(order_id: int) -> None: ...

{mistake}
"""

FORGOTTEN_BASE = """
@shared_task(unique_key=lambda job: job.customer_id, unique_while="active")
def reindex(customer_id: int) -> None: ...
"""


@pytest.fixture
def project(tmp_path: Path, celery_redis_url: str, redis_url: str) -> Callable[..., str]:
    """Write a project module into ``tmp_path``; its name."""

    def write(*, mistake: str = "", lease: float = 3600, strict: bool = False, **more: Any) -> str:
        name = f"proj_{uuid.uuid4().hex[:8]}"
        values = {
            "name": name,
            "broker": celery_redis_url,
            "queue": fresh_queue_name(),
            "store": redis_url,
            "namespace": f"checks-{uuid.uuid4().hex[:8]}",
            "lease": lease,
            "strict": strict,
            "mistake": mistake,
            **more,
        }
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(PROJECT.format(**values)))
        return name

    return write


AUTODISCOVERING_APP = """
from celery import Celery

app = Celery("{name}")
app.conf.update(
    broker_url={broker!r},
    result_backend={broker!r},
    task_default_queue={queue!r},
    unique_backend={store!r},
    unique_namespace={namespace!r},
)
app.autodiscover_tasks(["{name}.shop"])
"""

SHOP_TASKS = """
from celery import shared_task

from celery_unique import UniqueTask


@shared_task(base=UniqueTask, unique_key=lambda job: job.order_id, unique_while="active")
def ship(order_id: int) -> None: ...


@shared_task(unique_key=lambda job: job.customer_id, unique_while="active")
def reindex(customer_id: int) -> None: ...
"""


def test_the_command_checks_the_tasks_an_app_autodiscovers(
    tmp_path: Path, celery_redis_url: str, redis_url: str
) -> None:
    """``unique check`` imports the task modules a worker would: autodiscovered mistakes count."""
    name = f"proj_{uuid.uuid4().hex[:8]}"
    shop = tmp_path / name / "shop"
    shop.mkdir(parents=True)
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "celery.py").write_text(
        AUTODISCOVERING_APP.format(
            name=name,
            broker=celery_redis_url,
            queue=fresh_queue_name(),
            store=redis_url,
            namespace=f"checks-{uuid.uuid4().hex[:8]}",
        )
    )
    (shop / "__init__.py").write_text("")
    (shop / "tasks.py").write_text(SHOP_TASKS)
    result = run_celery(tmp_path, "-A", f"{name}.celery", "unique", "check", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert [(f["id"], f["subject"]) for f in report["findings"]] == [
        ("celery_unique.E020", f"{name}.shop.tasks.reindex")
    ]


def test_the_command_exits_1_on_an_error_and_0_on_warnings(
    tmp_path: Path, project: Callable[..., str]
) -> None:
    clean = run_celery(tmp_path, "-A", project(), "unique", "check")
    assert (clean.returncode, clean.stdout.strip()) == (0, "no problems found"), clean.stderr
    warned = run_celery(tmp_path, "-A", project(lease=60), "unique", "check", "--json")
    assert warned.returncode == 0, warned.stderr
    report = json.loads(warned.stdout)
    assert (report["errors"], [f["id"] for f in report["findings"]]) == (
        0,
        ["celery_unique.W021"],
    )
    broken = project(mistake=FORGOTTEN_BASE, lease=60, store=UNREACHABLE)
    failed = run_celery(tmp_path, "-A", broken, "unique", "check")
    print(f"\n$ celery -A {broken} unique check\n{failed.stdout}")
    assert failed.returncode == 1, failed.stderr
    found = [line.split()[0] for line in failed.stdout.splitlines() if line.startswith("celery_")]
    assert found == ["celery_unique.E020", "celery_unique.W021", "celery_unique.E012"]
    assert failed.stdout.strip().endswith("2 error(s), 1 warning(s)")


def _worker(tmp_path: Path, module: str) -> Worker:
    return Worker(tmp_path, module, [], f"checked-{uuid.uuid4().hex[:6]}", concurrency=1)


def test_a_starting_worker_logs_each_finding_and_runs_on(
    tmp_path: Path, project: Callable[..., str]
) -> None:
    module = project(mistake=FORGOTTEN_BASE, lease=60)
    worker = _worker(tmp_path, module)
    try:
        worker.wait_ready()
        log = worker.log()
        [error] = [line for line in log.splitlines() if "celery_unique.E020" in line]
        [warning] = [line for line in log.splitlines() if "celery_unique.W021" in line]
        assert "ERROR" in error
        assert f"{module}.reindex" in error
        assert "WARNING" in warning
        assert worker.alive()
    finally:
        worker.stop()
        worker.close()


def test_a_strict_worker_does_not_start_on_an_error(
    tmp_path: Path, project: Callable[..., str]
) -> None:
    worker = _worker(tmp_path, project(mistake=FORGOTTEN_BASE, strict=True))
    try:
        assert worker.process.wait(timeout=60) != 0
        log = worker.log()
        assert "celery_unique.E020" in log
        assert "the worker does not start: celery_unique.E020" in log
        assert " ready." not in log
    finally:
        worker.close()


FORGOT_ONLY_PROJECT = """
from celery import Celery

app = Celery("{name}")
app.conf.update(
    broker_url={broker!r},
    task_default_queue={queue!r},
    unique_backend={store!r},
    unique_namespace={namespace!r},
)


# Its only unique task forgot base=UniqueTask: no UniqueTask is ever bound to this app.
@app.task(unique_key=lambda job: job.customer_id, unique_while="active")
def reindex(customer_id: int) -> None: ...
"""


def test_a_worker_checks_an_app_that_binds_no_unique_task(
    tmp_path: Path, celery_redis_url: str, redis_url: str
) -> None:
    """A worker of an app whose unique tasks all forgot their base logs E020; a plain app, none."""
    forgot, plain = f"forgot_{uuid.uuid4().hex[:8]}", f"plain_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{forgot}.py").write_text(
        FORGOT_ONLY_PROJECT.format(
            name=forgot,
            broker=celery_redis_url,
            queue=fresh_queue_name(),
            store=redis_url,
            namespace=f"checks-{uuid.uuid4().hex[:8]}",
        )
    )
    (tmp_path / f"{plain}.py").write_text(
        PLAIN_PROJECT.format(name=plain, broker=celery_redis_url, queue=fresh_queue_name())
    )
    workers = [_worker(tmp_path, forgot), _worker(tmp_path, plain)]
    try:
        for worker in workers:
            worker.wait_ready()
        [error] = [line for line in workers[0].log().splitlines() if "celery_unique." in line]
        assert "ERROR" in error
        assert f"celery_unique.E020 task {forgot}.reindex has unique_key, unique_while" in error
        assert "celery_unique" not in workers[1].log()
    finally:
        for worker in workers:
            worker.stop()
            worker.close()


PLAIN_PROJECT = """
from celery import Celery

app = Celery("{name}")
app.conf.update(broker_url={broker!r}, task_default_queue={queue!r})
"""


def test_the_fleet_check_finds_workers_without_the_plugin(
    tmp_path: Path, project: Callable[..., str], celery_redis_url: str
) -> None:
    module = project()
    plain = f"plain_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{plain}.py").write_text(
        PLAIN_PROJECT.format(name=plain, broker=celery_redis_url, queue=fresh_queue_name())
    )
    workers = [_worker(tmp_path, module), _worker(tmp_path, plain)]
    try:
        for worker in workers:
            worker.wait_ready()
        result = run_celery(tmp_path, "-A", module, "unique", "check", "--fleet", "--json")
        assert result.returncode == 0, result.stderr
        found = json.loads(result.stdout)["findings"]
        assert [(f["id"], f["subject"].split("@")[0]) for f in found] == [
            ("celery_unique.W027", workers[1].name)
        ]
    finally:
        for worker in workers:
            worker.stop()
            worker.close()


def test_an_apps_entry_in_the_namespace_registry_counts_for_a_week(
    make_app: Callable[..., Celery], redis_url: str
) -> None:
    """Each check renews the app's entry: an app unchecked for a week no longer counts."""
    app = make_app()
    keyed(app)
    assert ids(app) == []
    client = redis.Redis.from_url(redis_url)
    try:
        left_ms = client.pttl(f"unique:apps:{{{app.conf.unique_namespace}}}")
    finally:
        client.close()
    week_ms = 7 * 24 * 3600 * 1000
    assert week_ms - 60_000 < left_ms <= week_ms
