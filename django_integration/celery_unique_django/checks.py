"""System checks (``manage.py check``) for celery-unique's settings and store.

They read the settings the Celery app will use (``app.conf``, fed by
``CELERY_UNIQUE_*`` through Celery's Django namespace) and connect to
nothing. The one check that reaches the store, ``ping``, is a deploy check
(``manage.py check --deploy``).

==================  =============================================================
id                  problem
==================  =============================================================
celery_unique.E001  ``unique_backend`` is not a URL with a known scheme
celery_unique.E002  ``django://<alias>`` names an alias DATABASES does not define
celery_unique.E003  the Django store is chosen but the app is not in INSTALLED_APPS
celery_unique.E004  the Django store's database is not PostgreSQL, MySQL or SQLite
celery_unique.E005  ``unique_fail_open`` is not True or False (or a string saying one)
celery_unique.E006  ``unique_lease`` is not a duration
celery_unique.E007  ``unique_namespace`` is not a usable name
celery_unique.E008  ``CELERY_UNIQUE_APP`` does not name a Celery app
celery_unique.E009  the store's client library is not installed
celery_unique.E010  the Django store is opened before django.setup()
celery_unique.E011  database routers keep the store's table off its database
celery_unique.E012  (deploy) the store cannot be used (and why), fail-closed
celery_unique.E013  a check could not finish (a task module does not import, ...)
celery_unique.E014  a task's ``unique_*`` options are malformed
celery_unique.W001  ``CELERY_UNIQUE_*`` settings the Celery app does not see
celery_unique.W012  (deploy) the store cannot be used (and why), fail-open
==================  =============================================================

E001 also covers a project with no store at all (``unique_backend`` not set
and a broker that is not Redis), as the library's own check does.

Every check of the library's own catalogue (:mod:`celery_unique.checks`:
tasks, the lease, the reaper's results; with ``--deploy``, the store's reach,
its eviction policy and the namespace it shares) runs here too, under its
own id. They see every task of the app: its task modules are imported first,
through the Celery app's loader, as a worker would (``manage.py check``
itself imports only what the URLs and models import).

The checks are registered when Django loads the app, and also whenever
``celery_unique_django`` code is imported (for E003, which can only fire when
the app is missing from INSTALLED_APPS).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from celery import Celery
from django.core.checks import CheckMessage, Error, Warning, register

from celery_unique.checks import Finding, app_findings, import_task_modules, store_findings
from celery_unique.config.booleans import WORDS, parse_bool
from celery_unique.exceptions import ImproperlyConfigured, UniquenessError
from celery_unique.stores import STORES
from celery_unique.stores.masking import masked
from celery_unique_django.conf import APP_SETTING, SETTINGS, celery_app, django_name, django_value

TAG = "celery_unique"

#: Client libraries a store scheme needs, and the extra that installs them.
_LIBRARIES = {"redis": "redis", "rediss": "redis", "unix": "redis"}
_NAMESPACE_BREAKERS = re.compile(r"[{}\x00-\x1f\x7f-\x9f]")
_MISSING = object()


def _app() -> tuple[Celery | None, list[CheckMessage]]:
    try:
        return celery_app(), []
    except UniquenessError as exc:
        return None, [
            Error(
                str(exc),
                hint=f"set {APP_SETTING} to 'proj.celery:app' (module:attribute) or remove it "
                "to use the current Celery app",
                id="celery_unique.E008",
            )
        ]


@register(TAG)
def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate ``CELERY_UNIQUE_BACKEND``/``_NAMESPACE``/``_FAIL_OPEN``/``_LEASE``."""
    app, messages = _app()
    if app is None:
        return messages
    messages += _unseen_settings(app)
    messages += _backend(app)
    fail_open = app.conf.get("unique_fail_open")
    if fail_open is not None and not _is_boolean(fail_open):
        messages.append(
            Error(
                f"{django_name(app, 'unique_fail_open')} must be True or False, not {fail_open!r}",
                hint="True publishes without uniqueness while the store is down; "
                "False (the default) refuses the dispatch; as a string, one of "
                f"{'/'.join(WORDS)}",
                id="celery_unique.E005",
            )
        )
    lease = app.conf.get("unique_lease")
    if not _is_duration(lease):
        messages.append(
            Error(
                f"{django_name(app, 'unique_lease')} must be a duration, not {lease!r}",
                hint="use a datetime.timedelta (e.g. timedelta(hours=1)) or a number of "
                "seconds >= 0; 0 disables the lease",
                id="celery_unique.E006",
            )
        )
    namespace = app.conf.get("unique_namespace")
    if namespace is not None and (
        not isinstance(namespace, str) or not namespace or _NAMESPACE_BREAKERS.search(namespace)
    ):
        messages.append(
            Error(
                f"{django_name(app, 'unique_namespace')} = {namespace!r} cannot name a key "
                "namespace",
                hint="use a non-empty string without braces or control characters, "
                "or leave it unset to use the app's name",
                id="celery_unique.E007",
            )
        )
    return messages


def _is_boolean(value: object) -> bool:
    try:
        parse_bool(value, "unique_fail_open")
    except ImproperlyConfigured:
        return False
    return True


def _is_duration(value: object) -> bool:
    if value is None or isinstance(value, timedelta):
        return value is None or value >= timedelta(0)
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _unseen_settings(app: Celery) -> list[CheckMessage]:
    """Django settings the Celery app does not read (not configured from settings.py)."""
    unseen = [
        django_name(app, name)
        for name in SETTINGS
        if (value := django_value(app, name, _MISSING)) is not _MISSING
        and app.conf.get(name) != value
    ]
    if not unseen:
        return []
    return [
        Warning(
            f"{', '.join(unseen)} {'is' if len(unseen) == 1 else 'are'} set in the Django "
            f"settings but the Celery app {app.main!r} does not see "
            f"{'it' if len(unseen) == 1 else 'them'}",
            hint="configure the app from the Django settings: "
            "app.config_from_object('django.conf:settings', namespace='CELERY'), "
            f"or name the right app in {APP_SETTING}",
            id="celery_unique.W001",
        )
    ]


def _backend(app: Celery) -> list[CheckMessage]:
    name = django_name(app, "unique_backend")
    url = app.conf.get("unique_backend")
    if url is None:
        broker = app.conf.broker_url or ""
        if isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss"):
            return []
        return [
            Error(
                f"{name} is not set and the broker is not Redis: every unique dispatch fails",
                hint=f"set {name}, e.g. 'django://' (this project's database), "
                "'redis://localhost:6379/0' or 'sqlite:///unique.db'",
                id="celery_unique.E001",
            )
        ]
    scheme = url.split("://", 1)[0].lower() if isinstance(url, str) and "://" in url else None
    shown = repr(masked(url)) if isinstance(url, str) else repr(url)
    if scheme not in STORES:
        known = ", ".join(f"{each}://" for each in STORES)
        return [
            Error(
                f"{name} = {shown} is not a store URL with a known scheme",
                hint=f"use one of: {known}",
                id="celery_unique.E001",
            )
        ]
    library = _LIBRARIES.get(scheme)
    if library is not None and importlib.util.find_spec(library) is None:
        return [
            Error(
                f"{name} = {shown} needs the {library!r} package, which is not installed",
                hint=f"pip install 'celery-unique[{library}]'",
                id="celery_unique.E009",
            )
        ]
    if scheme == "django":
        return _django_store(str(url))
    return []


def _django_store(url: str) -> list[CheckMessage]:
    from django.db import router

    from celery_unique_django.store import alias_of, misconfiguration

    alias = alias_of(url)
    problem = misconfiguration(alias)
    if problem is not None:
        return [Error(problem.msg, hint=problem.hint, id=problem.id)]
    from celery_unique_django.models import UniqueKey

    if not router.allow_migrate_model(alias, UniqueKey):
        return [
            Error(
                f"the uniqueness store is django://{alias} but the database routers do not "
                f"allow the {UniqueKey._meta.label} table on {alias!r}: migrate will never "
                "create it",
                hint=f"let allow_migrate() return True for app_label 'celery_unique' on "
                f"{alias!r}, or point the store at the database that holds the table",
                id="celery_unique.E011",
            )
        ]
    return []


@register(TAG)
def check_tasks(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """The library's own checks of the app's tasks and settings (it connects to nothing)."""
    app, _ = _app()
    if app is None:
        return []  # check_settings reports E008.
    with _checks_not_nested():
        findings = import_task_modules(app)
    # check_settings reports the store's URL (E001) with the Django setting's name.
    findings += [each for each in app_findings(app) if each.id != "celery_unique.E001"]
    return [_message(each) for each in findings]


@contextmanager
def _checks_not_nested() -> Iterator[None]:
    """Keep Celery's Django fixup from running every system check as it imports the task
    modules: they are running already (and this check is one of them)."""
    if os.environ.get("CELERY_SKIP_CHECKS"):
        yield
        return
    os.environ["CELERY_SKIP_CHECKS"] = "1"
    try:
        yield
    finally:
        del os.environ["CELERY_SKIP_CHECKS"]


@register(TAG, deploy=True)
def check_store_reachable(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """(deploy) The configured store answers, keeps its keys, and has the namespace alone."""
    app, _ = _app()
    if app is None or any(m.is_serious() for m in check_settings()):
        return []  # The settings are wrong or missing: check_settings says so already.
    return [_message(each) for each in store_findings(app)]


def _message(finding: Finding) -> CheckMessage:
    kind = Error if finding.is_error else Warning
    return kind(finding.message, hint=finding.hint, obj=finding.subject, id=finding.id)
