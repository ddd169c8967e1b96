"""``app.send_task`` with uniqueness options: applied or refused, never ignored.

``send_task`` never passes through ``Task.apply_async``, and a
``before_task_publish`` receiver cannot stop a message. So an app that has a
``UniqueTask`` bound gets a thin ``send_task`` wrapper: a call carrying
uniqueness options is routed through the registered task's ``apply_async``
(which applies them), or refused when the task is not a ``UniqueTask``
registered in this process. Calls without such options go straight through.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery import Celery, signals

from celery_unique.declaration import DISPATCH_OPTIONS
from celery_unique.exceptions import UnsupportedCombination

logger = logging.getLogger("celery_unique")


def guard(app: Celery) -> None:
    """Wrap ``app.send_task`` once."""
    if getattr(app, "_celery_unique_guarded", False):
        return
    original = app.send_task

    @functools.wraps(original)
    def send_task(name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        if not any(option in options for option in DISPATCH_OPTIONS):
            return original(name, args, kwargs, **options)
        task = app.tasks.get(name)
        if task is None or not hasattr(task, "__unique__"):
            raise UnsupportedCombination(
                f"send_task({name!r}) was given uniqueness options, but {name!r} is not a "
                "UniqueTask registered in this process, so they cannot be applied; register "
                "the task here (or dispatch it through its signature) to deduplicate it"
            )
        return task.apply_async(args, kwargs, **options)

    app.send_task = send_task  # type: ignore[method-assign,assignment]
    app._celery_unique_guarded = True  # type: ignore[attr-defined]


def _warn_on_leak(sender: Any = None, properties: Any = None, **_: Any) -> None:
    # Last line of defence for apps without any UniqueTask bound: the message is
    # already going (a receiver cannot stop it), so at least say so loudly.
    leaked = sorted(set(DISPATCH_OPTIONS) & set(properties or ()))
    if leaked:
        logger.error(
            "task %s was published with uniqueness options %s that were NOT applied: "
            "send_task bypasses UniqueTask; dispatch through the task or a signature",
            sender,
            ", ".join(leaked),
        )


def connect() -> None:
    signals.before_task_publish.connect(
        _warn_on_leak, weak=False, dispatch_uid="celery_unique.send_task_leak"
    )
