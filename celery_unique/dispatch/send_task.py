"""``app.send_task`` of a unique task: its keys applied, never ignored.

``send_task`` never passes through ``Task.apply_async``, and a
``before_task_publish`` receiver cannot stop a message. So an app that has a
``UniqueTask`` bound gets a thin ``send_task`` wrapper:

* a name registered here as a ``UniqueTask`` that declares keys, or a call
  given uniqueness options, is decided exactly like ``delay()`` would be
  (same keys, receipt, errors), and then sent by Celery's own ``send_task``:
  it keeps every other trait of ``send_task`` (it never runs eagerly, for one);
* uniqueness options for a task that is not a ``UniqueTask`` registered here
  are refused with ``unsupported_combination``;
* any other call goes straight through, as do the calls Celery's own
  ``Task.apply_async`` makes;
* any message of the app, Celery's own included, that would start a chord
  whose body is unique is refused (:mod:`celery_unique.dispatch.chords`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery import Celery, signals

from celery_unique.checks import at_dispatch
from celery_unique.dispatch import chords
from celery_unique.exceptions import UnsupportedCombination
from celery_unique.options.declaration import DISPATCH_OPTIONS

logger = logging.getLogger("celery_unique")


def guard(app: Celery) -> None:
    """Wrap ``app.send_task`` once."""
    if getattr(app, "_celery_unique_guarded", False):
        return
    original = app.send_task

    @functools.wraps(original)
    def send_task(name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        # Every message of the app passes here, a chord's first among them.
        chords.refuse_unique_body(app, name, args, options)
        if options.get("task_type") is not None:
            # Celery's Task.apply_async sending a job it (or we) decided on.
            return original(name, args, kwargs, **options)
        given = any(option in options for option in DISPATCH_OPTIONS)
        task = app.tasks.get(name)
        declaration = getattr(task, "__unique__", None)
        if task is None or declaration is None:
            if given:
                raise UnsupportedCombination(
                    f"send_task({name!r}) was given uniqueness options, but {name!r} is not a "
                    "UniqueTask registered in this process, so they cannot be applied; "
                    "register the task here (or dispatch it through its signature) to "
                    "deduplicate it"
                )
            return original(name, args, kwargs, **options)
        if not (given or declaration.declares_keys):
            return original(name, args, kwargs, **options)
        at_dispatch.check_first_dispatch(task)
        from celery_unique.dispatch.apply import apply_unique

        def send(args: Any, kwargs: Any, **opts: Any) -> Any:
            return original(name, args, kwargs, **opts)

        producer = options.pop("producer", None)
        task_id = options.pop("task_id", None)
        link, link_error = options.pop("link", None), options.pop("link_error", None)
        # send_task never runs a job eagerly, even under task_always_eager.
        return apply_unique(
            task,
            send,
            args,
            kwargs,
            task_id,
            link,
            link_error,
            options,
            producer=producer,
            eager=False,
        )

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
    signals.before_task_publish.connect(
        at_dispatch.on_publish, weak=False, dispatch_uid="celery_unique.checks.first_publish"
    )


# Connected when the plugin is imported, not only by install(): an app whose tasks all
# forgot base=UniqueTask never binds a UniqueTask, and its leaked options and forgotten
# base are what these receivers report.
connect()
