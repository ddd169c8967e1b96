"""Checks that read only the app: its tasks and its settings. They connect to nothing."""

from __future__ import annotations

from typing import Any

from kombu.utils.url import maybe_sanitize_url

from celery_unique.checks.catalogue import Finding, finding
from celery_unique.config import configured_backend_url, setting
from celery_unique.durations import parse_duration_ms
from celery_unique.exceptions import UniquenessError
from celery_unique.stores import STORES, scheme_of
from celery_unique.stores.base import Scope

#: Transports that deliver an unacknowledged message again after ``visibility_timeout``.
_VISIBILITY_TRANSPORTS = ("redis", "rediss", "sentinel", "sqs")
#: Celery's ``visibility_timeout`` when ``broker_transport_options`` does not set one.
DEFAULT_VISIBILITY_TIMEOUT_S = 3600.0


def app_findings(app: Any) -> list[Finding]:
    """What the app's settings and tasks get wrong, in the order of the catalogue."""
    findings = _backend(app)
    findings += _plain_tasks_with_options(app)
    # Only keys held while the job can run outlive a lost worker or release.
    marked = {
        name: task
        for name, task in _unique_tasks(app).items()
        if task.__unique__.scope in (Scope.ACTIVE, Scope.EXISTS)
    }
    if marked:
        findings += _lease_shorter_than_redelivery(app)
        findings += _retention_past_results(app, marked)
        findings += _no_result_for_the_reaper(app, marked)
    return findings


def masked(url: str) -> str:
    return str(maybe_sanitize_url(url))


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
    from celery_unique.task import UniqueMixin

    findings = []
    for name, task in sorted(app.tasks.items()):
        if isinstance(task, UniqueMixin):
            continue
        options = sorted(attr for attr in dir(type(task)) if attr.startswith("unique_"))
        if options:
            findings.append(
                finding(
                    "celery_unique.E020",
                    name,
                    f"task {name} has {', '.join(options)} but is not a UniqueTask: "
                    "the options are ignored and every dispatch publishes",
                    "declare it with base=UniqueTask (e.g. @app.task(base=UniqueTask, ...) or "
                    "@shared_task(base=UniqueTask, ...)), or mix UniqueMixin into its class",
                )
            )
    return findings


def _unique_tasks(app: Any) -> dict[str, Any]:
    """The app's unique tasks that hold an active-type key (declared, or given per dispatch)."""
    from celery_unique.task import UniqueMixin

    return {
        name: task
        for name, task in sorted(app.tasks.items())
        if isinstance(task, UniqueMixin)
        and (task.__unique__.key is not None or task.__unique__.overridable)
    }


def _duration_ms(app: Any, name: str, value: object) -> int | None:
    try:
        return parse_duration_ms(value, name)
    except UniquenessError:
        return None  # Reported where it is read (the app refuses to start its store).


def _lease_shorter_than_redelivery(app: Any) -> list[Finding]:
    broker = app.conf.broker_url or ""
    if not isinstance(broker, str) or scheme_of(broker).split("+")[0] not in _VISIBILITY_TRANSPORTS:
        return []
    lease_ms = _duration_ms(app, "unique_lease", setting(app, "unique_lease"))
    if not lease_ms:
        return []  # No lease: keys are never freed by time.
    options = app.conf.broker_transport_options or {}
    timeout_s = float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT_S))
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


def _retention_past_results(app: Any, marked: dict[str, Any]) -> list[Finding]:
    expires_ms = _duration_ms(app, "result_expires", app.conf.get("result_expires"))
    if not expires_ms:
        return []  # Results never expire.
    findings = []
    for name, task in marked.items():
        declared = task.__unique__
        if declared.scope is Scope.EXISTS and (declared.retention_ms or 0) > expires_ms:
            findings.append(
                finding(
                    "celery_unique.W022",
                    name,
                    f"task {name} keeps its exists key {declared.retention_ms / 1000:g} s "
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
