"""What a worker's main process writes when a message's fate is not what Celery believed.

Pure unit tests of :class:`celery_unique.worker.fates.Fate` on the memory store;
the real worker paths are in ``tests/paths`` and ``tests/history``.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import celery
import celery.signals
import pytest
from billiard.einfo import ExceptionInfo  # type: ignore[attr-defined]
from billiard.exceptions import (
    SoftTimeLimitExceeded,
    Terminated,
    TimeLimitExceeded,
    WorkerLostError,
)
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry

import celery_unique
from celery_unique import UniqueTask
from celery_unique import signals as unique_signals
from celery_unique.config import runtime
from celery_unique.dispatch import resend
from celery_unique.dispatch.headers import HEADER, VERSION, KeyHeader
from celery_unique.keys.keyspace import ACTIVE, storage_key
from celery_unique.options.duplicates import encode_arguments
from celery_unique.signals import ReleaseReason
from celery_unique.stores import cleanup
from celery_unique.stores.base import (
    GOES_ON,
    HAND_OVER_UNDONE,
    HANDING_OVER,
    RUNNING,
    ActiveClaim,
    Claim,
    Effect,
    OnDuplicate,
    Release,
    RunStart,
    Scope,
    Store,
    Verdict,
)
from celery_unique.worker import alive, fates, runs
from celery_unique.worker.fates import Fate, Settled, _exception, _outside_body
from tests.polling import eventually


class Message:
    """A kombu message as far as a fate looks at it: its acknowledgement state."""

    def __init__(self, state: str) -> None:
        self._state = state


def created(
    app: Celery, name: str, scope: Scope = Scope.ACTIVE
) -> tuple[Store, str, str, KeyHeader]:
    """A job created on key ``name`` (active unless ``scope`` says otherwise): the store,
    the job, the key, its header."""
    store = runtime(app).store
    job, key = uuid.uuid4().hex, storage_key(runtime(app).namespace, ACTIVE, "", name)
    claim = Claim(job, "fates.task", ActiveClaim(key, scope, 60_000))
    assert store.decide([claim])[0].verdict is Verdict.CREATED
    return store, job, key, {"v": VERSION, "a": key, "s": scope.value}


def started_run(store: Store, job: str, key: str) -> str:
    """A run of ``job`` that marked ``key`` (as the pool does before the body)."""
    run = uuid.uuid4().hex
    assert store.start_run(job, key, RunStart(run, Scope.ACTIVE, "fates.task", 60_000)) is None
    return run


def test_a_copy_dropped_unrun_after_an_acknowledgement_that_failed_frees_the_key(
    app: Celery,
) -> None:
    """Run 1 ends; its ack fails (the broker was away), so its release never goes;
    the broker delivers the message again, revoked meanwhile: dropped unrun. The
    key must be free then, not held by the ended run's mark until the lease."""
    store, job, key, header = created(app, "k")
    first = Fate(app, job, header, Message("RECEIVED"), run=started_run(store, job, key))
    first.started()
    first.run_ended(pid=None, cut_short=False, continued=False)
    first.message_settled(Settled.FORGOTTEN)  # Celery asked for the ack; it never happened

    copy = Fate(app, job, header, Message("ACK"), run=uuid.uuid4().hex)
    copy.message_settled(Settled.FORGOTTEN)  # revoked: acknowledged without running
    try:
        eventually(lambda: store.get(key) is None, 5, "the key to be freed")
    finally:
        cleanup.discard(store)  # the first release, which waits for an ack that never came


def release_answers(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What ``store`` answers each release of a key sent to it from now on, in order
    (the other writes that travel as releases, marks of runs, are left out)."""
    answers: list[bool] = []
    release_many = store.release_many

    def answering(releases: Any) -> list[bool]:
        answered = release_many(releases)
        answers.extend(a for r, a in zip(releases, answered, strict=True) if r.keep_ms == 0)
        return answered

    monkeypatch.setattr(store, "release_many", answering)
    return answers


def test_a_copy_dropped_unrun_while_a_lost_run_is_vouched_for_frees_the_key_after(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker that ran run 1 lost track of it (its broker connection broke while its
    pool ran the job), so run 1's release never comes. A copy of the message, revoked
    meanwhile, is dropped unrun while run 1 is still vouched for: its release is left
    alone then, and frees the key once nobody vouches for run 1 any more."""
    app.conf.unique_lease = timedelta(seconds=1.5)
    store, job, key, header = created(app, "k")
    lost = RunStart(uuid.uuid4().hex, Scope.ACTIVE, "fates.task", 60_000, alive_ms=800)
    assert store.begin_run(job, key, lost).holder is None

    answers = release_answers(store, monkeypatch)
    copy = Fate(app, job, header, Message("ACK"), run=uuid.uuid4().hex)
    copy.message_settled(Settled.FORGOTTEN)  # revoked: acknowledged without running
    eventually(lambda: answers, 5, "the copy's release to reach the store")
    assert answers[0] is False  # run 1 is vouched for: the key is its job's
    assert store.get(key) is not None
    eventually(lambda: store.get(key) is None, 5, "the key to be freed")


def test_a_retry_dropped_before_its_attempt_was_reported_frees_the_key(app: Celery) -> None:
    """Attempt 1 retries; the next attempt, revoked meanwhile, reaches the main process
    (and is dropped unrun) before the pool reports attempt 1. The drop's release must
    not be spent against attempt 1's mark, which attempt 1's end clears only later."""
    store, job, key, header = created(app, "retried")
    first = Fate(app, job, header, Message("ACK"), run=started_run(store, job, key))
    first.started()
    retried = Fate(app, job, header, Message("ACK"), run=uuid.uuid4().hex)
    retried.message_settled(Settled.FORGOTTEN)  # revoked: acknowledged without running
    first.run_ended(pid=None, cut_short=False, continued=True)  # Retry
    first.message_settled(Settled.FORGOTTEN)
    eventually(lambda: store.get(key) is None, 5, "the key to be freed")


def handed_over(store: Store, job: str, key: str) -> str:
    """A run that marked ``key`` handed over to a replacement (``replace()`` before its send)."""
    run = started_run(store, job, key)
    assert store.release_many([Release(job, key, HANDING_OVER, run)]) == [True]
    return run


def test_a_run_that_reports_its_own_end_takes_back_a_hand_over_mark_it_left(app: Celery) -> None:
    """``replace()`` marked the key, then failed before its send and could not take the
    mark back (a soft time limit, a silent store): the run fails. No replacement carries
    the job, so its release must free the key, not leave it to the lease."""
    store, job, key, header = created(app, "unsent")
    fate = Fate(app, job, header, Message("ACK"), run=handed_over(store, job, key))
    fate.started()
    fate.run_ended(pid=None, cut_short=False, continued=False)
    fate.message_settled(Settled.FORGOTTEN)
    eventually(lambda: store.get(key) is None, 5, "the key to be freed")


def test_a_run_cut_short_leaves_the_hand_over_mark_to_the_replacement(app: Celery) -> None:
    """A hard time limit after the mark: the replacement may have left; the key stays."""
    store, job, key, header = created(app, "maybe-sent")
    fate = Fate(app, job, header, Message("ACK"), run=handed_over(store, job, key))
    fate.started()
    fate.run_ended(pid=None, cut_short=True, continued=False)
    fate.message_settled(Settled.FORGOTTEN)
    assert cleanup.flush(5)
    record = store.get(key)
    assert record is not None
    assert record.job_id == job


def _reported(exc: BaseException, *, internal: bool) -> ExceptionInfo:
    """How the pool reports a run's end to the main process."""
    try:
        raise exc
    except BaseException:
        return ExceptionInfo(internal=internal)


def test_an_error_celery_raised_after_the_body_may_hide_a_hand_over() -> None:
    """Celery reports its own error after the body (a soft time limit striking there)
    as an internal error: the body may have raised ``Replaced`` or ``Retry`` before it.
    Retry, Ignore and Reject are reported as internal too, and say how the body ended;
    an error of the body itself is not internal."""
    hidden = _reported(RuntimeError("after the body"), internal=True)
    assert _outside_body(hidden, _exception(hidden))
    for said in (Retry(), Ignore(), Reject("dropped")):
        reported = _reported(said, internal=True)
        assert not _outside_body(reported, _exception(reported))
    own = _reported(ValueError("the body failed"), internal=False)
    assert not _outside_body(own, _exception(own))


def test_an_acknowledgement_never_confirmed_releases_the_key_after_a_while(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run ended; its acknowledgement failed as the broker connection broke, so
    kombu never confirms it, and whether the broker got it is unknown. The key must
    not wait for the lease: it is released once the wait for the confirmation is over."""
    monkeypatch.setattr(fates, "ACK_WAIT_S", 0.3)
    store, job, key, header = created(app, "unconfirmed")
    asked = confirmations_asked(store, key, monkeypatch)
    fate = Fate(app, job, header, Message("RECEIVED"), run=started_run(store, job, key))
    fate.started()
    fate.run_ended(pid=None, cut_short=False, continued=False)
    settled = time.monotonic()
    fate.message_settled(Settled.FORGOTTEN)  # Celery asked for the ack; it failed
    eventually(lambda: asked, 5, "the release to ask whether the ack was confirmed")
    assert asked[0] == (False, True), "not at once: the ack may be on its way"
    eventually(lambda: store.get(key) is None, 5, "the key to be freed")
    assert time.monotonic() - settled >= fates.ACK_WAIT_S


def confirmations_asked(
    store: Store, key: str, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[bool | None, bool]]:
    """Each time a release asks whether kombu confirmed the message's acknowledgement from
    now on: the answer, and whether ``key`` was held as it was given."""
    asked: list[tuple[bool | None, bool]] = []
    forgotten = fates.forgotten

    def asking(message: Any) -> bool | None:
        answer = forgotten(message)
        asked.append((answer, store.get(key) is not None))
        return answer

    monkeypatch.setattr(fates, "forgotten", asking)
    return asked


def test_a_release_after_an_unconfirmed_acknowledgement_leaves_a_copy_running(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker did not get the ack and delivered the message again: the copy runs
    under the key when the wait ends. The release names the ended run: the key stays."""
    monkeypatch.setattr(fates, "ACK_WAIT_S", 0.3)
    store, job, key, header = created(app, "redelivered")
    fate = Fate(app, job, header, Message("RECEIVED"), run=started_run(store, job, key))
    fate.started()
    assert cleanup.flush(5)  # the start's mark, sent in the background, lands first
    fate.run_ended(pid=None, cut_short=False, continued=False)
    fate.message_settled(Settled.FORGOTTEN)
    answers = release_answers(store, monkeypatch)
    copy = started_run(store, job, key)
    assert cleanup.flush(5)  # the release, owed until the wait for the ack is over, was sent
    assert answers == [False]  # and it left the copy's key alone
    record = store.get(key)
    assert record is not None
    assert (record.job_id, record.run) == (job, copy)


def test_a_run_owed_to_duplicates_is_passed_on_before_the_acknowledgement_is_confirmed(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    """A ``latest`` job's run ended as its broker connection broke: kombu never confirms
    the acknowledgement, and the release waits for it. The run the job's duplicates are
    owed must not wait too: a worker that died meanwhile would lose it (should the
    message come back, its copy finds the key the owed run's and does not run)."""

    @app.task(name="fates.latest", shared=False)
    def latest(n: int) -> None: ...

    store = runtime(app).store
    job, key = uuid.uuid4().hex, storage_key(runtime(app).namespace, ACTIVE, "", "owed")
    store_key = runtime(app).signing_key

    def claim(job_id: str, n: int) -> Claim:
        arguments = encode_arguments(
            latest, [n], {}, 1 << 16, storage_key=key, signing_key=store_key
        )
        active = ActiveClaim(key, Scope.ACTIVE, 60_000, OnDuplicate.LATEST, arguments)
        return Claim(job_id, "fates.latest", active)

    assert store.decide([claim(job, 1)])[0].verdict is Verdict.CREATED
    run = uuid.uuid4().hex
    start = RunStart(run, Scope.ACTIVE, "fates.latest", 60_000, follows_duplicates=True)
    assert store.begin_run(job, key, start).holder is None
    owed = uuid.uuid4().hex
    duplicate = store.decide([claim(owed, 2)])[0]
    assert (duplicate.job_id, duplicate.effect) == (job, Effect.RERUN_REQUESTED)

    policy = OnDuplicate.LATEST.code
    header: KeyHeader = {"v": VERSION, "a": key, "s": Scope.ACTIVE.value, "p": policy}
    fate = Fate(app, job, header, Message("RECEIVED"), run=run, task="fates.latest")
    fate.started()
    fate.run_ended(pid=None, cut_short=False, continued=False)
    fate.message_settled(Settled.FORGOTTEN)  # Celery asked for the ack; it failed
    try:
        eventually(lambda: published, 3, "the owed run to be published")
        assert [headers["id"] for headers in published] == [owed]
        held = store.get(key)
        assert held is not None
        assert held.job_id == owed
    finally:
        cleanup.discard(store)  # the release, which waits for an ack that never comes


class _CeleryRequest:
    """What :class:`FateMixin` reads of Celery's request, and the callbacks it extends."""

    def __init__(self, app: Celery, job: str, header: KeyHeader, worker_pid: int) -> None:
        self._request_dict = {HEADER: header}
        self.task = SimpleNamespace(app=app)
        self.id = job
        self.name = "fates.task"
        self._message = Message("ACK")
        self.worker_pid = worker_pid
        self.acknowledged = False
        #: Whether Celery's on_failure ran where a send of the job is the job going on.
        self.resending: list[bool] = []

    def on_accepted(self, pid: Any, time_accepted: float) -> None:
        pass

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        return failed__retval__runtime[1]

    def on_timeout(self, soft: bool, timeout: float) -> None:
        pass

    def acknowledge(self) -> None:
        self.acknowledged = True

    def reject(self, requeue: bool = False) -> None:
        self.acknowledged = True

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        self.resending.append(resend._resending.get() is not None)
        self.failure_flags = (send_failed_event, return_ok)


class _Request(fates.FateMixin, _CeleryRequest):
    pass


def _gone_pid() -> int:
    """The pid of a process that has exited (a pool child the pool lost, say)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


KEPT, FREED = "kept", "freed"


@pytest.mark.parametrize(
    ("exc", "internal", "continued", "stale", "handing_over", "cut_short", "resending", "key"),
    [
        (ValueError("the body failed"), False, False, False, False, False, False, FREED),
        (Retry(), True, True, False, False, False, False, KEPT),
        (fates.Replaced(), True, True, False, True, False, False, KEPT),
        (runs.Deferred(), True, True, False, False, False, False, KEPT),
        (runs.Stale(), True, False, True, False, False, False, KEPT),
        (RuntimeError("after the body"), True, False, False, True, False, False, FREED),
        (TimeLimitExceeded(1.0), False, False, False, True, True, False, FREED),
        (Terminated(9), False, False, False, True, True, False, FREED),
        (WorkerLostError("lost"), False, False, False, True, True, True, FREED),
        (SystemExit(1), False, False, False, True, True, True, FREED),
        (KeyboardInterrupt(), False, False, False, True, True, True, FREED),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None,
)
def test_how_a_run_ended_decides_its_fate(
    app: Celery,
    exc: BaseException,
    internal: bool,
    continued: bool,
    stale: bool,
    handing_over: bool,
    cut_short: bool,
    resending: bool,
    key: str,
) -> None:
    """The exception the pool reports a run's end with is what the fate is told: the job
    goes on (retry, replacement, deferral), is a stale copy, may have handed its key
    over, was cut short (the release waits for its pool child), may be retried by this
    process; and so whether the key is kept or freed."""
    store, job, stored, header = created(app, f"ended-{type(exc).__name__}")
    child = _gone_pid()
    request = _Request(app, job, header, worker_pid=child)
    fate = request._fate
    assert fate is not None
    request.on_accepted(child, time.time())
    fate.message_settled(Settled.FORGOTTEN)  # acknowledged early, as Celery does by default
    request.on_failure(_reported(exc, internal=internal))
    assert (fate.continued, fate.stale, fate.handing_over) == (continued, stale, handing_over)
    assert fate.pool_child == (child if cut_short else None)
    assert request.resending == [resending]
    assert cleanup.flush(5)
    assert (KEPT if store.get(stored) else FREED) == key


@contextmanager
def delivered(app: Celery, job: str, header: KeyHeader) -> Iterator[tuple[Any, Any]]:
    """``job``'s message, carrying ``header``, as a worker's consumer gets it from the
    broker (kombu's in-memory one): not yet acknowledged, and acknowledged for real.
    Yields its queue and the message."""
    sent = app.amqp.as_task_v2(job, "fates.task", args=(), kwargs={})
    with (
        app.connection_for_write() as connection,
        connection.SimpleQueue(f"fates-{uuid.uuid4().hex}") as queue,
    ):
        queue.put(
            sent.body,
            headers={**sent.headers, HEADER: header},
            serializer="json",
            **sent.properties,
        )
        yield queue, queue.get(timeout=1)


def _from_the_body(request: Any, exc: BaseException) -> None:
    """The pool child's report of a body that raised: a failed result, which Celery's
    ``on_success`` hands on to ``on_failure`` (Reject and Ignore are Celery's own errors)."""
    internal = isinstance(exc, Reject | Ignore)
    request.on_success((True, _reported(exc, internal=internal), 0.0))


def _from_the_pool(request: Any, exc: BaseException) -> None:
    """The pool's own report of a run it lost, or cut short."""
    request.on_failure(_reported(exc, internal=False))


def _hard_limit(request: Any, exc: BaseException) -> None:
    """A hard time limit: the worker's timer calls ``on_timeout``, then the pool reports
    the killed child."""
    request.on_timeout(False, 1.0)
    _from_the_pool(request, exc)


ACKED, DROPPED, REQUEUED = "acknowledged", "dropped", "requeued"


def where(queue: Any, message: Any) -> str:
    """What the broker did with ``message``, as far as kombu knows (a requeued message is
    ``REJECTED`` to kombu too; it is back in its queue)."""
    if message._state == "ACK":
        return ACKED
    assert message._state == "REJECTED", f"the message was left {message._state}"
    try:
        again = queue.get_nowait()
    except queue.Empty:
        return DROPPED
    assert again.headers["id"] == message.headers["id"]
    again.ack()
    return REQUEUED


#: Where a time limit leaves an ``acks_late`` message that is not acknowledged on a time
#: limit, and its key: Celery 5.5 and later requeue it (the job runs again), earlier
#: Celery drops it.
TIMED_OUT = (REQUEUED, KEPT) if celery.VERSION >= (5, 5) else (DROPPED, FREED)
LATE: dict[str, Any] = {"acks_late": True}
#: ``task_acks_on_failure_or_timeout = False``: a failure is rejected, a time limit requeued.
NO_ACK: dict[str, Any] = {"acks_late": True, "acks_on_failure_or_timeout": False}


def _end(
    report: Callable[[Any, BaseException], None],
    exc: BaseException,
    options: dict[str, Any],
    state: str,
    key: str,
    name: str,
) -> Any:
    return pytest.param(report, exc, options, state, key, id=name)


@pytest.mark.parametrize(
    ("report", "exc", "options", "state", "key"),
    [
        _end(_from_the_body, ValueError("failed"), {}, ACKED, FREED, "error"),
        _end(_from_the_body, ValueError("failed"), LATE, ACKED, FREED, "error-late"),
        _end(_from_the_body, ValueError("failed"), NO_ACK, DROPPED, FREED, "error-no-ack"),
        _end(_from_the_body, SoftTimeLimitExceeded(), LATE, ACKED, FREED, "soft-limit-late"),
        _end(_from_the_body, Retry(), {}, ACKED, KEPT, "retry"),
        _end(_from_the_body, Retry(), LATE, ACKED, KEPT, "retry-late"),
        _end(_from_the_body, Reject(requeue=True), LATE, REQUEUED, KEPT, "requeue-late"),
        # Acknowledged as the run started: Celery's requeue comes too late to happen.
        _end(_from_the_body, Reject(requeue=True), {}, ACKED, FREED, "requeue"),
        _end(_from_the_body, Reject(requeue=False), LATE, DROPPED, FREED, "reject-late"),
        _end(_from_the_body, Ignore(), LATE, ACKED, FREED, "ignore-late"),
        _end(_from_the_pool, WorkerLostError(), {}, ACKED, FREED, "lost"),
        _end(_from_the_pool, WorkerLostError(), LATE, ACKED, FREED, "lost-late"),
        _end(
            _from_the_pool,
            WorkerLostError(),
            {**LATE, "reject_on_worker_lost": True},
            REQUEUED,
            KEPT,
            "lost-late-requeued",
        ),
        _end(_from_the_pool, WorkerLostError(), NO_ACK, DROPPED, FREED, "lost-no-ack"),
        _end(_hard_limit, TimeLimitExceeded(1.0), {}, ACKED, FREED, "hard-limit"),
        _end(_hard_limit, TimeLimitExceeded(1.0), LATE, ACKED, FREED, "hard-limit-late"),
        _end(_hard_limit, TimeLimitExceeded(1.0), NO_ACK, *TIMED_OUT, "hard-limit-no-ack"),
        _end(_from_the_pool, TimeLimitExceeded(1.0), NO_ACK, *TIMED_OUT, "limit-no-ack"),
        _end(_from_the_pool, Terminated(9), {}, ACKED, FREED, "terminated"),
        _end(_from_the_pool, Terminated(9), LATE, ACKED, FREED, "terminated-late"),
    ],
)
def test_celerys_own_request_and_the_fate_agree_on_every_end(
    app: Celery,
    report: Callable[[Any, BaseException], None],
    exc: BaseException,
    options: dict[str, Any],
    state: str,
    key: str,
) -> None:
    """Celery's request class decides what becomes of the message (acknowledged, rejected,
    requeued) from the exception and the task's acks_late, reject_on_worker_lost and
    acks_on_failure_or_timeout; with the fate mixed in, the key is kept exactly when the
    job can still run: it goes on (a retry) or its message went back to the queue."""

    @app.task(name="fates.task", shared=False, **options)
    def task() -> None: ...

    assert _ended(app, task, report, exc) == (state, key)


def _ended(
    app: Celery, task: Any, report: Callable[[Any, BaseException], None], exc: BaseException
) -> tuple[str, str]:
    """Where a delivery of a job of ``task`` whose run ``report`` ends with ``exc`` left its
    message, and whether the job's key was kept or freed, once the fate was decided."""
    store, job, stored, header = created(app, f"celery-{uuid.uuid4().hex}")
    child = _gone_pid()
    with delivered(app, job, header) as (queue, message):
        request = fates.UniqueRequest(
            message,
            on_ack=message.ack_log_error,
            on_reject=message.reject_log_error,
            app=app,
            task=task,
            hostname="fates@test",
        )
        fate = request._fate
        assert fate is not None
        request.on_accepted(child, time.monotonic())
        report(request, exc)
        assert fate.decided, "the end left the message's fate open"
        assert cleanup.flush(5)  # and whatever the decision owed the store was sent
        return where(queue, message), KEPT if store.get(stored) else FREED


#: Celery 5.7 and later send a job whose pool child was lost again (``retry_on_worker_lost``).
RETRIES_LOST_RUNS = celery.VERSION >= (5, 7)


def test_a_lost_run_celery_sends_again_keeps_the_key(app: Celery) -> None:
    """``retry_on_worker_lost``: the worker's main process sends the lost job again under its
    id and acknowledges its message: the job goes on, and its key stays. (Before Celery 5.7
    the lost run ends the job, and the key is freed.)"""

    @app.task(
        base=UniqueTask,
        name="fates.task",
        shared=False,
        acks_late=True,
        retry_on_worker_lost=True,
        unique_key=lambda job: "lost",
        unique_while="active",
    )
    def task() -> None: ...

    ended = _ended(app, task, _from_the_pool, WorkerLostError())
    assert ended == (ACKED, KEPT if RETRIES_LOST_RUNS else FREED)


def test_a_lost_run_of_a_plain_task_celery_sends_again_keeps_the_key(app: Celery) -> None:
    """The same for a task that is not a ``UniqueTask`` but carries the job's keys (the
    replacement of a unique job): its re-send is the job going on too. The main process
    sees a re-send through the publish gate, which the worker's start installs there
    (no unique dispatch from that process need have installed it)."""

    @app.task(name="fates.task", shared=False, acks_late=True, retry_on_worker_lost=True)
    def task() -> None: ...

    class Worker:  # the sender of worker_init: Celery's WorkController, with its app
        def __init__(self) -> None:
            self.app = app

    celery_unique.install(app)  # as binding the app's unique tasks does
    celery.signals.worker_init.send(sender=Worker())
    ended = _ended(app, task, _from_the_pool, WorkerLostError())
    assert ended == (ACKED, KEPT if RETRIES_LOST_RUNS else FREED)


def test_the_wait_for_an_unconfirmed_acknowledgement_is_the_documented_10_s() -> None:
    """docs/failure-modes.md and docs/policies.md promise a release waits up to 10 s for
    kombu to confirm an acknowledgement (the tests above shorten it to run quickly)."""
    assert fates.ACK_WAIT_S == 10.0


@pytest.fixture
def released() -> Iterator[list[dict[str, Any]]]:
    """Every key_released signal sent during the test."""
    seen: list[dict[str, Any]] = []

    def receive(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    unique_signals.key_released.connect(receive, weak=False, dispatch_uid="test.fates")
    yield seen
    unique_signals.key_released.disconnect(receive, dispatch_uid="test.fates")


@pytest.mark.parametrize(
    ("scope", "extra", "reason", "kept"),
    [
        (Scope.ACTIVE, {}, ReleaseReason.FINISHED, False),
        (Scope.EXISTS, {"r": 30_000}, ReleaseReason.FINISHED, True),
        # result_expires off: the exists key has no retention and is kept for good.
        (Scope.EXISTS, {"r": None}, ReleaseReason.FINISHED, True),
        (Scope.QUEUED, {}, ReleaseReason.STARTED, False),
    ],
    ids=["active", "exists", "exists-for-good", "queued"],
)
def test_a_release_says_why_and_whether_the_key_stays_for_its_retention(
    app: Celery,
    released: list[dict[str, Any]],
    scope: Scope,
    extra: dict[str, Any],
    reason: ReleaseReason,
    kept: bool,
) -> None:
    """key_released names the job, the key and why (a queued key goes when its job
    starts, others when it ends), and ``kept`` is true only for an ``exists`` key kept
    for its retention."""
    _, job, key, header = created(app, f"signalled-{scope.value}", scope)
    header = {**header, **extra}  # type: ignore[typeddict-item]
    fate = Fate(app, job, header, Message("ACK"))
    fate.started()
    fate.run_ended(pid=None, cut_short=False, continued=False)
    fate.message_settled(Settled.FORGOTTEN)
    assert cleanup.flush(5)
    assert [(s["job_id"], s["storage_key"], s["reason"], s["kept"]) for s in released] == [
        (job, key, reason, kept)
    ]


def owed_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float | None]]:
    """(what, ``within_s``) of every write a fate owes the store from now on, in order."""
    owed: list[tuple[str, float | None]] = []
    for name in ("release", "release_once_unmarked"):
        send = getattr(cleanup, name)

        def recording(*args: Any, _send: Any = send, _name: str = name, **kwargs: Any) -> Any:
            owed.append((_name, kwargs["within_s"]))
            return _send(*args, **kwargs)

        monkeypatch.setattr(cleanup, name, recording)
    return owed


@pytest.mark.parametrize(("lease", "within_s"), [(timedelta(seconds=90), 90.0), (0, None)])
def test_every_write_a_fate_owes_gives_up_with_the_lease(
    app: Celery, monkeypatch: pytest.MonkeyPatch, lease: Any, within_s: float | None
) -> None:
    """A write the store does not take is retried until the key's lease would have
    ended it anyway (no lease: until the longest a write is owed): the run's mark,
    the release of the job's key and of the key a replacement holds of its own, and
    the release of a copy dropped unrun while another delivery's run holds the key."""
    app.conf.unique_lease = lease
    store, job, key, header = created(app, "owed")
    own_key = created(app, "owed-own")[2]
    owed = owed_writes(monkeypatch)
    fate = Fate(app, job, {**header, "x": {"a": own_key, "s": "active"}}, Message("ACK"), "r1")
    fate.started()
    fate.run_ended(pid=None, cut_short=False, continued=False)
    fate.message_settled(Settled.FORGOTTEN)
    assert cleanup.flush(5)
    assert owed == [("release", within_s)] * 3  # the mark, then the own key and the job's
    owed.clear()

    store, job, key, header = created(app, "owed-copy")
    assert (
        store.begin_run(job, key, RunStart("r0", Scope.ACTIVE, "fates.task", 60_000)).holder is None
    )
    copy = Fate(app, job, header, Message("ACK"), run=uuid.uuid4().hex)
    copy.message_settled(Settled.FORGOTTEN)
    eventually(lambda: len(owed) == 2, 5, "the copy's release to be owed again")
    cleanup.discard(store)
    assert owed == [("release", within_s), ("release_once_unmarked", within_s)]


def test_only_the_first_settlement_of_a_message_counts(app: Celery) -> None:
    """Celery acknowledges or rejects a message once; a second call (already
    acknowledged) tells the fate nothing. ``reject(requeue=True)`` puts the message
    back; a plain reject, like an acknowledgement, has the broker forget it."""
    for settle, settled in [
        (lambda r: r.acknowledge(), Settled.FORGOTTEN),
        (lambda r: r.reject(), Settled.FORGOTTEN),
        (lambda r: r.reject(requeue=True), Settled.REQUEUED),
    ]:
        _, job, _, header = created(app, f"settled-{uuid.uuid4().hex}")
        request = _Request(app, job, header, worker_pid=os.getpid())
        assert request._fate is not None
        settle(request)
        assert request._fate.settled is settled
        request.reject(requeue=settled is Settled.FORGOTTEN)
        request.acknowledge()
        assert request._fate.settled is settled
    assert cleanup.flush(5)


def test_a_request_without_a_key_is_acknowledged_and_rejected_as_celery_does(app: Celery) -> None:
    """A message without an active key of this namespace has no fate to follow:
    acknowledging or rejecting it is Celery's alone."""
    for settle in (lambda r: r.acknowledge(), lambda r: r.reject(), lambda r: r.reject(True)):
        request = _Request(app, uuid.uuid4().hex, {}, worker_pid=os.getpid())  # type: ignore[typeddict-item]
        assert request._fate is None
        settle(request)
        assert request.acknowledged


def test_a_run_that_succeeds_frees_its_key_once_acknowledged(app: Celery) -> None:
    """``on_success`` ends the run (Celery's own result comes back unchanged); a failure
    reported through it is left to ``on_failure``; a request without a key is Celery's."""
    store, job, key, header = created(app, "succeeded")
    request = _Request(app, job, header, worker_pid=os.getpid())
    fate = request._fate
    assert fate is not None
    request.on_accepted(os.getpid(), time.time())
    assert request.on_success((True, "failed", 0.1)) == "failed"
    assert not fate.ended
    fate.message_settled(Settled.FORGOTTEN)
    assert request.on_success((False, "result", 0.1)) == "result"
    # The run reported its own end: nothing to wait for, no hand-over to leave in place.
    assert (fate.handing_over, fate.pool_child) == (False, None)
    assert cleanup.flush(5)
    assert store.get(key) is None
    plain = _Request(app, uuid.uuid4().hex, {}, worker_pid=os.getpid())  # type: ignore[typeddict-item]
    assert plain.on_success((False, "plain", 0.1)) == "plain"


def test_a_hard_time_limit_ends_the_run_and_a_soft_one_does_not(app: Celery) -> None:
    """A hard time limit cuts the run short (the release waits for the pool child) and
    ends the job: its key goes once the message is forgotten. A soft one only raises in
    the body, which goes on."""
    store, job, key, header = created(app, "timed-out")
    request = _Request(app, job, header, worker_pid=_gone_pid())
    fate = request._fate
    assert fate is not None
    request.on_accepted(request.worker_pid, time.time())
    request.on_timeout(True, 1.0)
    assert fate.pool_child is None
    request.on_timeout(False, 2.0)
    assert fate.pool_child == request.worker_pid
    fate.message_settled(Settled.FORGOTTEN)
    assert cleanup.flush(5)
    assert store.get(key) is None
    plain = _Request(app, uuid.uuid4().hex, {}, worker_pid=os.getpid())  # type: ignore[typeddict-item]
    plain.on_timeout(False, 2.0)
    assert cleanup.flush(5)


def test_keys_of_a_run_cut_short_wait_for_its_pool_child_to_exit(app: Celery) -> None:
    """The pool child of a run cut short may still be on its way out: neither the job's
    key nor the key a replacement holds of its own goes before it has exited."""
    store, job, key, header = created(app, "cut-short")
    own_key = storage_key(runtime(app).namespace, ACTIVE, "", "cut-short-own")
    own = Claim(job, "fates.task", ActiveClaim(own_key, Scope.ACTIVE, 60_000))
    assert store.decide([own])[0].verdict is Verdict.CREATED
    child = subprocess.Popen(["sleep", "30"])
    try:
        fate = Fate(app, job, {**header, "x": {"a": own_key, "s": "active"}}, Message("ACK"))
        fate.started()
        fate.run_ended(pid=child.pid, cut_short=True, continued=False)
        fate.message_settled(Settled.FORGOTTEN)
        assert not cleanup.flush(0.5)  # both releases wait for the child
        assert store.get(key) is not None
        assert store.get(own_key) is not None
    finally:
        child.kill()
        child.wait()
    eventually(lambda: store.get(key) is None and store.get(own_key) is None, 5, "both freed")


def test_a_key_outside_the_namespace_is_dropped_from_the_request_itself(app: Celery) -> None:
    """A message naming a key of another namespace: the key is ignored, and removed
    from the request so that nothing later in the worker acts on it."""
    _, job, _, header = created(app, "confined")
    foreign = storage_key("another-namespace", ACTIVE, "", "theirs")
    request = _Request(app, job, {**header, "x": {"a": foreign, "s": "active"}}, os.getpid())
    assert request._fate is not None
    assert request._request_dict[HEADER] == header
    assert request._fate.header == header
    alone = _Request(app, job, {**header, "a": foreign}, os.getpid())
    assert alone._fate is None
    assert "a" not in alone._request_dict[HEADER]


def test_an_acknowledgement_counts_as_made_once_the_wait_for_it_is_over() -> None:
    """Confirmed (acknowledged or rejected): forgotten at once; requeued: never; not
    confirmed yet: not before the wait is over, then taken as made."""
    assert fates.forgotten_within(Message("ACK"), 60)() is True
    assert fates.forgotten_within(Message("REJECTED"), 60)() is True
    assert fates.forgotten_within(Message("REQUEUED"), 0)() is None
    assert fates.forgotten_within(SimpleNamespace(), 0)() is True  # no state: taken as made
    assert fates.forgotten(SimpleNamespace()) is False  # ...once the wait is over, not before
    unconfirmed = fates.forgotten_within(Message("RECEIVED"), 0.3)
    assert unconfirmed() is False
    eventually(lambda: unconfirmed() is True, 5, "the wait to be over")


def test_a_lost_run_of_a_job_with_only_a_window_key_is_resent_as_the_job_going_on(
    app: Celery,
) -> None:
    """No active key to follow, but a window key naming the job: Celery's retry of the
    lost run is the job going on (published whatever the window key holds). A message
    with no key at all is Celery's alone."""
    window = storage_key(runtime(app).namespace, "w", "", "window-only")
    windowed = _Request(app, uuid.uuid4().hex, {"v": VERSION, "w": window}, os.getpid())
    plain = _Request(app, uuid.uuid4().hex, {}, os.getpid())  # type: ignore[typeddict-item]
    for request in (windowed, plain):
        assert request._fate is None
        request.on_failure(_reported(WorkerLostError("lost"), internal=False))
    assert (windowed.resending, plain.resending) == ([True], [False])


def test_only_a_delivery_that_never_ran_has_a_refused_release_owed_again(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's release that finds the key another job's is refused, and that is final:
    it is not sent again each vouching round as an unrun copy's is."""
    store, holder, key, header = created(app, "another-jobs")
    owed = owed_writes(monkeypatch)
    fate = Fate(app, uuid.uuid4().hex, header, Message("ACK"), run=uuid.uuid4().hex)
    fate.started()
    fate.run_ended(pid=None, cut_short=False, continued=False)
    fate.message_settled(Settled.FORGOTTEN)
    assert cleanup.flush(5)
    assert [name for name, _ in owed] == ["release", "release"]  # its mark, its release
    record = store.get(key)
    assert record is not None
    assert record.job_id == holder


@pytest.mark.parametrize("version", [None, VERSION - 1, VERSION + 1, str(VERSION)])
def test_a_key_header_of_another_version_is_not_followed(app: Celery, version: Any) -> None:
    """A header without this version (none, an older or a future one) is not read: the
    request has no fate to follow."""
    _, job, _, header = created(app, f"version-{version}")
    other: dict[str, Any] = {**header, "v": version}
    if version is None:
        del other["v"]
    assert _Request(app, job, other, os.getpid())._fate is None  # type: ignore[arg-type]
    assert _Request(app, job, header, os.getpid())._fate is not None


def test_a_request_class_gets_fates_mixed_in_once() -> None:
    """Each request class gets one subclass with :class:`FateMixin`, reused; a class
    that has it already is kept as it is."""

    class Custom(_CeleryRequest):
        pass

    mixed = fates.with_fates(Custom)
    assert issubclass(mixed, fates.FateMixin)
    assert issubclass(mixed, Custom)
    assert mixed.__name__ == "UniqueCustom"
    assert fates.with_fates(Custom) is mixed
    assert fates.with_fates(_Request) is _Request


def test_a_run_cut_short_waits_for_any_process_but_this_one(app: Celery) -> None:
    """The pool child to wait for is whatever process ran the job (its pid may be lower
    than this one's); a run in this very process (a thread pool) leaves none."""
    _, job, _, header = created(app, "which-child")
    for pid, child in [(1, 1), (os.getpid() + 1, os.getpid() + 1), (os.getpid(), None)]:
        fate = Fate(app, job, header, Message("ACK"))
        fate.run_ended(pid=pid, cut_short=True, continued=False)
        assert fate.pool_child == child
    fate = Fate(app, job, header, Message("ACK"))
    fate.run_ended(pid=1, cut_short=False, continued=False)
    assert fate.pool_child is None  # a run that ended by itself left no child behind


def test_a_fate_is_decided_once(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked again (another callback of the same message), a decided fate sends nothing
    more: the key's release goes once."""
    _, job, _, header = created(app, "decided")
    owed = owed_writes(monkeypatch)
    fate = Fate(app, job, header, Message("ACK"))
    fate.started()
    fate.run_ended(pid=None, cut_short=False, continued=False)
    fate.message_settled(Settled.FORGOTTEN)
    fate.check()
    fate.message_settled(Settled.REQUEUED)
    assert cleanup.flush(5)
    assert owed == [("release", 3600.0)]
    assert fate.settled is Settled.FORGOTTEN


def test_a_job_this_worker_sent_again_keeps_its_key(app: Celery) -> None:
    """A lost run that Celery retried from this process (the send went out): the job
    goes on under its id, so its key stays; a send that did not go out frees it."""
    for published, kept in [(True, True), (False, False)]:
        store, job, key, header = created(app, f"resent-{published}")
        fate = Fate(app, job, header, Message("ACK"))
        fate.started()
        fate.run_ended(pid=None, cut_short=True, continued=False)
        fate.resent = resend.Resend(job, header, published=published)
        fate.message_settled(Settled.FORGOTTEN)
        assert cleanup.flush(5)
        assert (store.get(key) is not None) is kept


def run_writes(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The ``keep_ms`` of each batch of writes a fate owes, in order (marks of runs are
    negative: see celery_unique.stores.base)."""
    batches: list[list[int]] = []
    send = cleanup.release

    def recording(store: Store, hold: Release, **kwargs: Any) -> None:
        batches.append([write.keep_ms for write in kwargs.get("first") or ()] + [hold.keep_ms])
        send(store, hold, **kwargs)

    monkeypatch.setattr(cleanup, "release", recording)
    return batches


def test_a_run_requeued_before_its_end_was_reported_leaves_a_hand_over_mark(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until a run reports how it ended, it may have handed its key over: requeued then,
    its end leaves any hand-over mark to the replacement. A run that reported its own
    end takes back a mark it left."""
    for reported, end in [(False, [GOES_ON]), (True, [HAND_OVER_UNDONE, GOES_ON])]:
        _, job, _, header = created(app, f"requeued-{reported}")
        batches = run_writes(monkeypatch)
        fate = Fate(app, job, header, Message("ACK"), run=uuid.uuid4().hex)
        fate.started()
        if reported:
            fate.run_ended(pid=None, cut_short=False, continued=False)
        fate.message_settled(Settled.REQUEUED)
        assert cleanup.flush(5)
        assert batches == [[RUNNING], end]


def test_an_on_success_of_a_subclass_is_followed_too(app: Celery) -> None:
    """The worker subclasses the request class once more per task, with an on_success of
    its own that does not call ours: the run is followed around it (and a subclass
    without one keeps the one it inherits)."""

    class PerTask(_Request):
        def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
            return "its own"

    class Plain(_Request):
        pass

    for request_class, returned in [(PerTask, "its own"), (Plain, "result")]:
        store, job, key, header = created(app, f"subclass-{request_class.__name__}")
        request = request_class(app, job, header, worker_pid=os.getpid())
        request.on_accepted(os.getpid(), time.time())
        assert request._fate is not None
        request._fate.message_settled(Settled.FORGOTTEN)
        assert request.on_success((False, "result", 0.1)) == returned
        assert cleanup.flush(5)
        assert store.get(key) is None


def test_a_copy_dropped_before_an_earlier_run_was_decided_waits_for_it(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release of a copy dropped unrun waits, sent not at all, for the decision on an
    earlier run of its job in this worker; then goes once that is decided."""
    store, job, key, header = created(app, "deferred")
    owed = owed_writes(monkeypatch)
    first = Fate(app, job, header, Message("ACK"), run=started_run(store, job, key))
    first.started()
    copy = Fate(app, job, header, Message("ACK"), run=uuid.uuid4().hex)
    copy.message_settled(Settled.FORGOTTEN)
    assert [name for name, _ in owed] == ["release"]  # the first run's mark, nothing of the copy
    first.run_ended(pid=None, cut_short=False, continued=True)  # Retry
    first.message_settled(Settled.FORGOTTEN)
    eventually(lambda: store.get(key) is None, 5, "the key to be freed")
    assert [name for name, _ in owed][:3] == ["release", "release", "release"]


def test_on_failure_passes_celerys_defaults_on(app: Celery) -> None:
    """Called as Celery calls it, with the exception alone, on_failure hands Celery's
    own defaults on: send the failed event, do not return ok."""
    _, job, _, header = created(app, "defaults")
    for request in (
        _Request(app, job, header, os.getpid()),
        _Request(app, uuid.uuid4().hex, {}, os.getpid()),  # type: ignore[typeddict-item]
    ):
        request.on_failure(_reported(ValueError("failed"), internal=False))
        assert request.failure_flags == (True, False)
    assert cleanup.flush(5)


def test_a_copy_dropped_unrun_is_sent_again_each_vouching_round_and_its_slack(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sent again sooner than a vouching round and its slack, the release would only
    find the other run still vouched for."""
    app.conf.unique_lease = timedelta(seconds=90)
    every: list[float] = []
    send = cleanup.release_once_unmarked

    def recording(*args: Any, **kwargs: Any) -> None:
        every.append(kwargs["every_s"])
        send(*args, **kwargs)

    monkeypatch.setattr(cleanup, "release_once_unmarked", recording)
    store, job, key, header = created(app, "vouched-copy")
    assert (
        store.begin_run(job, key, RunStart("r0", Scope.ACTIVE, "fates.task", 60_000)).holder is None
    )
    Fate(app, job, header, Message("ACK"), run=uuid.uuid4().hex).message_settled(Settled.FORGOTTEN)
    eventually(lambda: every, 5, "the copy's release to be owed again")
    cleanup.discard(store)
    assert every == [alive.interval_s(90_000) + runs.BUSY_SLACK_S]


def test_a_copy_waits_for_every_undecided_run_of_its_job_and_none_is_kept_after(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs of a job started in this worker: once the first is decided, a copy
    dropped unrun still waits for the second; once all are decided, nothing of the job
    is left behind in the worker."""
    store, job, key, header = created(app, "two-runs")
    first = Fate(app, job, header, Message("ACK"), run=started_run(store, job, key))
    second = Fate(app, job, header, Message("ACK"), run=uuid.uuid4().hex)
    first.started()
    second.started()
    first.run_ended(pid=None, cut_short=False, continued=True)  # Retry
    first.message_settled(Settled.FORGOTTEN)
    assert cleanup.flush(5)
    owed = owed_writes(monkeypatch)
    copy = Fate(app, job, header, Message("ACK"), run=uuid.uuid4().hex)
    copy.message_settled(Settled.FORGOTTEN)
    assert owed == []  # waits for the second run
    second.run_ended(pid=None, cut_short=False, continued=False)
    second.message_settled(Settled.FORGOTTEN)
    assert cleanup.flush(5)
    assert [name for name, _ in owed][:2] == ["release", "release"]  # the second's, the copy's
    assert job not in fates._undecided


def test_a_delivery_requeued_before_it_ran_owes_its_key_nothing(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker took the message back before the pool started it: no run of it marked
    the key, so there is no run's end to write."""
    store, job, key, header = created(app, "requeued-unrun")
    owed = owed_writes(monkeypatch)
    fate = Fate(app, job, header, Message("REQUEUED"), run=uuid.uuid4().hex)
    fate.message_settled(Settled.REQUEUED)
    assert owed == []
    assert store.get(key) is not None, "the job is still queued"


def test_the_key_a_replacement_holds_of_its_own_waits_for_the_acknowledgement_too(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like the job's key, the replacement's own key goes once kombu confirmed the
    acknowledgement: the broker may deliver the message again until then."""
    monkeypatch.setattr(fates, "ACK_WAIT_S", 60.0)
    store, job, key, header = created(app, "replaced-job")
    own_key = storage_key(runtime(app).namespace, ACTIVE, "", "replaced-own")
    own = Claim(job, "fates.task", ActiveClaim(own_key, Scope.ACTIVE, 60_000))
    assert store.decide([own])[0].verdict is Verdict.CREATED
    message = Message("RECEIVED")
    fate = Fate(app, job, {**header, "x": {"a": own_key, "s": "active"}}, message, "r1")
    fate.started()
    fate.run_ended(pid=None, cut_short=False, continued=False)
    fate.message_settled(Settled.FORGOTTEN)  # Celery asked for the ack: not confirmed yet
    assert not cleanup.flush(0.5), "both releases wait for the confirmation"
    assert (store.get(key) is not None, store.get(own_key) is not None) == (True, True)
    message._state = "ACK"
    assert cleanup.flush(5)
    assert (store.get(key), store.get(own_key)) == (None, None)


def test_a_request_class_copying_a_followed_on_success_is_not_followed_twice() -> None:
    class Copying(_Request):
        on_success = _Request.on_success

    assert Copying.on_success is _Request.on_success
