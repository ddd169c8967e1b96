"""The checks that read only the app (its settings and tasks): which settings each finds
wrong, on which brokers, with which message; and the apps and tasks left alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_unique import UniqueTask
from celery_unique import config as unique_config
from celery_unique.checks import app_findings
from celery_unique.checks.at_start import check_at_worker_start
from celery_unique.checks.catalogue import Finding


def noop() -> None: ...


@pytest.fixture
def make_app() -> Iterator[Callable[..., Celery]]:
    """Apps on the memory store with a result backend: a correct app has no finding."""
    apps: list[Celery] = []

    def make(**settings: Any) -> Celery:
        app = Celery("checked", set_as_current=False)
        app.conf.update(
            {
                "broker_url": "memory://",
                "result_backend": "cache+memory://",
                "unique_backend": "memory://",
                **settings,
            }
        )
        app.finalize()
        # Tasks another test of this process declared shared (Celery's default) are
        # added to every app as it is finalized: they are not this app's to check.
        for name in [name for name in app.tasks if not name.startswith("celery.")]:
            del app.tasks[name]
        apps.append(app)
        return app

    yield make
    for app in apps:
        unique_config.reset(app)
        app.close()


def unique(app: Celery, name: str = "keyed", **options: Any) -> Any:
    """A UniqueTask holding an active key (more options override)."""
    declared = {"unique_key": "all", "unique_while": "active", **options}
    return app.task(base=UniqueTask, name=name, shared=False, **declared)(noop)


def found(app: Celery, check_id: str | None = None) -> list[Finding]:
    return [each for each in app_findings(app) if check_id is None or each.id == check_id]


def test_a_correct_app_has_no_finding(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    unique(app)
    assert found(app) == []


def test_no_store_url_is_e001(make_app: Callable[..., Celery]) -> None:
    app = make_app(unique_backend=None)
    unique(app)
    [e001] = found(app, "celery_unique.E001")
    assert (e001.subject, e001.message) == (
        "unique_backend",
        "unique_backend is not set and the broker is not Redis: every unique dispatch fails",
    )


def test_a_store_url_of_no_known_scheme_is_e001_its_password_masked(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(unique_backend="mongodb://user:hunter2@db:27017/x")
    [e001] = found(app)
    assert (e001.id, e001.subject, e001.message) == (
        "celery_unique.E001",
        "unique_backend",
        "unique_backend = 'mongodb://user:***@db:27017/x' is not a store URL with a known scheme",
    )


def test_plain_tasks_with_unique_options_are_e020_in_name_order(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    app.task(name="zeta", shared=False, unique_while="active", unique_key="all")(noop)
    app.task(name="alpha", shared=False, unique_key="all")(noop)
    app.task(name="plain", shared=False)(noop)
    e020 = found(app)
    assert [(each.id, each.subject) for each in e020] == [
        ("celery_unique.E020", "alpha"),
        ("celery_unique.E020", "zeta"),
    ]
    assert e020[1].message == (
        "task zeta has unique_key, unique_while but is not a UniqueTask: "
        "the options are ignored and every dispatch publishes"
    )
    assert e020[1].hint == (
        "declare it with base=UniqueTask (e.g. @app.task(base=UniqueTask, ...) or "
        "@shared_task(base=UniqueTask, ...)), or mix UniqueMixin into its class"
    )


@pytest.mark.parametrize(
    "broker", ["redis://localhost:6379/0", "rediss://localhost:6379/0", "sentinel://h:26379",
               "sqs://", "redis+socket:///tmp/redis.sock"]
)  # fmt: skip
def test_a_lease_shorter_than_the_redelivery_window_is_w021(
    make_app: Callable[..., Celery], broker: str
) -> None:
    app = make_app(broker_url=broker, unique_lease=60)
    unique(app)
    [w021] = found(app, "celery_unique.W021")
    assert (w021.subject, w021.message, w021.hint) == (
        "unique_lease",
        "a job whose worker was lost is delivered again only after visibility_timeout = 3600 s, "
        "but its key lapses after unique_lease = 60 s: a new job can take the key meanwhile, "
        "and the job delivered again then finds its key taken",
        "set unique_lease to at least 3600 s (1.5 times that is safe: a waiting key may have "
        "only two thirds of its lease left), or lower broker_transport_options"
        "['visibility_timeout']",
    )


@pytest.mark.parametrize(
    ("lease", "options", "warns"),
    [
        (3600, {}, False),
        (3599.999, {}, True),
        (300, {"visibility_timeout": 300}, False),
        (299.5, {"visibility_timeout": 300}, True),
        (0, {}, False),
        ("forever", {}, False),
    ],
)
def test_w021_compares_the_lease_with_the_visibility_timeout(
    make_app: Callable[..., Celery], lease: object, options: dict[str, Any], warns: bool
) -> None:
    """A lease as long as the timeout is enough; no lease never lapses; a lease that does
    not parse is reported where it is read, not here."""
    app = make_app(
        broker_url="redis://localhost:6379/0", unique_lease=lease, broker_transport_options=options
    )
    unique(app)
    assert [each.id for each in found(app) if each.subject == "unique_lease"] == (
        ["celery_unique.W021"] if warns else []
    )


def test_w021_tells_the_timeout_and_lease_it_compared(make_app: Callable[..., Celery]) -> None:
    app = make_app(
        broker_url="redis://localhost:6379/0",
        unique_lease=1.5,
        broker_transport_options={"visibility_timeout": "90"},
    )
    unique(app)
    [w021] = found(app, "celery_unique.W021")
    assert "visibility_timeout = 90 s, but its key lapses after unique_lease = 1.5 s" in (
        w021.message
    )
    assert w021.hint.startswith("set unique_lease to at least 90 s")


@pytest.mark.parametrize(
    "broker", ["memory://", "amqp://localhost//", ["redis://a:6379/0", "redis://b:6379/0"]]
)
def test_w021_only_where_the_broker_redelivers_after_the_visibility_timeout(
    make_app: Callable[..., Celery], broker: object
) -> None:
    app = make_app(
        broker_url=broker, unique_lease=60, broker_transport_options={"confirm_publish": True}
    )
    unique(app)
    assert found(app) == []


def test_w021_only_for_tasks_that_hold_a_key_while_they_run(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(broker_url="redis://localhost:6379/0", unique_lease=60)
    unique(app, unique_while="queued")
    assert found(app) == []
    unique(app, name="overridable", unique_key=None, unique_overridable=True)
    assert [each.id for each in found(app)] == ["celery_unique.W021"]


def test_a_visibility_timeout_that_is_no_number_leaves_w021_unfinished(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(
        broker_url="redis://localhost:6379/0",
        unique_lease=60,
        broker_transport_options={"visibility_timeout": "an hour"},
    )
    unique(app)
    [e013] = found(app)
    assert (e013.id, e013.subject) == ("celery_unique.E013", "unique_lease")
    assert e013.message.startswith("the check for celery_unique.W021 could not finish")


@pytest.mark.parametrize("broker", ["amqp://h//", "amqps://h//", "pyamqp://h//", "AMQP://h//"])
def test_an_amqp_broker_without_publisher_confirms_is_w028(
    make_app: Callable[..., Celery], broker: str
) -> None:
    app = make_app(broker_url=broker, broker_transport_options={"confirm_publish": False})
    unique(app, unique_while="queued")
    [w028] = found(app)
    assert (w028.id, w028.subject) == ("celery_unique.W028", "broker_transport_options")
    assert w028.message.startswith("the broker is RabbitMQ without publisher confirms")
    assert w028.hint.startswith("set broker_transport_options = {'confirm_publish': True}")


def test_w028_only_for_an_app_with_unique_tasks(make_app: Callable[..., Celery]) -> None:
    app = make_app(broker_url="amqp://h//")
    assert found(app) == []
    app.task(name="plain", shared=False)(noop)
    assert found(app) == []


def test_w028_options_that_are_no_mapping_leave_it_unfinished(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(broker_url="amqp://h//", broker_transport_options=["confirm_publish"])
    unique(app, unique_while="queued")
    [e013] = found(app)
    assert (e013.id, e013.subject) == ("celery_unique.E013", "broker_transport_options")
    assert e013.message.startswith("the check for celery_unique.W028 could not finish")


@pytest.mark.parametrize("store", ["sqlite:///{}/keys.db", "django://", "redis://db:6379/0"])
def test_w030_names_the_tasks_that_follow_duplicates_without_a_signing_key(
    make_app: Callable[..., Celery], tmp_path: Any, store: str
) -> None:
    """On any store but the memory one, which nothing outside the process can write."""
    app = make_app(unique_backend=store.format(tmp_path))
    unique(app, name="reuses")
    unique(app, name="zeta", unique_on_duplicate="latest")
    [one] = found(app)
    assert (one.id, one.subject) == ("celery_unique.W030", "unique_signing_key")
    assert one.message.startswith("zeta follows duplicates (latest/debounce) but ")
    unique(app, name="alpha", unique_on_duplicate="latest")
    [two] = found(app)
    assert two.message.startswith("alpha, zeta follow duplicates (latest/debounce) but ")
    assert two.message.endswith(
        "unique_signing_key is not set: the arguments a key keeps are signed with a key "
        "derived from the namespace, which anyone can derive, so whoever can write the store "
        "chooses the arguments they run with"
    )


def test_w030_not_without_a_store_url(make_app: Callable[..., Celery]) -> None:
    app = make_app(unique_backend=None)
    unique(app, unique_on_duplicate="latest")
    assert [each.id for each in found(app)] == ["celery_unique.E001"]


@pytest.mark.parametrize(
    ("retention", "warns"), [(7200, True), (3600.001, True), (3600, False), (60, False)]
)
def test_an_exists_key_kept_past_the_results_is_w022(
    make_app: Callable[..., Celery], retention: float, warns: bool
) -> None:
    app = make_app(result_expires=3600)
    unique(app, unique_while="exists", unique_retention=retention)
    assert [each.id for each in found(app)] == (["celery_unique.W022"] if warns else [])


def test_w022_tells_the_retention_and_the_expiry(make_app: Callable[..., Celery]) -> None:
    app = make_app(result_expires=90)
    unique(app, name="zeta", unique_while="exists", unique_retention=120.5)
    unique(app, name="alpha", unique_while="exists", unique_retention=91)
    w022 = found(app)
    assert [(each.id, each.subject) for each in w022] == [
        ("celery_unique.W022", "alpha"),
        ("celery_unique.W022", "zeta"),
    ]
    assert w022[1].message == (
        "task zeta keeps its exists key 120.5 s after the job, but results expire after "
        "90 s (result_expires): the reaper cannot tell whether an old job finished"
    )


@pytest.mark.parametrize("expires", [None, 0, -5])
def test_w022_not_when_results_do_not_expire(
    make_app: Callable[..., Celery], expires: object
) -> None:
    app = make_app(result_expires=expires)
    unique(app, unique_while="exists", unique_retention=7200)
    assert found(app) == []


def test_w022_only_for_exists_keys(make_app: Callable[..., Celery]) -> None:
    app = make_app(result_expires=60)
    unique(app, unique_while="active", unique_window=7200)
    assert found(app) == []


def test_without_a_result_backend_w023_names_every_task_holding_a_key(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(result_backend="disabled")
    unique(app, name="zeta")
    unique(app, name="alpha", unique_while="exists")
    unique(app, name="queued", unique_while="queued")
    [w023] = found(app)
    assert (w023.id, w023.subject, w023.message) == (
        "celery_unique.W023",
        "result_backend",
        "the app has no result backend: the reaper cannot free the keys of alpha, zeta when "
        "a release is lost; they wait for the lease",
    )


def test_a_task_ignoring_its_result_is_w023(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    unique(app, name="zeta", ignore_result=True)
    unique(app, name="alpha", ignore_result=True)
    unique(app, name="kept")
    w023 = found(app)
    assert [(each.id, each.subject) for each in w023] == [
        ("celery_unique.W023", "alpha"),
        ("celery_unique.W023", "zeta"),
    ]
    assert (w023[0].message, w023[0].hint) == (
        "task alpha ignores its result (ignore_result=True): the reaper cannot free its keys "
        "when a release is lost; they wait for the lease",
        "set ignore_result=False on the task, or accept the lease as the bound",
    )


def test_a_result_backend_that_cannot_be_loaded_leaves_w023_unfinished(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(result_backend="nonsense://")
    unique(app)
    [e013] = found(app)
    assert (e013.id, e013.subject) == ("celery_unique.E013", "tasks")
    assert e013.message.startswith("the check for celery_unique.W023 could not finish")


def test_a_setting_alone_is_use_of_the_plugin_at_worker_start(
    make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture
) -> None:
    """An app with a unique_* setting and no unique task is checked as a worker starts."""
    with caplog.at_level("WARNING", logger="celery_unique"):
        check_at_worker_start(make_app(unique_backend="mongodb://db"))
    assert [record.getMessage().split()[0] for record in caplog.records] == ["celery_unique.E001"]
