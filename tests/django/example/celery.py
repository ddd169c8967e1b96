"""The example project's Celery app, configured entirely from settings.py.

A real project also sets ``DJANGO_SETTINGS_MODULE`` here and imports this
module from ``proj/__init__.py``; the tests configure Django themselves and
name the app in ``CELERY_UNIQUE_APP`` instead.
"""

from __future__ import annotations

from celery import Celery

app = Celery("example")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
