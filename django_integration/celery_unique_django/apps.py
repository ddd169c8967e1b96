"""The Django app: ``INSTALLED_APPS = [..., "celery_unique_django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryUniqueConfig(AppConfig):
    name = "celery_unique_django"
    #: Tables, permissions and migrations live under this label: ``migrate celery_unique``.
    label = "celery_unique"
    verbose_name = "Celery unique"
    # Pinned, so the shipped migrations never depend on the host's DEFAULT_AUTO_FIELD.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery_unique.stores import signing
        from celery_unique_django import checks  # noqa: F401  (registers the system checks)
        from celery_unique_django.conf import secret_key

        signing.use_default_secret(secret_key)
