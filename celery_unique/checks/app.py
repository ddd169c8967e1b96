"""Checks that read only the app: its tasks and its settings. They connect to nothing."""

from __future__ import annotations

from typing import Any

from celery_unique.checks.catalogue import Finding, finding, isolated
from celery_unique.config import configured_backend_url, setting
from celery_unique.config.durations import parse_duration_ms
from celery_unique.config.redelivery import visibility_timeout_s
from celery_unique.exceptions import UniquenessError
from celery_unique.options.declaration import declared
from celery_unique.stores import STORES, scheme_of
from celery_unique.stores.base import Scope
from celery_unique.stores.masking import masked
from celery_unique.stores.signing import configured_secret

#: AMQP transports: without publisher confirms, a publish returns once it is written.
_AMQP_TRANSPORTS = ("amqp", "amqps", "pyamqp")


def app_findings(app: Any) -> list[Finding]:
    """What the app's settings and tasks get wrong, in the order of the catalogue.

    Each check runs on its own: one that raises is reported (E013) beside the others.
    """
    url = configured_backend_url(app)
    findings = isolated("celery_unique.E001", "unique_backend", _backend, app, url=url)
    findings += isolated("celery_unique.E020", "tasks", _plain_tasks_with_options, app)
    if _has_unique_tasks(app):
        subject = "broker_transport_options"
        findings += isolated("celery_unique.W028", subject, _no_publisher_confirms, app)
    findings += isolated("celery_unique.W030", "unique_signing_key", _unsigned_arguments, app)
    marked = _marked_tasks(app)
    if marked:
        findings += isolated("celery_unique.W021", "unique_lease", _lease_shorter, app)
        findings += task_findings(app, marked)
    return findings


def task_findings(app: Any, marked: dict[str, Any]) -> list[Finding]:
    """The checks of single tasks that hold a key while they run (W022, W023)."""
    findings = isolated("celery_unique.W022", "tasks", _retention_past_results, app, marked)
    findings += isolated("celery_unique.W023", "tasks", _no_result_for_the_reaper, app, marked)
    return findings


def holds_key_while_running(task: Any) -> bool:
    """Whether the UniqueTask ``task`` holds an active-type key (declared, or given per
    dispatch) while its job runs: only such a key outlives a lost worker or release."""
    declaration = task.__unique__
    return (declaration.key is not None or declaration.overridable) and declaration.scope in (
        Scope.ACTIVE,
        Scope.EXISTS,
    )


def _backend(app: Any) -> list[Finding]:
    url = configured_backend_url(app)
    if url is None:
        return [
            finding(
                "celery_unique.E001",
                "unique_backend",
                "unique_backend is not set and the broker is not Redis: every unique "
                "dispatch fails",
            )
        ]
    if scheme_of(url) not in STORES:
        return [
            finding(
                "celery_unique.E001",
                "unique_backend",
                f"unique_backend = {masked(url)!r} is not a store URL with a known scheme",
            )
        ]
    return []


def _plain_tasks_with_options(app: Any) -> list[Finding]:
    return [
        found
        for name, task in sorted(app.tasks.items())
        if (found := plain_task_with_options(name, task)) is not None
    ]


def plain_task_with_options(name: str, task: Any) -> Finding | None:
    """E020 when ``task`` has ``unique_*`` options but is not a UniqueTask."""
    if declared(task) is not None:
        return None
    options = sorted(attr for attr in dir(type(task)) if attr.startswith("unique_"))
    if not options:
        return None
    return finding(
        "celery_unique.E020",
        name,
        f"task {name} has {', '.join(options)} but is not a UniqueTask: "
        "the options are ignored and every dispatch publishes",
        "declare it with base=UniqueTask (e.g. @app.task(base=UniqueTask, ...) or "
        "@shared_task(base=UniqueTask, ...)), or mix UniqueMixin into its class",
    )


def uses_celery_unique(app: Any) -> bool:
    """Whether ``app`` has anything of celery-unique: a unique_* setting, or a task that is
    a UniqueTask or has unique_* options."""
    from celery_unique.config import DEFAULTS

    if any(app.conf.get(name) is not None for name in DEFAULTS):
        return True
    return any(
        declared(task) is not None or plain_task_with_options(name, task) is not None
        for name, task in app.tasks.items()
    )


def _has_unique_tasks(app: Any) -> bool:
    return any(declared(task) is not None for task in app.tasks.values())


def _marked_tasks(app: Any) -> dict[str, Any]:
    """The app's unique tasks that hold a key while their job runs, by name."""
    return {
        name: task
        for name, task in sorted(app.tasks.items())
        if declared(task) is not None and holds_key_while_running(task)
    }


def _duration_ms(app: Any, name: str, value: object) -> int | None:
    try:
        return parse_duration_ms(value, name)
    except UniquenessError:
        return None  # Reported where it is read (the app refuses to start its store).


def _lease_shorter(app: Any) -> list[Finding]:
    """W021: the key of a job whose worker was lost lapses before the broker delivers it again."""
    timeout_s = visibility_timeout_s(app)
    if timeout_s is None:
        return []
    lease_ms = _duration_ms(app, "unique_lease", setting(app, "unique_lease"))
    if not lease_ms:
        return []  # No lease: keys are never freed by time.
    if lease_ms >= timeout_s * 1000:
        return []
    return [
        finding(
            "celery_unique.W021",
            "unique_lease",
            f"a job whose worker was lost is delivered again only after visibility_timeout "
            f"= {timeout_s:g} s, but its key lapses after unique_lease = {lease_ms / 1000:g} s: "
            "a new job can take the key meanwhile, and the job delivered again then finds "
            "its key taken",
            f"set unique_lease to at least {timeout_s:g} s (1.5 times that is safe: a waiting "
            "key may have only two thirds of its lease left), or lower "
            "broker_transport_options['visibility_timeout']",
        )
    ]


def _no_publisher_confirms(app: Any) -> list[Finding]:
    """W028: a RabbitMQ publish that returns although the broker never took the message."""
    broker = app.conf.broker_url or ""
    if not isinstance(broker, str) or scheme_of(broker).split("+")[0] not in _AMQP_TRANSPORTS:
        return []
    if (app.conf.broker_transport_options or {}).get("confirm_publish"):
        return []
    return [
        finding(
            "celery_unique.W028",
            "broker_transport_options",
            "the broker is RabbitMQ without publisher confirms: a message published as the "
            "broker stops or restarts can be lost without an error, and its key then stays "
            "with a job that never runs (dispatches are told reused) until the key's lease "
            "or window ends",
            "set broker_transport_options = {'confirm_publish': True}: a publish the broker "
            "did not take then fails, and its key is rolled back",
        )
    ]


def _unsigned_arguments(app: Any) -> list[Finding]:
    """W030: stored arguments signed with a key derived from the namespace alone."""
    url = configured_backend_url(app)
    if configured_secret(app) is not None or url is None or scheme_of(url) == "memory":
        return []  # A memory store lives in the process: nobody else writes it.
    following = [
        name
        for name, task in sorted(app.tasks.items())
        if (declaration := declared(task)) is not None and declaration.duplicates.follows
    ]
    if not following:
        return []
    return [
        finding(
            "celery_unique.W030",
            "unique_signing_key",
            f"{', '.join(following)} {'follows' if len(following) == 1 else 'follow'} "
            "duplicates (latest/debounce) but unique_signing_key is not set: the arguments "
            "a key keeps are signed with a key derived from the namespace, which anyone can "
            "derive, so whoever can write the store chooses the arguments they run with",
        )
    ]


def _retention_past_results(app: Any, marked: dict[str, Any]) -> list[Finding]:
    expires_ms = _duration_ms(app, "result_expires", app.conf.get("result_expires"))
    if not expires_ms:
        return []  # Results never expire.
    findings = []
    for name, task in marked.items():
        declaration = task.__unique__
        if declaration.scope is Scope.EXISTS and (declaration.retention_ms or 0) > expires_ms:
            findings.append(
                finding(
                    "celery_unique.W022",
                    name,
                    f"task {name} keeps its exists key {declaration.retention_ms / 1000:g} s "
                    f"after the job, but results expire after {expires_ms / 1000:g} s "
                    "(result_expires): the reaper cannot tell whether an old job finished",
                )
            )
    return findings


def _no_result_for_the_reaper(app: Any, marked: dict[str, Any]) -> list[Finding]:
    if type(app.backend).__name__ == "DisabledBackend":
        return [
            finding(
                "celery_unique.W023",
                "result_backend",
                f"the app has no result backend: the reaper cannot free the keys of "
                f"{', '.join(marked)} when a release is lost; they wait for the lease",
            )
        ]
    return [
        finding(
            "celery_unique.W023",
            name,
            f"task {name} ignores its result (ignore_result=True): the reaper cannot free "
            "its keys when a release is lost; they wait for the lease",
            "set ignore_result=False on the task, or accept the lease as the bound",
        )
        for name, task in marked.items()
        if task.ignore_result
    ]
