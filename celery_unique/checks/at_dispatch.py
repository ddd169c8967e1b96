"""The checks a producer runs at a task's first dispatch in its process.

Only the checks of the task alone: they read its declaration and its app's
settings, never the store, and leave the app-wide ones to ``unique check``
and the starting worker. Each task is checked once per process, its findings
logged once; every later dispatch costs a set lookup.

* :func:`on_publish` (a ``before_task_publish`` receiver): a task with
  ``unique_*`` options that is not a UniqueTask (E020), at its first publish.
  Its app may have no UniqueTask at all, so nothing else of the plugin runs
  for it.
* :func:`check_first_dispatch` (called by ``UniqueTask.apply_async``): a
  UniqueTask whose keys the reaper cannot free (W022, W023).
"""

from __future__ import annotations

import weakref
from typing import Any

from celery import _state

from celery_unique.checks.app import holds_key_while_running, plain_task_with_options, task_findings
from celery_unique.checks.at_start import log_findings

#: Names of the tasks published in this process (whatever their class), up to
#: ``MAX_REMEMBERED``: an app that publishes ever new names (``send_task`` of names
#: made at run time) must not grow it for ever. Past that it starts again, and a
#: name is checked (its finding logged) once more.
_published: set[str] = set()
MAX_REMEMBERED = 10_000
#: The UniqueTasks dispatched in this process: task objects, as two apps may share a name.
_dispatched: weakref.WeakSet[Any] = weakref.WeakSet()


def on_publish(sender: Any = None, **_: Any) -> None:
    """Log E020 the first time this process publishes a task that forgot ``base=UniqueTask``."""
    if sender in _published:
        return
    if len(_published) >= MAX_REMEMBERED:
        _published.clear()
    _published.add(sender)
    for task in _tasks_named(sender):
        found = plain_task_with_options(sender, task)
        if found is not None:
            log_findings([found])
            return


def check_first_dispatch(task: Any) -> None:
    """Log the findings about UniqueTask ``task`` alone, at its first dispatch here."""
    if task in _dispatched:
        return
    _dispatched.add(task)
    if holds_key_while_running(task):
        log_findings(task_findings(task.app, {task.name: task}))


def _tasks_named(name: object) -> list[Any]:
    """The tasks of that name, in every finalized app of this process.

    The signal names the task only: any app may be the one publishing it.
    """
    if not isinstance(name, str):
        return []
    # Only finalized apps: reading the tasks of another one would finalize it.
    apps = [app for app in _state._get_active_apps() if app.finalized]  # type: ignore[attr-defined]
    return [app.tasks[name] for app in apps if name in app.tasks]
