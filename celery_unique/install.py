"""Hooking celery-unique into an app: signals for release, the ``send_task`` guard.

Binding any ``UniqueTask`` to an app does this; call :func:`install` yourself
for an app that only ever sends tasks by name (``send_task``) so that
uniqueness options given there are applied or refused even before any
``UniqueTask`` is bound.
"""

from __future__ import annotations

from celery import Celery

from celery_unique import leases, lifecycle, send_task


def install(app: Celery) -> None:
    """Connect the lifecycle and lease signal handlers, guard ``app.send_task`` (idempotent)."""
    lifecycle.connect()
    leases.connect()
    send_task.connect()
    send_task.guard(app)
