"""Tasks that are not unique but carry a job's key are stopped before their body too.

A unique job can go on in another task: its replacement (``replace()``), the
last task of a replacement chain. That task's message carries the job's key
and its run marks the key like any other (see :mod:`celery_unique.worker.runs`),
but it is not a ``UniqueTask``, whose ``__call__`` stops a stale copy before
its body. So when a worker starts, before its pool forks, the ``run`` of every
other task of the app is wrapped: before the body it raises what the run's
mark decided, if anything (:class:`~celery_unique.worker.runs.Stale`: the key
moved on to another job; :class:`~celery_unique.worker.runs.Deferred`:
another delivery of the job runs, and this copy was sent again for later).
A task without the key header pays one attribute lookup.

A pool whose children do not fork from the worker (``spawn``) rebuilds its
tasks unwrapped: their stale copies run, and the worker says so.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_unique.worker import runs

logger = logging.getLogger("celery_unique")

#: The request field carrying what stops a run before its body.
STOP_FIELD = "celery_unique_stop"
#: Set on a task whose ``run`` is wrapped.
_GUARDED = "_celery_unique_guarded"


def guard_tasks(app: Celery) -> None:
    """Wrap the ``run`` of every task of ``app`` that does not stop its own copies."""
    for name, task in list(app.tasks.items()):
        if getattr(task, "_marks_runs", False) or getattr(task, _GUARDED, False):
            continue
        if name.startswith("celery."):
            continue  # Celery's own (chord unlock, backend cleanup): never a job's key
        task.run = _guarded(task, task.run)  # type: ignore[method-assign]  # the instance's own
        setattr(task, _GUARDED, True)


def _guarded(task: Any, run: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        request = task.request
        stop = getattr(request, STOP_FIELD, None)
        if stop is not None:
            setattr(request, STOP_FIELD, None)
            raise stop
        return run(*args, **kwargs)

    return guarded


def _on_prerun(sender: Any = None, task: Any = None, **_: Any) -> None:
    # Unique tasks mark their key in __call__. Any other task carrying the header
    # marks it here; a guarded one is stopped before its body when it must be.
    task = task if task is not None else sender
    if task is None or getattr(task, "_marks_runs", False):
        return
    stoppable = getattr(task, _GUARDED, False)
    try:
        begun = runs.begin(task)
    except runs.StoreSilent as silent:
        if stoppable:
            setattr(task.request, STOP_FIELD, runs.defer(task, silent))
            return
        logger.warning(
            "job %s runs unmarked: the uniqueness store did not answer, and task %s cannot "
            "be stopped before its body: %s",
            task.request.id,
            task.name,
            silent,
        )
        return
    if stoppable:
        setattr(task.request, STOP_FIELD, runs.stop_before_body(task, begun))
        return
    if begun.holder is not None:
        why = f"its key is held by job {begun.holder} now"
    elif begun.busy_ms is not None:
        why = "another delivery of it runs on a live worker"
    else:
        return
    logger.warning(
        "job %s runs although %s: task %s cannot be stopped before its body",
        task.request.id,
        why,
        task.name,
    )


def connect() -> None:
    from celery import signals

    signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="celery_unique.guard.prerun")
