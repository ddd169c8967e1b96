"""Where keys are released: task lifecycle signals on the worker.

| scope  | released when                                                        |
|--------|----------------------------------------------------------------------|
| queued | the job starts (prerun), or ends without running (revoked, expired,  |
|        | rejected, unknown task, lost)                                        |
| active | the job reaches a final state: success, failure after its retries,  |
|        | revoked (before or while running), expired, rejected, worker lost   |
| exists | as active, then kept ``retention`` longer                            |

Signals fire in the pool child (prerun, postrun, failure) or in the worker's
main process (revoked, unknown, rejected, failure for a lost child or a hard
time limit), sometimes twice; every release is an idempotent
compare-and-delete on the job id, so that is harmless. Handlers are thin and
ignore jobs without a key header (sent by a producer without the plugin).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from celery import Celery, signals, states

from celery_unique.config import runtime
from celery_unique.headers import KeyHeader, read_header
from celery_unique.signals import ReleaseReason, emit_released
from celery_unique.stores.base import Scope

logger = logging.getLogger("celery_unique")

#: Final states a pool child reports in ``task_postrun``. ``RETRY`` keeps keys;
#: ``IGNORED`` is how ``replace()`` hands the job on under the same id.
_FINAL_STATES = frozenset({states.SUCCESS, states.FAILURE, states.REJECTED, states.REVOKED, None})

#: Headers of jobs the main process received, for the signals it sends without
#: the request (a lost child, a hard time limit). Bounded: entries of jobs that
#: finish in a child are never needed and age out.
_received: OrderedDict[str, tuple[Celery, KeyHeader]] = OrderedDict()
_RECEIVED_MAX = 65_536


def release(app: Celery, job_id: str, header: KeyHeader, *, finished: bool) -> None:
    """Release what the job's scope says to release at this point of its life."""
    key = header.get("a")
    if not key:
        return
    scope = header.get("s")
    if scope == Scope.QUEUED.value:
        keep: int | None = 0
    elif not finished:
        return
    elif scope == Scope.EXISTS.value:
        keep = header.get("r")
    else:
        keep = 0
    try:
        released = runtime(app).store.release(job_id, key, keep_ms=keep)
    except Exception:
        # A release that fails is covered by the key's lease; never fail the job for it.
        logger.warning("could not release key %r of job %s", key, job_id, exc_info=True)
        return
    if released:
        reason = ReleaseReason.FINISHED if finished else ReleaseReason.STARTED
        emit_released(app, job_id, key, reason=reason, kept=keep != 0)


def _app_of(*sources: Any) -> Celery | None:
    """The app of the first source that has one (a task, a request, a consumer)."""
    for source in sources:
        app = getattr(source, "app", None) or getattr(getattr(source, "task", None), "app", None)
        if app is not None:
            return app  # type: ignore[no-any-return]
    return None


def _on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    header = read_header(request)
    app = _app_of(request, sender)
    if header is None or request is None or app is None:
        return
    _received[request.id] = (app, header)
    if len(_received) > _RECEIVED_MAX:
        _received.popitem(last=False)


def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
    header = read_header(task.request) if task is not None else None
    if header is not None and task_id and header.get("s") == Scope.QUEUED.value:
        release(task.app, task_id, header, finished=False)


def _on_postrun(
    sender: Any = None, task_id: str | None = None, task: Any = None, state: Any = None, **_: Any
) -> None:
    if task is None or not task_id or state not in _FINAL_STATES:
        return
    header = read_header(task.request)
    if header is not None and header.get("s") != Scope.QUEUED.value:
        release(task.app, task_id, header, finished=True)


def _on_failure(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    # In a pool child postrun follows and releases; in the main process this is
    # the only word about a lost child or a hard time limit.
    if not task_id:
        return
    entry = _received.pop(task_id, None)
    if entry is not None:
        app, header = entry
        release(app, task_id, header, finished=True)


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    header = read_header(request)
    app = _app_of(sender, request)
    if header is not None and request is not None and app is not None:
        _received.pop(request.id, None)
        release(app, request.id, header, finished=True)


def _on_message_dropped(sender: Any = None, message: Any = None, **_: Any) -> None:
    """An unknown task or a rejected message: the job ends without running."""
    header = read_header(message)
    app = _app_of(sender)
    job_id = (getattr(message, "headers", None) or {}).get("id")
    if header is not None and app is not None and job_id:
        release(app, job_id, header, finished=True)


_HANDLERS = (
    (signals.task_received, _on_received),
    (signals.task_prerun, _on_prerun),
    (signals.task_postrun, _on_postrun),
    (signals.task_failure, _on_failure),
    (signals.task_revoked, _on_revoked),
    (signals.task_unknown, _on_message_dropped),
    (signals.task_rejected, _on_message_dropped),
)


def connect() -> None:
    """Connect every handler once (idempotent)."""
    for signal, handler in _HANDLERS:
        signal.connect(handler, weak=False, dispatch_uid=f"celery_unique.{handler.__name__}")


def disconnect() -> None:
    for signal, handler in _HANDLERS:
        signal.disconnect(handler, dispatch_uid=f"celery_unique.{handler.__name__}")
