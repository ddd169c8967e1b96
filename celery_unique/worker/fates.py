"""What becomes of each message, learnt where Celery decides it, and the keys released to match.

The rule: an active-type key is held while its job can still run (its
message is in the broker, reserved, running, retrying or requeued) and is
released, as its scope says, only once the broker has forgotten the message
and no run is in progress.

Celery's signals cannot tell those apart (a hard time limit sends
``task_failure`` and then requeues the message; a rejected message reaches
``task_postrun`` as ``REJECTED`` whether or not it is requeued). Celery's
request class can: it lives in the worker's main process, whatever the pool,
and every decision about its message passes through it. So every task a
worker runs gets a request class with :class:`FateMixin` mixed in
(:mod:`celery_unique.worker.step`), which follows four things:

* the run: accepted by the pool (``on_accepted``), ended (``on_success``,
  ``on_failure``, a hard ``on_timeout``), and whether it ended abnormally (a
  lost or killed pool child, a time limit), in which case the release waits
  until the child process is gone;
* the message: ``acknowledge()`` or ``reject(requeue=False)`` (the broker
  forgets it, once kombu confirms it really did), or ``reject(requeue=True)``
  (back in the queue: the job will run again, the key stays);
* whether the job goes on under its id in another message: a retry
  (``Retry``), a replacement (``Replaced``, raised by ``UniqueTask.replace``),
  a lost child's retry sent by this very process (``task_retry_on_worker_lost``);
* the key header the message carries.

============================================  ==========================  ========
path                                          the message                  the key
============================================  ==========================  ========
success, failure for good, ``Ignore``          acknowledged                 released
``retry()``, ``autoretry_for``                 re-sent under the same id    kept
``Reject(requeue=True)``, a lost child or a   requeued                     kept
hard time limit with ``acks_late`` requeueing
a lost child retried by the worker            re-sent by the main process  kept
``Reject(requeue=False)``, revoked, expired   dropped                      released
``replace()``                                 continued by the replacement kept
============================================  ==========================  ========

A ``queued`` key is released when the pool accepts the job (it starts), or
when its message is dropped without running. Releases are sent by the
background thread of :mod:`celery_unique.stores.cleanup`: the main process's event
loop never waits for the store, and a release the store does not take now is
retried until it does.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery.exceptions import Ignore, Reject, Retry
from celery.worker.request import Request

from celery_unique.config import own_namespace, runtime
from celery_unique.dispatch import resend
from celery_unique.dispatch.apply import release_at
from celery_unique.dispatch.headers import HEADER, VERSION, KeyHeader, confined, read_header
from celery_unique.signals import ReleaseReason, emit_released
from celery_unique.stores import cleanup
from celery_unique.stores.base import GOES_ON, HAND_OVER_UNDONE, RUNNING, Release
from celery_unique.worker import alive, follow_up, runs


class Replaced(Ignore):
    """``replace()`` ended the job's run: the replacement carries the job on, under its id."""


#: Exceptions with which the pool reports a run it cut short: the pool child
#: may still be on its way out when the main process hears of it.
_CUT_SHORT = (WorkerLostError, TimeLimitExceeded, Terminated, SystemExit, KeyboardInterrupt)
_RESENDING = (WorkerLostError, SystemExit, KeyboardInterrupt)


class Settled(enum.Enum):
    FORGOTTEN = "forgotten"
    REQUEUED = "requeued"


_lock = threading.Lock()


class Fate:
    """One message's fate, as far as its job's keys are concerned."""

    __slots__ = (
        "app",
        "continued",
        "decided",
        "deferred",
        "ended",
        "handing_over",
        "header",
        "job_id",
        "message",
        "pool_child",
        "ran",
        "resent",
        "run",
        "running",
        "settled",
        "stale",
        "task",
    )

    def __init__(
        self,
        app: Any,
        job_id: str,
        header: KeyHeader,
        message: Any,
        run: str | None = None,
        *,
        task: str | None = None,
    ) -> None:
        self.app, self.job_id, self.header, self.message = app, job_id, header, message
        #: The name of the task the message runs.
        self.task = task
        #: This delivery's run id (see :mod:`celery_unique.worker.runs`).
        self.run = run
        #: The pool took the job: its run may have marked the key.
        self.ran = False
        #: The run found the key held by another job and did not go ahead.
        self.stale = False
        self.running = False
        self.ended = False
        #: The pool child to wait for before releasing (a run cut short).
        self.pool_child: int | None = None
        self.settled: Settled | None = None
        self.continued = False
        self.resent: resend.Resend | None = None
        self.decided = False
        #: The run may have handed its key to a replacement: it was replaced, cut
        #: short (a replacement may have left just before), or Celery's code raised
        #: after the body (hiding how it ended). Any other end was reported by the
        #: run itself, which sent no replacement.
        self.handing_over = True
        #: Releases of other deliveries of the job that wait for this one's decision.
        self.deferred: list[Callable[[], None]] = []

    def started(self) -> None:
        with _lock:
            _undecided.setdefault(self.job_id, []).append(self)
        self.running = self.ran = True
        self._release_own(finished=False)
        if release_at(self.job_id, self.header, finished=False) is not None:
            self._release(finished=False)
        elif self.run is not None:
            # The pool marks the key before the body runs; this mark follows in
            # order with this process's other writes, for a run the store could
            # not mark then (see celery_unique.worker.runs).
            self._owe_run_write(RUNNING)

    def run_ended(
        self,
        *,
        pid: int | None,
        cut_short: bool,
        continued: bool,
        stale: bool = False,
        may_have_handed_over: bool = False,
    ) -> None:
        """Note the end of the run; :meth:`check` after Celery settled the message.

        ``may_have_handed_over``: the run raised ``Replaced``, or its end is hidden
        behind an error Celery raised after the body."""
        with _lock:
            self.running = False
            self.ended = True
            self.continued = self.continued or continued
            self.stale = self.stale or stale
            self.handing_over = cut_short or may_have_handed_over
            if cut_short and pid is not None and pid != os.getpid():
                self.pool_child = pid

    def message_settled(self, settled: Settled) -> None:
        with _lock:
            if self.settled is None:
                self.settled = settled
        self.check()

    def check(self) -> None:
        """Release the keys once the broker forgot the message and no run is in progress."""
        with _lock:
            if self.decided or self.settled is None:
                return
            if self.settled is Settled.FORGOTTEN and self.running:
                return
            self.decided = True
            keep = self.settled is Settled.REQUEUED or self.continued
            if self.resent is not None and self.resent.published:
                keep = True
            waiting, self.deferred = self.deferred, []
            if self.ran:
                _forget_undecided(self)
        if self.stale:
            pass  # the key is another job's
        elif not keep:
            self._release(finished=True)
        elif self.ran and self.run is not None:
            self._owe_run_write(*self._undo_hand_over(), GOES_ON)  # goes on elsewhere
        for release in waiting:
            release()

    def _owe_run_write(self, *writes: int) -> None:
        """Owe the store the start (:data:`RUNNING`) or the end (:data:`GOES_ON`) of this
        delivery's run on its key, in order."""
        key = self.header.get("a")
        if key:
            rt = runtime(self.app)
            *first, last = self._run_writes(key, *writes)
            cleanup.release(
                rt.store,
                last,
                within_s=None if rt.lease_ms is None else rt.lease_ms / 1000,
                first=first,
            )

    def _run_writes(self, key: str, *writes: int) -> list[Release]:
        return [Release(self.job_id, key, what, self.run) for what in writes]

    def _undo_hand_over(self) -> tuple[int, ...]:
        """The write that takes back a hand-over mark the run left: a run that reports
        its own end sent no replacement (``replace()`` turns a send into ``Replaced``),
        but a time limit or the store can have stopped it from taking the mark back,
        and the mark would keep the key from the run's release until the lease. A
        ``Retry`` end takes back the mark its send left: the job goes on, and the key
        waits for the next attempt unmarked, as any job not running."""
        return () if self.handing_over else (HAND_OVER_UNDONE,)

    def _release_own(self, *, finished: bool) -> None:
        """Release, as its scope says, the key a replacement of another task holds of its
        own beside the job's (header ``x``); it takes no run marks."""
        own = self.header.get("x")
        hold = None if own is None else release_at(self.job_id, own, finished=finished)
        if hold is None:
            return
        rt = runtime(self.app)
        cleanup.release(
            rt.store,
            hold,
            within_s=None if rt.lease_ms is None else rt.lease_ms / 1000,
            after_exit_of=self.pool_child if finished else None,
            after=forgotten_within(self.message, ACK_WAIT_S) if finished else None,
        )

    def _release(self, *, finished: bool) -> None:
        hold = release_at(self.job_id, self.header, finished=finished)
        if hold is None:
            return
        if finished and not self.ran and self._waits_for_an_earlier_run():
            return
        if finished:
            self._release_own(finished=True)
        # The end of the run goes first, and goes even if the release never does
        # (an acknowledgement that failed): a copy of the message the broker
        # delivers again must not find the key marked by a run that is over. Not for
        # a job that follows its duplicates: until its hold ends, in the step that
        # hands the key to the run they are owed, a duplicate must find it running
        # and owe that run (one told its arguments wait for a start would be lost).
        follows = finished and bool(self.header.get("p"))
        ended: list[Release] = []
        if finished and self.ran:
            hold = hold._replace(run=self.run)
            if self.run is not None:
                end = () if follows else (GOES_ON,)
                ended = self._run_writes(hold.key, *self._undo_hand_over(), *end)
        app, job_id = self.app, self.job_id
        rt = runtime(app)
        reason = ReleaseReason.FINISHED if finished else ReleaseReason.STARTED

        # A delivery that never ran, of a job whose runs mark its key. (A job that follows
        # its duplicates is left to its lease: its key goes to the run they are owed,
        # which an owed write must not publish twice.)
        unrun = finished and not self.ran and self.run is not None and not self.header.get("p")

        def emitted(changed: bool) -> None:
            if changed:
                emit_released(app, job_id, hold.key, reason=reason, kept=hold.keep_ms != 0)

        def released(changed: bool) -> None:
            emitted(changed)
            if unrun and not changed:
                # Another delivery's run may mark the key, one its worker lost track
                # of: this release is owed again, each vouching round, until nobody
                # vouches for that run any more.
                cleanup.release_once_unmarked(
                    rt.store,
                    hold,
                    every_s=alive.interval_s(rt.lease_ms) + runs.BUSY_SLACK_S,
                    within_s=None if rt.lease_ms is None else rt.lease_ms / 1000,
                    on_released=emitted,
                )

        message = self.message if finished else None
        passer = None
        if follows:
            # latest/debounce: a run owed by duplicates takes the key over first, without
            # waiting for kombu to confirm the acknowledgement: should the message come
            # back, its copy finds the key another job's and does not run, while a
            # worker that died waiting would have lost the run owed. The hold ends
            # later, handing the key to a run owed by then, or releasing it.
            passer = follow_up.Passer(app, hold, self.header, message, self.task)
        cleanup.release(
            rt.store,
            hold,
            within_s=None if rt.lease_ms is None else rt.lease_ms / 1000,
            on_released=released,
            after_exit_of=self.pool_child if finished else None,
            after=None if message is None else forgotten_within(message, ACK_WAIT_S),
            first=ended,
            before=None if passer is None else passer.pass_on,
            ending=None if passer is None else passer.end,
        )

    def _waits_for_an_earlier_run(self) -> bool:
        """Defer this unrun delivery's release behind a run of the job this worker has not
        decided yet (say, a retry: its next attempt can be received, and dropped as
        revoked, before the pool reports the attempt that sent it). Released first, it
        would find the key marked by that run and leave it; the run's end would then
        clear the mark, and nothing would free the key until the lease."""
        with _lock:
            earlier = next(
                (fate for fate in _undecided.get(self.job_id, ()) if fate is not self), None
            )
            if earlier is None:
                return False
            earlier.deferred.append(lambda: self._release(finished=True))
            return True


#: Deliveries whose run started in this process and whose fate is not decided, by job.
_undecided: dict[str, list[Fate]] = {}


def _forget_undecided(fate: Fate) -> None:
    fates = _undecided.get(fate.job_id)
    if fates is not None and fate in fates:
        fates.remove(fate)
        if not fates:
            del _undecided[fate.job_id]


#: How long a release waits for kombu to confirm the acknowledgement (or reject)
#: Celery asked for, before it goes all the same.
ACK_WAIT_S = 10.0


def forgotten_within(message: Any, wait_s: float) -> Callable[[], bool | None]:
    """:func:`forgotten`, except that an acknowledgement still unconfirmed after
    ``wait_s`` counts as made.

    The worker's event loop sends an acknowledgement a moment after Celery asks
    for it; one still unconfirmed after that failed (the broker connection
    broke), and whether the broker got it is unknown: a lost reply. Waiting on
    would hold the key until its lease for a message the broker may well have
    forgotten. Released anyway, the key is still safe: a copy the broker
    delivers again has marked the key with its own run by then (the release
    names this run and leaves it alone), or it finds the key free and takes it,
    or held by a newer job and does not run.
    """
    asked = time.monotonic()

    def settled() -> bool | None:
        state = forgotten(message)
        if state is False and time.monotonic() - asked >= wait_s:
            return True
        return state

    return settled


def forgotten(message: Any) -> bool | None:
    """Whether kombu confirmed the broker forgot ``message``: yes, not yet, never (``None``).

    Celery's request asks for the ack or reject and the worker's event loop
    sends it a moment later; if the connection fails then, the broker
    redelivers the message, and the job runs again: its key must stay.
    """
    state = getattr(message, "_state", None)
    if state in ("ACK", "REJECTED"):
        return True
    if state == "REQUEUED":
        return None
    return False


def _outside_body(exc_info: Any, exc: BaseException | None) -> bool:
    """Whether Celery's own code raised after the body (a soft time limit striking
    there, say): the report hides how the body ended, which may have been
    ``Replaced``. Retry, Ignore and Reject are reported as internal too, and say
    how the body ended."""
    return bool(getattr(exc_info, "internal", False)) and not isinstance(
        exc, Retry | Ignore | Reject
    )


def _header(app: Any, request_dict: dict[str, Any], job_id: object) -> KeyHeader | None:
    """The message's key header if it names an active key of ``app``'s namespace.

    A key outside the namespace is dropped from the request itself, so that
    nothing later in this worker (the pool's run, lease renewals) acts on it.
    """
    value = request_dict.get(HEADER)
    if not (isinstance(value, dict) and value.get("v") == VERSION):
        return None
    header = confined(value, own_namespace(app), job_id)  # type: ignore[arg-type]
    if header is not value:
        request_dict[HEADER] = header
    return header if header.get("a") else None


def _exception(exc_info: Any) -> BaseException | None:
    exc = getattr(exc_info, "exception", None)
    if isinstance(exc, ExceptionWithTraceback):  # how billiard sends it from the child
        return exc.exc  # type: ignore[no-any-return]
    return exc


class FateMixin:
    """Mixed into Celery's request class: follows the run and the message, releases keys."""

    _fate: Fate | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The worker subclasses the request class once more per task (Celery's
        # create_request_cls), with an on_success of its own that does not call
        # ours: follow the run around that one too.
        own = cls.__dict__.get("on_success")
        if own is not None and not getattr(own, "_follows_fate", False):
            cls.on_success = _following_success(own)  # type: ignore[method-assign]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        request: Any = self
        header = _header(request.task.app, request._request_dict, request.id)
        if header is None:
            self._fate = None
        else:
            run = runs.assign(request._request_dict, header)
            self._fate = Fate(
                request.task.app, request.id, header, request._message, run, task=request.name
            )

    def on_accepted(self, pid: Any, time_accepted: float) -> None:
        if self._fate is not None:
            self._fate.started()
        super().on_accepted(pid, time_accepted)  # type: ignore[misc]

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        return super().on_success(failed__retval__runtime, **kwargs)  # type: ignore[misc]

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        fate = self._fate
        exc = _exception(exc_info)
        request: Any = self
        if fate is None:
            if isinstance(exc, _RESENDING):
                window_only = read_header(request._request_dict)
                if window_only is not None:
                    # No active key to follow, but a window key that names this job:
                    # Celery's retry of the lost run must be published, not decided
                    # against the job's own window key.
                    with resend.resending(request.id, window_only):
                        return super().on_failure(exc_info, send_failed_event, return_ok)  # type: ignore[misc]
            return super().on_failure(exc_info, send_failed_event, return_ok)  # type: ignore[misc]
        fate.run_ended(
            pid=request.worker_pid,
            cut_short=isinstance(exc, _CUT_SHORT),
            continued=isinstance(exc, Retry | Replaced | runs.Deferred),
            stale=isinstance(exc, runs.Stale),
            may_have_handed_over=isinstance(exc, Replaced) or _outside_body(exc_info, exc),
        )
        if isinstance(exc, _RESENDING):
            # Celery may retry the job from here (task_retry_on_worker_lost): that
            # send is the job going on, published whatever the store holds.
            with resend.resending(fate.job_id, fate.header) as watched:
                fate.resent = watched
                result = super().on_failure(exc_info, send_failed_event, return_ok)  # type: ignore[misc]
        else:
            result = super().on_failure(exc_info, send_failed_event, return_ok)  # type: ignore[misc]
        fate.check()
        return result

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        fate = self._fate
        if fate is None or soft:
            return super().on_timeout(soft, timeout)  # type: ignore[misc]
        request: Any = self
        fate.run_ended(pid=request.worker_pid, cut_short=True, continued=False)
        result = super().on_timeout(soft, timeout)  # type: ignore[misc]
        fate.check()
        return result

    def acknowledge(self) -> None:
        request: Any = self
        already = request.acknowledged
        super().acknowledge()  # type: ignore[misc]
        if self._fate is not None and not already and request.acknowledged:
            self._fate.message_settled(Settled.FORGOTTEN)

    def reject(self, requeue: bool = False) -> None:
        request: Any = self
        already = request.acknowledged
        super().reject(requeue)  # type: ignore[misc]
        if self._fate is not None and not already and request.acknowledged:
            self._fate.message_settled(Settled.REQUEUED if requeue else Settled.FORGOTTEN)


def _following_success(on_success: Any) -> Any:
    def following(self: Any, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        fate, failed = self._fate, failed__retval__runtime[0]
        if fate is None or failed:
            # A failure reported as a result goes on to on_failure.
            return on_success(self, failed__retval__runtime, **kwargs)
        fate.run_ended(pid=None, cut_short=False, continued=False)
        result = on_success(self, failed__retval__runtime, **kwargs)
        fate.check()
        return result

    following._follows_fate = True  # type: ignore[attr-defined]
    following.__name__ = following.__qualname__ = "on_success"
    following.__doc__ = on_success.__doc__
    return following


FateMixin.on_success = _following_success(FateMixin.on_success)  # type: ignore[method-assign]


class UniqueRequest(FateMixin, Request):
    """Celery's request class, following what becomes of its message (``UniqueTask.Request``)."""


_mixed: dict[type, type] = {}


def with_fates(request_class: type) -> type:
    """``request_class`` with :class:`FateMixin` mixed in (itself if it has it already)."""
    if issubclass(request_class, FateMixin):
        return request_class
    mixed = _mixed.get(request_class)
    if mixed is None:
        mixed = type(f"Unique{request_class.__name__}", (FateMixin, request_class), {})
        mixed.__module__ = __name__
        _mixed[request_class] = mixed
    return mixed
