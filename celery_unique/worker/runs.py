"""Every run marks its job's key, so that no copy of a message runs beside another job.

Brokers deliver at least once. A Redis transport puts back the unacknowledged
messages of a worker that lost its connection (or ran past the visibility
timeout) although they may be running or done; a publish retried after a
dropped connection can land twice; the message of a run that was retried or
replaced comes back if its acknowledgement was lost. Each copy carries the
job's id. Were the end of one copy to release the key while another copy
waits or runs, a new job could take the key and run beside it.

So each delivery gets its own run id, chosen by the worker's main process and
handed to the pool in the request. Before the job's body runs, the pool marks
the key with it (:meth:`~celery_unique.stores.base.Store.start_run`): a key
the job holds gets the mark, a key nobody holds is taken again, and a key
another job holds now means this copy's job ran already and its key moved
on: the copy is acknowledged without running (:class:`Stale`). Releases name
their run, and the store leaves alone a key that another delivery of the job
runs under.

The main process also sends the mark, in the background, once the pool took
the job: in order with its other writes, so that the end of an earlier
delivery of the job that this worker ran reaches the store first, and so
that a run the store could not mark at its start (the store did not answer
then) is marked before its own release.

A run does not start unmarked, though: a copy of a message whose key moved on
cannot be told from the job's first delivery while the store is silent. The
run waits a little for the store (:data:`STORE_WAIT_S`); if it is still
silent, the job is sent again under its id, due :data:`DEFER_S` later, and
this delivery ends without running (:class:`Deferred`): the key stays with
the job, and the copy that runs later is marked, or found stale. Only under
``unique_fail_open`` does a run go ahead unmarked, as dispatches do.

A copy of a message can also come while its first delivery still runs: a
worker that lost its broker connection goes on running its jobs, and the
broker delivers their messages again. The process running the job vouches
that the run is alive (see :mod:`celery_unique.worker.alive`); the copy finds
the run vouched for, and is sent again under the job's id, due when the vouching
runs out (:class:`Deferred`): it runs once the first run ended without
freeing the key (its job's key is then free, or held by a newer job: the
copy is stale), or once nobody vouches for that run any more (its process died).
Were the copy to take the mark and end first, its release would free the key
while the first run goes on, and a new job could run beside it.

``queued`` keys are released when a run starts; they mark nothing.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded
from celery.exceptions import Ignore

from celery_unique.config import runtime
from celery_unique.config.redelivery import visibility_timeout_s
from celery_unique.dispatch import resend
from celery_unique.dispatch.headers import KeyHeader, own_header, read_header
from celery_unique.exceptions import BackendUnavailable
from celery_unique.options.duplicates import RefusedArguments, decode_arguments
from celery_unique.stores.base import (
    HAND_OVER_UNDONE,
    HANDING_OVER,
    Hold,
    Release,
    RunBegun,
    RunStart,
    Scope,
    Store,
)
from celery_unique.worker import alive
from celery_unique.worker.limits import hold_to_the_end, soft_limit_held_back

logger = logging.getLogger("celery_unique")

#: The request field that carries a delivery's run id from the main process to the pool.
RUN_FIELD = "celery_unique_run"
_MARKED_SCOPES = (Scope.ACTIVE.value, Scope.EXISTS.value)
#: How long, at most, a run waits for a silent store before its job is deferred.
STORE_WAIT_S = 2.0
#: How long after a deferral the job is due again.
DEFER_S = 1.0
#: How long after another delivery stops being vouched alive a deferred copy is due.
BUSY_SLACK_S = 0.2
_RETRY_GAPS_S = (0.05, 0.1, 0.2, 0.4)


class Stale(Ignore):
    """This delivery is a copy of a job whose key another job holds now: it does not run."""


class Deferred(Ignore):
    """The store did not answer before the run: the job was sent again, under its id, for later."""


class StoreSilent(Exception):
    """The store did not answer the start of a run within :data:`STORE_WAIT_S`."""


def assign(request_dict: dict[str, Any], header: KeyHeader) -> str | None:
    """Give a delivery its run id (worker main process); ``None`` if its key takes no mark."""
    if not header.get("a") or header.get("s") not in _MARKED_SCOPES:
        return None
    run = uuid.uuid4().hex
    request_dict[RUN_FIELD] = run
    return run


def begin(task: Any) -> RunBegun:
    """Mark the key of the job ``task`` is about to run (pool): the other holder if stale,
    and what the job's duplicates left it (``latest``/``debounce``).

    Raises :class:`StoreSilent` if the store does not answer in time, unless
    the app fails open: then the run goes ahead, and the mark the worker's
    main process sends once the pool took the job (see
    :meth:`~celery_unique.worker.fates.Fate.started`) reaches the store later.
    """
    request = task.request
    run = getattr(request, RUN_FIELD, None)
    if not run or request.is_eager or request.called_directly:
        return _GO_AHEAD
    header = own_header(task.app, request, request.id)
    key = header.get("a") if header else None
    if header is None or not key or header.get("s") not in _MARKED_SCOPES:
        return _GO_AHEAD
    rt = runtime(task.app)
    # Only the job's own task takes its duplicates' arguments (not a replacement).
    follows = bool(header.get("p")) and getattr(task, "_marks_runs", False)
    start = RunStart(
        run,
        Scope(header["s"]),
        task.name,
        rt.lease_ms,
        follows_duplicates=follows,
        alive_ms=alive.alive_ms(rt.lease_ms),
        generation=header.get("g"),
    )
    try:
        begun = _start_waiting(rt.store, request.id, key, start, patient=not rt.fail_open)
    except BackendUnavailable as exc:
        logger.warning(
            "uniqueness store not answering; job %s runs (fail-open), its key %r is marked "
            "later: %s",
            request.id,
            key,
            exc,
        )
        begun = _GO_AHEAD
    if begun.holder is None and begun.wait_ms is None and begun.busy_ms is None:
        # It runs: vouch for it until its body ends (a mark made later, too).
        alive.started(task.app, Hold(request.id, key, run))
    return begun


_GO_AHEAD = RunBegun()


def _start_waiting(
    store: Store, job_id: str, key: str, start: RunStart, *, patient: bool
) -> RunBegun:
    deadline = time.monotonic() + STORE_WAIT_S
    gaps = iter(_RETRY_GAPS_S)
    failed: BackendUnavailable | None = None
    try:
        while True:
            try:
                return store.begin_run(job_id, key, start)
            except BackendUnavailable as exc:
                if not patient:
                    raise
                failed = exc
            gap = next(gaps, _RETRY_GAPS_S[-1])
            if time.monotonic() + gap > deadline:
                raise StoreSilent(str(failed)) from failed
            time.sleep(gap)
    except SoftTimeLimitExceeded as exc:
        # The limit struck while this run waited for the store (in a call, or
        # between two), before its body: the job did not overrun, the store did.
        # Defer it, even if no answer failed yet: the store may have taken the
        # mark, and handed this run the one owed to the job's duplicates, which
        # must not be lost with a run that never was.
        raise StoreSilent(str(failed or "no answer before the soft time limit")) from exc


def postpone(task: Any, wait_ms: int) -> Deferred:
    """The job ``task`` was received before its planned start (``debounce``): send it again
    for then; the exception that ends this delivery."""
    due_s = _send_again(task, wait_ms / 1000)
    logger.info(
        "job %s is sent again, due in %.3f s: a duplicate moved its start later",
        task.request.id,
        due_s,
    )
    return Deferred(f"postponed by a duplicate; sent again, due in {due_s:.3f} s")


def wait_for_run(task: Any, busy_ms: int) -> Deferred:
    """Another delivery of the job ``task`` runs, vouched alive ``busy_ms`` longer: send
    this copy again for then; the exception that ends this delivery."""
    wait_s = _send_again(task, busy_ms / 1000 + BUSY_SLACK_S)
    logger.warning(
        "job %s is sent again, due in %.1f s: another delivery of it runs on a live worker "
        "(the broker delivered its message again, as after a lost connection)",
        task.request.id,
        wait_s,
    )
    return Deferred(f"another delivery of the job runs; sent again, due in {wait_s:.1f} s")


def stop_before_body(task: Any, begun: RunBegun) -> Ignore | None:
    """What ends the delivery ``task`` runs before its body, if anything: its job's key
    moved on (stale), its planned start is later, or another delivery of the job runs
    (then the job is sent again for later)."""
    if begun.holder is not None:
        return stale(task, begun.holder)
    if begun.wait_ms is not None:
        return postpone(task, begun.wait_ms)
    if begun.busy_ms is not None:
        return wait_for_run(task, begun.busy_ms)
    return None


def latest_arguments(task: Any, stored: str) -> tuple[list[Any], dict[str, Any]] | None:
    """The arguments the job's latest duplicate left, now the run's (and its retries');
    ``None`` when the store's copy is refused (logged): the job runs with its own."""
    request = task.request
    key = (read_header(request) or {}).get("a", "")
    try:
        args, kwargs = decode_arguments(task, key, stored, runtime(task.app).signing_key)
    except RefusedArguments as refused:
        logger.error(
            "job %s of %s runs with the arguments of its own message: the latest "
            "arguments its key %r keeps in the store are refused, %s",
            request.id,
            task.name,
            key,
            refused,
        )
        return None
    request.args, request.kwargs = args, kwargs
    return args, kwargs


def _send_again(task: Any, countdown: float) -> float:
    # The same job going on (the re-send keeps its id, keys and retry count),
    # published without asking the store, as a retry is; a soft time limit
    # struck once it left would end this delivery as a failure.
    countdown = min(countdown, redelivery_safe_s(task.app))
    with soft_limit_held_back(), resend.lease_covers_it():
        task.signature_from_request(task.request, countdown=countdown).apply_async()
        hold_to_the_end()
    return countdown


def redelivery_safe_s(app: Any) -> float:
    """The longest countdown a job sent again may have: half the broker's
    ``visibility_timeout``, if it has one.

    A worker holds a message that is not due yet unacknowledged, and a Redis or
    SQS broker delivers such a message again once it was held that long. Were a
    copy sent again due later, the broker would make a copy of it; both come due
    together, one runs, the other finds it running and is sent again, and so on,
    one run a round, for ever. Due sooner, the copy comes back early, and is sent
    again if what held it back still holds (its planned start is later, its job
    still runs, the store is still silent).
    """
    try:
        timeout_s = visibility_timeout_s(app)
    except (TypeError, ValueError):
        return math.inf  # a setting kombu refuses as well: the broker says so
    return math.inf if timeout_s is None else timeout_s / 2


def defer(task: Any, silent: StoreSilent) -> Deferred:
    """Send the job ``task`` runs again, due later; the exception that ends this delivery."""
    request = task.request
    due_s = _send_again(task, DEFER_S)
    logger.warning(
        "job %s is sent again, due in %s s: the uniqueness store did not answer before "
        "its run, and an unmarked run could overlap another job (%s)",
        request.id,
        due_s,
        silent,
    )
    return Deferred(f"store silent; sent again, due in {due_s} s")


def hand_over(task: Any) -> Callable[[], None] | None:
    """Mark the key of the run ``task`` is in as handed over to the message about to
    carry the job on: its replacement, or its next attempt (pool).

    Done before that message is sent: whatever ends this run after that (a hard
    time limit while the send waits on the broker), its release leaves the key to
    the message, whose run takes it over. Returns what undoes the mark if nothing is sent;
    ``None`` when there is no mark to make or the store did not take it.
    """
    request = task.request
    run = getattr(request, RUN_FIELD, None)
    header = own_header(task.app, request, request.id)
    key = header.get("a") if header else None
    if not run or not key or request.is_eager:
        return None
    store = runtime(task.app).store
    try:
        [marked] = store.release_many([Release(request.id, key, HANDING_OVER, run)])
    except BackendUnavailable as exc:
        logger.warning(
            "job %s is sent on without its key marked as handed over: %s", request.id, exc
        )
        return None
    if not marked:
        return None

    def undo() -> None:
        try:
            store.release_many([Release(request.id, key, HAND_OVER_UNDONE, run)])
        except BackendUnavailable:
            logger.warning(
                "job %s: its key stays marked as handed over until the lease", request.id
            )

    return undo


def stale(task: Any, holder: str) -> Stale:
    """The exception that ends a stale delivery, logged once."""
    job_id, key = task.request.id, (read_header(task.request) or {}).get("a")
    logger.warning(
        "job %s is not run: its key %r is held by job %s now (this delivery is a copy "
        "of a job that ran already, delivered again by the broker)",
        job_id,
        key,
        holder,
    )
    return Stale(f"key held by job {holder}")


def body_ended(request: Any) -> None:
    """The body of the run ``request`` is in has ended: nobody vouches for the run any more."""
    run = getattr(request, RUN_FIELD, None)
    if run:
        alive.ended(run)


def _on_postrun(sender: Any = None, task: Any = None, **_: Any) -> None:
    # Unique tasks end it in __call__; this is for any other task carrying the header.
    task = task if task is not None else sender
    body_ended(getattr(task, "request", None))


def connect() -> None:
    from celery import signals

    signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="celery_unique.runs.postrun")
