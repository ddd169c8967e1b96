"""Hooking celery-unique into an app: the worker side, the ``send_task`` guard.

Binding any ``UniqueTask`` to an app does this; call :func:`install` yourself
for an app that only ever sends tasks by name (``send_task``) so that
uniqueness options given there are applied or refused even before any
``UniqueTask`` is bound.
"""

from __future__ import annotations

from celery import Celery

from celery_unique import worker
from celery_unique.dispatch import send_task


def install(app: Celery) -> None:
    """Hook in the worker side and guard ``app.send_task`` (idempotent)."""
    worker.install(app)
    send_task.connect()
    send_task.guard(app)
