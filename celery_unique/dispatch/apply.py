"""The dispatch path: plan the keys, ask the store once, then publish or hand back.

Everything that can fail on bad input (arguments, selectors, key rules,
windows, job ids, payload encoding) runs in
:func:`~celery_unique.dispatch.planning.plan`, before the store
or the broker is touched. The store decides in one round trip, overlapped
with Celery building the message, or, when it shares a Redis server with the
broker, carrying the message (:mod:`celery_unique.dispatch.colocated`); the publish gate
(:mod:`celery_unique.dispatch.publishing`) lets the job out only if the answer is
"created". A publish that fails after the store reserved a key rolls the
reservation back; a reservation whose answer was lost is undone by the store
(:mod:`celery_unique.stores.cleanup`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import celery
from celery.result import AsyncResult
from celery.utils import uuid

from celery_unique import signals
from celery_unique.config import Runtime, runtime
from celery_unique.dispatch import colocated, resend
from celery_unique.dispatch.gate import (
    Gate,
    NotPublished,
    gate_for,
    store_answered,
    tolerate_outage,
)
from celery_unique.dispatch.headers import HEADER, KeyHeader
from celery_unique.dispatch.planning import Plan, plan, waiting_ms
from celery_unique.dispatch.publishing import install_gate, publish_deciding
from celery_unique.exceptions import (
    BackendUnavailable,
    CallbacksNotAttached,
    CompositionConflict,
    GroupMemberReused,
    UniquenessConflict,
    UniquenessError,
    UnsupportedCombination,
)
from celery_unique.options.declaration import (
    DISPATCH_OPTIONS,
    Declaration,
)
from celery_unique.options.duplicates import (
    planned_start,
)
from celery_unique.receipt import Disposition, DuplicateMatch, UniqueResult, stamp
from celery_unique.stores import cleanup
from celery_unique.stores.base import (
    Claim,
    Decision,
    Effect,
    Hold,
    Release,
    Scope,
    Verdict,
)

if TYPE_CHECKING:
    from celery import Celery, Task

logger = logging.getLogger("celery_unique")


def take_dispatch_options(options: dict[str, Any]) -> dict[str, Any]:
    """Remove the uniqueness options from Celery's options; they never reach the broker."""
    return {name: options.pop(name) for name in DISPATCH_OPTIONS if name in options}


def as_sent(task: Task[Any, Any], args: Any, kwargs: Any, options: Mapping[str, Any]) -> Any:
    """``(args, kwargs)`` as Celery will send them: ``pydantic=True`` models dumped.

    Celery 5.7 dumps such models inside ``apply_async``; keys and fingerprints
    are worked out from what the worker will receive. Dumping twice is
    harmless: a dumped model is a plain dict.
    """
    dump = getattr(task, "_dump_pydantic_arguments", None)
    if dump is None or options.get("serializer") == "pickle":
        return args, kwargs
    return dump(args, kwargs)


def unsubscribe(app: Celery, job_id: str) -> None:
    """Forget the result subscription Celery may have opened for ``job_id``, which was
    never published.

    Celery's Redis result backend subscribes to a job's result as it sends the
    message, before the message reaches the broker; when the store decides as the
    message leaves (:mod:`celery_unique.dispatch.colocated`), a job that is not published was
    subscribed to all the same, and would stay so for the life of the process.
    (Only a backend that subscribes per job keeps ``subscribed_to``; the ``rpc``
    backend's consumer serves every job at once and must be left alone.)
    """
    consumer = getattr(app.backend, "result_consumer", None)
    if isinstance(getattr(consumer, "subscribed_to", None), set):
        consumer.cancel_for(job_id)  # type: ignore[union-attr]


def _replaces_another_task(task: Task[Any, Any], task_id: str | None) -> bool:
    """Whether this dispatch is ``replace()`` in the running job by a task of another name:
    its keys are its own, not the replaced job's."""
    current = task.app.current_worker_task
    return (
        current is not None
        and current.request.id == task_id
        and current.name != task.name
        and not current.request.is_eager
    )


#: Where celery-unique and Celery live: a warning about a dispatch points past them.
_LIBRARIES = tuple(
    str(directory) + os.sep
    for directory in (Path(__file__).resolve().parents[1], Path(celery.__file__).resolve().parent)
)


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside celery-unique and Celery: the line that
    dispatched, whether through ``apply_async``, ``delay``, a signature or a group."""
    level, frame = 2, sys._getframe(2)  # 1: the function that warns; 2: its caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        level, frame = level + 1, frame.f_back
    return level


def _carries(header: KeyHeader, planned: KeyHeader) -> bool:
    """Whether the keys ``planned`` names are among those ``header`` carries."""
    return all(planned.get(kind) in (None, header.get(kind)) for kind in ("a", "w"))


def _carrying_own(carried: KeyHeader, planned: Plan) -> KeyHeader:
    """The header of a replacement that carries a job's keys on and holds its own active key
    (``x``), if it has one, beside them."""
    header: KeyHeader = {**carried}
    own = planned.header
    if own.get("a"):
        header["x"] = {name: value for name, value in own.items() if name in ("v", "a", "s", "r")}  # type: ignore[typeddict-item]
    return header


def _keys_of(planned: Plan) -> str:
    return ", ".join(repr(key) for key in (planned.active_key, planned.window_key) if key)


def _extend_lease(app: Celery, job_id: str, header: KeyHeader, options: Mapping[str, Any]) -> None:
    """A retry's countdown is waiting time its key's lease must cover."""
    key, rt = header.get("a"), runtime(app)
    if not key or rt.lease_ms is None:
        return
    try:
        rt.store.renew_many([Hold(job_id, key)], rt.lease_ms + waiting_ms(options))
    except Exception:
        logger.warning("could not extend the lease of %r for a retry", key, exc_info=True)


def with_header(options: dict[str, Any], header: KeyHeader) -> dict[str, Any]:
    headers = dict(options.get("headers") or {})
    headers[HEADER] = header
    options["headers"] = headers
    return options


def decide_one(rt: Runtime, claim: Claim) -> Decision | None:
    """The store's decision; ``None`` when the store is down and fail-open is on."""
    try:
        decision = rt.store.decide([claim])[0]
    except BackendUnavailable as error:
        if not tolerate_outage(rt, error):
            raise
        return None
    store_answered(rt)
    return decision


def verdict_error(task: Task[Any, Any], plan: Plan, decision: Decision) -> UniquenessError | None:
    """The error a conflicting verdict stands for (signalled and logged once), else ``None``."""
    if decision.verdict.failed:
        signals.emit_conflict(task, plan, decision)
    if decision.verdict is Verdict.CONFLICT:
        return UniquenessConflict(
            f"window key {plan.window_key!r} of {task.name} is already used by job "
            f"{decision.job_id} for a different request (payload, routing, start time, "
            "headers or callbacks differ)",
            conflicting_job_id=decision.job_id,
        )
    if decision.verdict is Verdict.COMPOSITION_CONFLICT:
        return CompositionConflict(
            f"window key {plan.window_key!r} points at job {decision.conflicting_job_ids[0]} "
            f"but active key {plan.active_key!r} is held by job "
            f"{decision.conflicting_job_ids[-1]}",
            conflicting_job_ids=decision.conflicting_job_ids,
        )
    return None


def reused(
    task: Task[Any, Any],
    plan: Plan,
    decision: Decision,
    *,
    callbacks: bool,
    group_member: bool = False,
    eager: bool | None = None,
) -> UniqueResult:
    """The existing job's result, stamped as reused; warns when callbacks are left behind.

    A dispatch that would have run eagerly (``eager``; by default, when the app
    has ``task_always_eager``) gets an ``EagerResult`` of the holder
    (:mod:`celery_unique.config.eager`): no worker or result backend will ever fill
    an ``AsyncResult`` there.
    """
    verdict = decision.verdict
    match = DuplicateMatch.WINDOW if verdict is Verdict.REUSED_WINDOW else DuplicateMatch.ACTIVE
    matched_key = plan.window_key if match is DuplicateMatch.WINDOW else plan.active_key
    signals.emit_reused(task, plan, decision)
    if eager is None:
        eager = bool(task.app.conf.task_always_eager)
    result = (
        runtime(task.app).eager_runs.result_of(decision.job_id, task.name)
        if eager
        else task.AsyncResult(decision.job_id)
    )
    # A window match means the same request, callbacks included (they are in the
    # fingerprint); an active match may hand back a job that lacks them.
    dropped = callbacks and match is DuplicateMatch.ACTIVE
    if dropped:
        warnings.warn(
            f"{task.name}: dispatch reused job {decision.job_id} (active key {matched_key!r}); "
            "its link/link_error/chain callbacks are not attached to that job and will not run",
            CallbacksNotAttached,
            stacklevel=_callers_level(),
        )
    if group_member:
        warnings.warn(
            f"{task.name}: a group member reused job {decision.job_id}; the group's result "
            "holds the member's own id, which will never run: wait on the job ids this "
            "dispatch returns, not on the GroupResult",
            GroupMemberReused,
            stacklevel=_callers_level(),
        )
    effect = decision.effect
    return stamp(
        result,
        Disposition.REUSED,
        match,
        policy_drift=decision.policy_drift,
        callbacks_dropped=dropped,
        arguments_replaced=effect in (Effect.ARGUMENTS_REPLACED, Effect.POSTPONED),
        rerun_requested=effect is Effect.RERUN_REQUESTED,
        postponed_to=planned_start(decision.starts_at_ms),
    )


def created_receipt(
    result: AsyncResult[Any], planned: Plan, decision: Decision | None
) -> UniqueResult:
    """A created job's receipt (with its planned start, for ``debounce``: the store's,
    or, published without a decision (fail-open), the countdown it was sent with)."""
    if decision is not None:
        return stamp(result, postponed_to=planned_start(decision.starts_at_ms))
    if planned.countdown_s is None:
        return stamp(result)
    sent_for = datetime.now(timezone.utc) + timedelta(seconds=planned.countdown_s)
    return stamp(result, postponed_to=sent_for)


def rollback(rt: Runtime, claim: Claim) -> None:
    """Undo a created claim after its publish failed; never masks the publish error."""
    try:
        rt.store.rollback(claim)
    except Exception:
        # The publish error is the one to raise; the rollback is owed until the
        # store answers (the job was never published: its keys must not stay).
        logger.warning(
            "could not roll back the keys of job %s after a failed publish; retrying in "
            "the background",
            claim.job_id,
            exc_info=True,
        )
        cleanup.roll_back(rt.store, [claim])


def release_now(
    app: Celery, rt: Runtime, job_id: str, header: KeyHeader, *, finished: bool
) -> None:
    """What ``header``'s scope releases when the job starts or finishes, done here and now.

    For jobs run eagerly, in this process (a worker's releases are owed to the
    store in the background instead: :mod:`celery_unique.worker`).
    """
    hold = release_at(job_id, header, finished=finished)
    if hold is None:
        return
    reason = signals.ReleaseReason.FINISHED if finished else signals.ReleaseReason.STARTED

    def released(changed: bool) -> None:
        if changed:
            signals.emit_released(app, job_id, hold.key, reason=reason, kept=hold.keep_ms != 0)

    try:
        [changed] = rt.store.release_many([hold])
    except Exception:
        logger.warning("could not release key %r; retrying in the background", hold.key)
        within = None if rt.lease_ms is None else rt.lease_ms / 1000
        cleanup.release(rt.store, hold, within_s=within, on_released=released)
        return
    released(changed)


def release_at(job_id: str, header: KeyHeader, *, finished: bool) -> Release | None:
    """The release a job's scope calls for when it starts (``finished=False``) or ends.

    ``queued`` keys go when the job starts (and, if it never started, when it
    ends); ``active`` keys when it ends; ``exists`` keys are kept for their
    retention when it ends.
    """
    key = header.get("a")
    if not key:
        return None
    scope, generation = header.get("s"), header.get("g")
    if scope == Scope.QUEUED.value:
        return Release(job_id, key, 0, generation=generation)
    if not finished:
        return None
    if scope == Scope.EXISTS.value:
        return Release(job_id, key, header.get("r"), generation=generation)
    return Release(job_id, key, 0, generation=generation)


def run_eagerly(
    app: Celery, rt: Runtime, job_id: str, header: KeyHeader | None, run: Callable[[], Any]
) -> Any:
    """Run a created job here (``.apply()``, eager mode): its keys go as a worker's would."""
    if header is not None:
        release_now(app, rt, job_id, header, finished=False)
    try:
        ran = run()
        rt.eager_runs.note(ran)
        return ran
    finally:
        if header is not None:
            release_now(app, rt, job_id, header, finished=True)


def apply_unique(
    task: Task[Any, Any],
    send: Callable[..., AsyncResult[Any]],
    args: Any,
    kwargs: Any,
    task_id: str | None,
    link: Any,
    link_error: Any,
    options: dict[str, Any],
    *,
    producer: Any = None,
    publishes: bool = True,
    eager: bool | None = None,
) -> UniqueResult:
    """A dispatch of a unique task.

    ``send`` is Celery's own ``apply_async`` or ``send_task`` (``publishes=True``:
    it takes a ``producer``, and the store's round trip overlaps building the
    message) or ``apply`` (``publishes=False``: the job runs here, after the
    decision). ``eager``: whether ``send`` runs the job here (by default, for
    ``apply`` or under ``task_always_eager``); a duplicate's receipt is then
    an ``EagerResult``.
    """
    app = task.app
    if eager is None:
        eager = not publishes or bool(app.conf.task_always_eager)
    if not publishes:
        gate = gate_for(task_id)
        if gate is not None:
            # Celery's eager apply_async running the job it is dispatching: that
            # dispatch asked the store already; the job runs only if it created.
            gate.let_out()
            ran = run_eagerly(
                app,
                gate.rt,
                gate.job_id,
                gate.header if gate.decision is not None else None,
                lambda: send(
                    args, kwargs, task_id=task_id, link=link, link_error=link_error, **options
                ),
            )
            # Stamped again, with the decision, by the dispatch that runs it.
            return stamp(ran)
    overrides = take_dispatch_options(options)
    declaration: Declaration = task.__unique__  # type: ignore[attr-defined]
    if publishes:
        install_gate(app)
        options["producer"] = producer

    def publish(job_id: str | None, header: KeyHeader | None = None, **extra: Any) -> Any:
        opts = with_header(options, header) if header is not None else options
        return send(args, kwargs, task_id=job_id, link=link, link_error=link_error, **opts, **extra)

    again = resend.resent(app, task_id, options)
    replacing = (
        again is not None
        and (overrides or declaration.declares_keys)
        and _replaces_another_task(task, task_id)
    )

    def send_again() -> UniqueResult:
        # retry(), replace(), a lost child's retry: the same job again, never a
        # duplicate of itself. It holds its keys already.
        assert again is not None
        if again.header is not None and task_id is not None and not resend.lease_covered():
            _extend_lease(app, task_id, again.header, options)
        return stamp(publish(task_id, again.header))

    if again is not None and not replacing:
        return send_again()
    if not (overrides or declaration.declares_keys):
        return stamp(publish(task_id))

    args, kwargs = as_sent(task, args, kwargs, options)
    rt = runtime(app)
    job_id = task_id or uuid()
    planned = plan(
        task,
        declaration,
        overrides,
        args,
        kwargs,
        options,
        job_id=job_id,
        id_chosen=task_id is not None,
        link=link,
        link_error=link_error,
        rt=rt,
    )
    if replacing:
        assert again is not None
        if again.header is not None and again.header.get("a"):
            if planned is None or _carries(again.header, planned.header):
                return send_again()
            # Its own keys are decided under the job's id; the message carries the
            # job's keys on, and its end releases its own too.
            planned = dataclasses.replace(planned, header=_carrying_own(again.header, planned))
    if planned is None:
        return stamp(publish(task_id))
    callbacks = bool(link or link_error or options.get("chain"))
    group_member = task_id is not None and bool(options.get("group_id"))

    def not_published(decision: Decision) -> UniqueResult:
        if decision.job_id != job_id:
            unsubscribe(app, job_id)
        error = verdict_error(task, planned, decision)
        if error is not None:
            raise error
        if replacing:
            # Reused, the replacement would not run under the replaced job's id,
            # and whoever waits on that id would wait for good.
            raise UnsupportedCombination(
                f"replace() by {task.name}: its key ({_keys_of(planned)}) is held by job "
                f"{decision.job_id}, so the replacement would run beside that job; nothing "
                "was sent. Dispatch it instead of replacing, to share that job"
            )
        return reused(
            task, planned, decision, callbacks=callbacks, group_member=group_member, eager=eager
        )

    if not publishes:
        decision = decide_one(rt, planned.claim)
        if decision is None:
            return stamp(publish(task_id))
        if not decision.verdict.publishes:
            return not_published(decision)
        created = stamp(
            run_eagerly(app, rt, job_id, planned.header, lambda: publish(job_id, planned.header))
        )
        signals.emit_created(task, planned)
        return created

    held_recently = planned.claim in rt.recently_held
    if not (held_recently or app.conf.task_always_eager) and colocated.suits(app, rt):
        # Asked as the message leaves, in the script that enqueues it.
        gate = Gate(job_id, rt, planned.header, claim=planned.claim)
    else:
        try:
            pending = rt.store.send_decide([planned.claim])
        except BackendUnavailable as error:
            if not tolerate_outage(rt, error):
                raise
            return stamp(publish(task_id))
        gate = Gate(job_id, rt, planned.header, pending)
        if held_recently:
            # Most likely a duplicate again: its answer is read before Celery builds a
            # message that would not be sent.
            try:
                gate.resolve()
            except NotPublished:
                assert gate.decision is not None
                return not_published(gate.decision)
    given = options.pop("producer")
    start = {} if planned.countdown_s is None else {"countdown": planned.countdown_s}
    try:
        outcome: UniqueResult = publish_deciding(
            app,
            gate,
            given,
            lambda stand_in: created_receipt(
                publish(job_id, planned.header, producer=stand_in, **start),
                planned,
                gate.decision,
            ),
            not_published,
            lambda: rollback(rt, planned.claim),
            on_created=lambda: signals.emit_created(task, planned),
        )
    except BaseException:
        if not gate.enqueued:
            unsubscribe(app, job_id)  # refused, or its publish failed: never published
        raise
    rt.recently_held.note(planned.claim, gate.decision)
    return outcome
