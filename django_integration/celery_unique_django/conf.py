"""Which Celery app a Django project dispatches with, and where its settings come from.

celery-unique reads its settings from the Celery app (``app.conf``). A Django
project loads them from ``settings.py`` the usual way::

    app.config_from_object("django.conf:settings", namespace="CELERY")

so ``CELERY_UNIQUE_BACKEND`` is the app's ``unique_backend``, and so on. The
admin, the management commands and the system checks work on that app: the
one named by the Django setting ``CELERY_UNIQUE_APP`` (``"proj.celery:app"``)
when it is set, else ``celery.current_app`` (the app the project's
``proj/__init__.py`` imports, as Celery's Django guide sets it up).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from django.conf import settings

from celery_unique.exceptions import ImproperlyConfigured

#: The celery-unique settings, by their name in the Celery configuration.
SETTINGS = (
    "unique_backend",
    "unique_namespace",
    "unique_fail_open",
    "unique_lease",
    "unique_strict_checks",
    "unique_signing_key",
)

#: The Django setting naming the Celery app, read directly (not through Celery).
APP_SETTING = "CELERY_UNIQUE_APP"


def celery_app(path: object = None) -> Celery:
    """The Celery app of this Django project: ``path`` (``"proj.celery:app"``), else the one
    ``CELERY_UNIQUE_APP`` names, else the current app."""
    source = "--app" if path is not None else APP_SETTING
    if path is None:
        path = getattr(settings, APP_SETTING, None)
    if path is None:
        from celery import current_app

        app: Celery = current_app._get_current_object()  # type: ignore[attr-defined]
        return app
    if isinstance(path, Celery):
        return path
    if not isinstance(path, str):
        raise ImproperlyConfigured(
            f"{source} must be a dotted path such as 'proj.celery:app', not {path!r}"
        )
    from celery.utils.imports import symbol_by_name

    try:
        found = symbol_by_name(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ImproperlyConfigured(f"{source} = {path!r} cannot be imported: {exc}") from exc
    if not isinstance(found, Celery):
        raise ImproperlyConfigured(
            f"{source} = {path!r} names a {type(found).__name__}, not a Celery app"
        )
    return found


def django_name(app: Celery, name: str) -> str:
    """The Django setting that feeds the Celery setting ``name`` (``CELERY_UNIQUE_BACKEND``)."""
    namespace = getattr(app, "namespace", None) or "CELERY"
    return f"{namespace}_{name}".upper()


def django_value(app: Celery, name: str, default: Any = None) -> Any:
    """The value of that Django setting, or ``default`` when the project does not set it."""
    return getattr(settings, django_name(app, name), default)


def secret_key(app: Celery) -> str | bytes | None:
    """``SECRET_KEY``, the secret ``app``'s stored arguments are signed with when its
    ``unique_signing_key`` is unset, if ``app`` is configured from the Django settings;
    else ``None`` (another app in the process shares nothing with this project)."""
    # Celery keeps what config_from_object() was given; no public name reads it back.
    source = getattr(app, "_config_source", None)
    if source != "django.conf:settings" and source is not settings:
        return None
    return getattr(settings, "SECRET_KEY", None) or None
