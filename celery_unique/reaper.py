"""The orphan reaper as a periodic task.

``celery_unique.operations.reap`` frees active keys whose job is provably
gone (a final state in the result backend); expired leases free themselves.
Register it on your app and schedule it with beat::

    from celery_unique.reaper import register_reaper

    reap = register_reaper(app)
    app.conf.beat_schedule = {
        "celery-unique-reap": {"task": reap.name, "schedule": 300.0},
    }

The same runs from the command line as ``celery -A proj unique reap --apply``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from celery_unique.operations import reap

TASK_NAME = "celery_unique.reap"


def register_reaper(app: Celery, name: str = TASK_NAME) -> Task[Any, Any]:
    """Register (once) a task that reaps orphaned keys of ``app``; returns it."""
    if name in app.tasks:
        existing: Task[Any, Any] = app.tasks[name]
        return existing

    @app.task(name=name, shared=False, ignore_result=False)
    def reap_orphans() -> dict[str, Any]:
        return reap(app, apply=True).as_dict()

    return reap_orphans
