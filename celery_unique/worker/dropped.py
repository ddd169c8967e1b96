"""Messages the worker drops before they become a request: their keys go with them.

A message naming a task the worker does not know (``task_unknown``), or one
it cannot read as a task (``task_rejected``), is rejected without being
requeued and never runs. These signals fire in the worker's main process,
once the reject has been asked for; they are the only word about such a
message, and they are unambiguous.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, signals

from celery_unique.config import runtime
from celery_unique.dispatch.apply import release_at
from celery_unique.dispatch.headers import own_header
from celery_unique.signals import ReleaseReason, emit_released
from celery_unique.stores import cleanup


def _app_of(*sources: Any) -> Celery | None:
    for source in sources:
        app = getattr(source, "app", None)
        if app is not None:
            return app  # type: ignore[no-any-return]
    return None


def _on_message_dropped(sender: Any = None, message: Any = None, **_: Any) -> None:
    app = _app_of(sender)
    job_id = (getattr(message, "headers", None) or {}).get("id")
    if app is None or not isinstance(job_id, str):
        return
    header = own_header(app, message, job_id)
    if header is None:
        return
    hold = release_at(job_id, header, finished=True)
    if hold is None:
        return
    rt = runtime(app)

    def released(changed: bool) -> None:
        if changed:
            emit_released(
                app, job_id, hold.key, reason=ReleaseReason.FINISHED, kept=hold.keep_ms != 0
            )

    cleanup.release(
        rt.store,
        hold,
        within_s=None if rt.lease_ms is None else rt.lease_ms / 1000,
        on_released=released,
    )


_HANDLERS = (
    (signals.task_unknown, "celery_unique.dropped.unknown"),
    (signals.task_rejected, "celery_unique.dropped.rejected"),
)


def connect() -> None:
    for signal, uid in _HANDLERS:
        signal.connect(_on_message_dropped, weak=False, dispatch_uid=uid)


def disconnect() -> None:
    for signal, uid in _HANDLERS:
        signal.disconnect(_on_message_dropped, dispatch_uid=uid)
