"""Signals for every uniqueness outcome, the log line of each, and Celery events.

Connect receivers like any Celery signal (``weak=False`` and a
``dispatch_uid`` for receivers defined in a function)::

    from celery_unique.signals import job_reused

    @job_reused.connect
    def count_reuse(sender, task_name, job_id, match, key, policy_drift, **kwargs):
        ...

``job_created`` (sender: the task)
    ``task_name``, ``job_id``, ``active_key``, ``window_key``, ``rerun_of``
    (``None``; for the run a ``latest``/``debounce`` job's duplicates owed, which
    a worker publishes as the job ends: that job's id).
``job_reused`` (sender: the task)
    ``task_name``, ``job_id`` (the existing job), ``requested_job_id`` (the id
    the dispatch asked for; nothing was published under it), ``match``
    (:class:`~celery_unique.DuplicateMatch`), ``key`` (the key that matched),
    ``policy_drift``.
``uniqueness_conflict`` (sender: the task)
    ``task_name``, ``job_id`` (asked for, not created), ``reason`` (the error
    code: ``uniqueness_conflict`` or ``uniqueness_composition_conflict``),
    ``conflicting_job_ids``, ``active_key``, ``window_key``.
``rerun_owed`` (sender: the task)
    ``task_name``, ``job_id`` (the running job), ``requested_job_id``, ``key``:
    a ``latest``/``debounce`` duplicate met the job running; one run with its
    arguments follows the job (however many such duplicates come).
``postponed`` (sender: the task)
    ``task_name``, ``job_id``, ``requested_job_id``, ``key``, ``postponed_to``
    (an aware UTC datetime): a ``debounce`` duplicate moved the job's start.
``key_released`` (sender: the app)
    ``task_name`` (``None`` when unknown), ``job_id``, ``key``,
    ``storage_key``, ``reason`` (:class:`ReleaseReason`), ``kept``.

Keys are display keys (``<task name>:<key>``). ``job_created`` fires for a
dispatch that wrote keys and published a new job; a dispatch without keys, a
re-send of the same job (``retry()``) and a fail-open publish do not fire it.

Each ``emit_*`` helper sends its signal, writes the log line (INFO for a
reuse, WARNING for a conflict, INFO for an operator's or the reaper's release,
DEBUG for a release by the job's lifecycle) and, when the app sends task
events (``task_send_sent_event`` or ``worker_send_task_events``), a Celery
event of type ``unique-created``, ``unique-reused``, ``unique-conflict`` or
``unique-released`` whose ``uuid`` is the job id. With no receiver and events
off, a created job costs one attribute check.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from celery.utils.dispatch import Signal

from celery_unique.keys import keyspace
from celery_unique.options.duplicates import planned_start
from celery_unique.receipt import DuplicateMatch
from celery_unique.stores.base import Effect, Verdict

if TYPE_CHECKING:
    from celery import Celery, Task

    from celery_unique.stores.base import Claim, Decision

logger = logging.getLogger("celery_unique")


class Planned(Protocol):
    """What a signal reads of a planned dispatch (the dispatch's plan has these)."""

    @property
    def claim(self) -> Claim: ...
    @property
    def active_key(self) -> str | None: ...
    @property
    def window_key(self) -> str | None: ...


job_created = Signal(
    name="celery_unique.job_created",
    providing_args=("task_name", "job_id", "active_key", "window_key", "rerun_of"),
)
job_reused = Signal(
    name="celery_unique.job_reused",
    providing_args=("task_name", "job_id", "requested_job_id", "match", "key", "policy_drift"),
)
uniqueness_conflict = Signal(
    name="celery_unique.uniqueness_conflict",
    providing_args=(
        "task_name",
        "job_id",
        "reason",
        "conflicting_job_ids",
        "active_key",
        "window_key",
    ),
)
rerun_owed = Signal(
    name="celery_unique.rerun_owed",
    providing_args=("task_name", "job_id", "requested_job_id", "key"),
)
postponed = Signal(
    name="celery_unique.postponed",
    providing_args=("task_name", "job_id", "requested_job_id", "key", "postponed_to"),
)
key_released = Signal(
    name="celery_unique.key_released",
    providing_args=("task_name", "job_id", "key", "storage_key", "reason", "kept"),
)


class ReleaseReason(str, enum.Enum):
    """Why a key was released."""

    #: The job started (``queued`` keys).
    STARTED = "started"
    #: The job ended: a final state, or it ended without running.
    FINISHED = "finished"
    #: An operator released it (``celery unique release``, the admin).
    OPERATOR = "operator"
    #: The reaper found its job in a final state.
    REAPED = "reaped"


#: Releases done by the job's own lifecycle (logged at DEBUG: one per job).
_LIFECYCLE = frozenset({ReleaseReason.STARTED, ReleaseReason.FINISHED})


class _Events:
    """Celery events of one app in this process: whether to send, and a dispatcher."""

    __slots__ = ("_dispatcher", "enabled", "pid")

    def __init__(self, app: Celery) -> None:
        conf = app.conf
        self.enabled = bool(conf.task_send_sent_event or conf.worker_send_task_events)
        self.pid = os.getpid()
        self._dispatcher: Any = None

    def send(self, app: Celery, type_: str, fields: Mapping[str, Any]) -> None:
        """Publish one event over a pooled producer; never fail the caller for it."""
        try:
            if self._dispatcher is None:
                # Disabled: it only builds and stamps events; the producer publishes.
                self._dispatcher = app.events.Dispatcher(enabled=False)
            with app.producer_or_acquire() as producer:
                self._dispatcher.publish(type_, dict(fields), producer, retry=False)
        except Exception:
            logger.debug("could not send the %s event", type_, exc_info=True)


def _events(app: Celery) -> _Events:
    """The app's event state in this process, built at first use."""
    current: _Events | None = getattr(app, "_celery_unique_events", None)
    if current is None or current.pid != os.getpid():
        current = _Events(app)
        app._celery_unique_events = current  # type: ignore[attr-defined]
    return current


def reset_events(app: Celery) -> None:
    """Read the app's event settings again at the next emit (after changing them)."""
    app._celery_unique_events = None  # type: ignore[attr-defined]


def _send(
    signal: Signal, sender: Any, app: Celery, event: str, uuid: str, fields: dict[str, Any]
) -> None:
    if signal.receivers:
        signal.send(sender=sender, **fields)
    events = _events(app)
    if events.enabled:
        plain = {
            name: value.value if isinstance(value, enum.Enum) else value
            for name, value in fields.items()
        }
        events.send(app, event, {"uuid": uuid, "name": plain.pop("task_name"), **plain})


def emit_created(task: Task[Any, Any], plan: Planned) -> None:
    """A unique dispatch published a new job (verdict ``CREATED``); call after the publish."""
    if not job_created.receivers and not _events(task.app).enabled:
        return
    _send(
        job_created,
        task,
        task.app,
        "unique-created",
        plan.claim.job_id,
        {
            "task_name": task.name,
            "job_id": plan.claim.job_id,
            "active_key": plan.active_key,
            "window_key": plan.window_key,
            "rerun_of": None,
        },
    )


def emit_rerun_published(task: Task[Any, Any], ended: str, job_id: str, storage_key: str) -> None:
    """A worker published the run job ``ended``'s duplicates owed (``latest``/``debounce``)."""
    if not job_created.receivers and not _events(task.app).enabled:
        return
    _, _, scope, key = keyspace.split_storage_key(storage_key)
    _send(
        job_created,
        task,
        task.app,
        "unique-created",
        job_id,
        {
            "task_name": task.name,
            "job_id": job_id,
            "active_key": keyspace.display_key(scope, key),
            "window_key": None,
            "rerun_of": ended,
        },
    )


def emit_reused(task: Task[Any, Any], plan: Planned, decision: Decision) -> None:
    """A dispatch resolved to an existing job (``REUSED_ACTIVE``/``REUSED_WINDOW``)."""
    match = (
        DuplicateMatch.WINDOW
        if decision.verdict is Verdict.REUSED_WINDOW
        else DuplicateMatch.ACTIVE
    )
    key = plan.window_key if match is DuplicateMatch.WINDOW else plan.active_key
    effect = decision.effect
    logger.info(
        "%s: reused job %s (%s key %r)%s%s",
        task.name,
        decision.job_id,
        match.value,
        key,
        " with policy drift" if decision.policy_drift else "",
        "" if effect is None else f", {_EFFECTS[effect]}",
    )
    fields = {
        "task_name": task.name,
        "job_id": decision.job_id,
        "requested_job_id": plan.claim.job_id,
        "key": key,
    }
    _send(
        job_reused,
        task,
        task.app,
        "unique-reused",
        decision.job_id,
        {**fields, "match": match, "policy_drift": decision.policy_drift},
    )
    if effect is Effect.RERUN_REQUESTED:
        _send(rerun_owed, task, task.app, "unique-rerun-owed", decision.job_id, fields)
    elif effect is Effect.POSTPONED and decision.starts_at_ms is not None:
        at = planned_start(decision.starts_at_ms)
        _send(
            postponed,
            task,
            task.app,
            "unique-postponed",
            decision.job_id,
            {**fields, "postponed_to": at},
        )


_EFFECTS = {
    Effect.ARGUMENTS_REPLACED: "it will run with this dispatch's arguments",
    Effect.POSTPONED: "postponed, to run with this dispatch's arguments",
    Effect.RERUN_REQUESTED: "it runs: one run with the latest arguments follows it",
}


def emit_conflict(task: Task[Any, Any], plan: Planned, decision: Decision) -> None:
    """A dispatch failed on a (composition) conflict; call before raising the error."""
    if decision.verdict is Verdict.COMPOSITION_CONFLICT:
        reason = "uniqueness_composition_conflict"
        logger.warning(
            "%s: window key %r and active key %r point at different jobs %s",
            task.name,
            plan.window_key,
            plan.active_key,
            ", ".join(decision.conflicting_job_ids),
        )
    else:
        reason = "uniqueness_conflict"
        logger.warning(
            "%s: window key %r already used by job %s with a different request",
            task.name,
            plan.window_key,
            decision.job_id,
        )
    _send(
        uniqueness_conflict,
        task,
        task.app,
        "unique-conflict",
        plan.claim.job_id,
        {
            "task_name": task.name,
            "job_id": plan.claim.job_id,
            "reason": reason,
            "conflicting_job_ids": list(decision.conflicting_job_ids or (decision.job_id,)),
            "active_key": plan.active_key,
            "window_key": plan.window_key,
        },
    )


def emit_released(
    app: Celery,
    job_id: str,
    storage_key: str,
    *,
    task_name: str | None = None,
    reason: ReleaseReason,
    kept: bool = False,
) -> None:
    """A held key was released (call only when the store says it was: ``release()`` true).

    ``kept``: the key stays, marked finished, for its retention (``exists``).
    """
    # Called for every job a worker runs: nothing more than checks unless someone listens.
    level = logging.DEBUG if reason in _LIFECYCLE else logging.INFO
    listening = bool(key_released.receivers) or _events(app).enabled
    if not listening and not logger.isEnabledFor(level):
        return
    _, _, scope, key = keyspace.split_storage_key(storage_key)
    display = keyspace.display_key(scope, key)
    logger.log(
        level,
        "released key %r of job %s (%s%s)",
        display,
        job_id,
        reason.value,
        ", kept for retention" if kept else "",
    )
    if not listening:
        return
    _send(
        key_released,
        app,
        app,
        "unique-released",
        job_id,
        {
            "task_name": task_name or scope or None,
            "job_id": job_id,
            "key": display,
            "storage_key": storage_key,
            "reason": reason,
            "kept": kept,
        },
    )
