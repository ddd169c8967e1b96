"""Store writes that are owed: sent in the background, retried until they succeed or lapse.

Some writes must reach the store even when it does not answer at the moment
they fall due:

* releasing the keys of a job that ended (the worker's main process sends
  every release this way, so a slow store never stalls its event loop, and a
  store that is down when the job ends gets the release when it is back);
* undoing a decision whose answer was lost (its request may have been
  applied: the keys may point at a job that was never published);
* rolling back a created claim whose publish failed while the store was not
  answering either.

One daemon thread per process sends them. Releases owed to one store go out
together, in one round trip; a failed attempt is retried with a backoff of up
to two seconds; an owed write whose deadline passes is dropped with a warning
(by then the key's lease has freed it anyway). Every write is a
compare-and-set on a job id, so sending one twice, late or after the key
changed hands is harmless.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_unique.stores.base import (
    GOES_ON,
    HAND_OVER_UNDONE,
    HANDING_OVER,
    RUNNING,
    Claim,
    Release,
    Store,
)

logger = logging.getLogger("celery_unique")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
#: How long a release waits for the pool child that ran the job to be gone.
CHILD_EXIT_WAIT_S = 10.0
#: Undoing a lost decision is repeated this long after its first success when the
#: store cannot make it final (the lost request could still arrive later).
UNDO_REPEATS_S = (1.0, 5.0, 30.0)
#: Bounds of how long an owed write is retried.
MIN_DEADLINE_S = 60.0
MAX_DEADLINE_S = 24 * 3600.0
#: At most this many writes are owed by one process; more are dropped (logged).
MAX_OWED = 100_000


@dataclass(eq=False)
class Owed:
    """One write owed to a store."""

    store: Store
    #: For log lines: what this write does.
    what: str
    #: ``time.monotonic()`` after which it is given up.
    deadline: float
    #: ``time.monotonic()`` before which it is not sent.
    due: float = 0.0
    release: Release | None = None
    #: Called with whether the release changed the key (after it reached the store).
    on_released: Callable[[bool], None] | None = None
    #: Anything else: a callable that raises while the store does not answer and
    #: returns whether its work is final (``False``: repeat it at ``repeats``).
    action: Callable[[], bool] | None = None
    #: The key an action works on: it waits, like a release, for this process's
    #: earlier writes of that key.
    key: str | None = None
    repeats: tuple[float, ...] = ()
    #: Wait until this process (a pool child) has exited before sending.
    after_exit_of: int | None = None
    #: Wait until this says ``True``; ``None`` means the write is no longer owed.
    after: Callable[[], bool | None] | None = None
    attempts: int = 0
    started: float = field(default_factory=time.monotonic)


#: Where the processes' states are read, where the system has it (Linux).
PROC = Path("/proc")


def _exited(pid: int) -> bool:
    """Whether process ``pid`` is gone (a zombie waiting to be reaped counts as gone)."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        # No such process, unless there is no /proc at all (macOS): then ask the system.
        if (PROC / "self").exists():
            return True
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Cleanup(threading.Thread):
    """The thread that sends this process's owed writes."""

    def __init__(self) -> None:
        super().__init__(name="celery-unique-cleanup", daemon=True)
        self._owed: list[Owed] = []
        self._in_flight = 0
        self._condition = threading.Condition()
        self._failing = False
        self._overflowing = False
        #: Writes dropped because ``MAX_OWED`` were owed already.
        self.dropped = 0

    def owe(self, *items: Owed) -> None:
        """Owe ``items``, together: the thread sees all of them or none yet.

        Past ``MAX_OWED`` writes (a store down for long under a busy worker) new
        ones are dropped with a warning: each write only hastens what the key's
        lease does anyway, and memory must not grow without bound.
        """
        with self._condition:
            room = MAX_OWED - len(self._owed) - self._in_flight
            if len(items) > room:
                self._overflowed(items[max(0, room) :])
                items = items[: max(0, room)]
            self._owed.extend(items)
            self._condition.notify_all()

    def _overflowed(self, dropped: Sequence[Owed]) -> None:
        self.dropped += len(dropped)
        if not self._overflowing:
            self._overflowing = True
            logger.warning(
                "more than %d store writes owed; dropping %s and further ones until "
                "the backlog shrinks (the keys' leases free them)",
                MAX_OWED,
                dropped[0].what,
            )

    def pending(self) -> int:
        with self._condition:
            return len(self._owed) + self._in_flight

    def discard(self, store: Store | None) -> int:
        """Drop what is owed to ``store`` (to any store: ``None``) and not sent yet; return
        how many writes."""
        with self._condition:
            kept = [] if store is None else [item for item in self._owed if item.store is not store]
            dropped = len(self._owed) - len(kept)
            self._owed = kept
            self._condition.notify_all()
            return dropped

    def flush(self, timeout: float) -> bool:
        """Wait until nothing is owed (``True``) or ``timeout`` seconds passed (``False``)."""
        deadline = time.monotonic() + timeout
        with self._condition:
            while self._owed or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._condition.wait(min(left, 0.05))
        return True

    def run(self) -> None:
        while True:
            batch = self._next_batch()
            try:
                self._send(batch)
            finally:
                with self._condition:
                    self._in_flight -= len(batch)
                    self._condition.notify_all()

    def _next_batch(self) -> list[Owed]:
        # What can go is worked out on a snapshot, outside the lock that every owe()
        # takes (a worker's event loop owes each job's release), and in time linear in
        # the backlog; the lock is held only to take the chosen writes out.
        while True:
            with self._condition:
                snapshot = list(self._owed)
            started = now = time.monotonic()
            ready: list[Owed] = []
            held: list[Owed] = []
            gone: set[int] = set()
            for item in snapshot:
                go = self._ready(item, now)
                if go is None:
                    gone.add(id(item))
                else:
                    (ready if go else held).append(item)
            sendable = _in_order(ready, held)
            waits = [
                item.due - now for item in held if item.after_exit_of is None and item.after is None
            ]
            if any(item.after_exit_of or item.after for item in held):
                # Poll for a child's exit or an ack, never more than half the time.
                waits.append(max(0.01, time.monotonic() - started))
            taken = gone | {id(item) for item in sendable}
            with self._condition:
                if taken:
                    self._owed = [item for item in self._owed if id(item) not in taken]
                    self._condition.notify_all()
                if len(self._owed) < MAX_OWED // 2:
                    self._overflowing = False
                if sendable:
                    self._in_flight += len(sendable)
                    return sendable
                if len(self._owed) == len(snapshot) - len(gone):  # nothing owed meanwhile
                    self._condition.wait(max(0.001, min(waits)) if waits else None)

    def _ready(self, item: Owed, now: float) -> bool | None:
        """Whether ``item`` can be sent now; ``None``: it is no longer owed."""
        if item.due > now:
            return False
        if item.after_exit_of is not None:
            waited_out = now - item.started > CHILD_EXIT_WAIT_S
            if not (_exited(item.after_exit_of) or waited_out):
                return False
            item.after_exit_of = None
        if item.after is not None:
            go = item.after()
            if go is None or (not go and now >= item.deadline):
                return None  # no longer owed (or never will be): dropped unsent
            if not go:
                return False
            item.after = None
        return True

    def _send(self, batch: Sequence[Owed]) -> None:
        releases: dict[int, list[Owed]] = {}
        failed: Exception | None = None
        for item in batch:
            if item.release is not None:
                releases.setdefault(id(item.store), []).append(item)
                continue
            if item.key is not None and releases:
                # A keyed action goes after the writes owed before it.
                failed = self._release_all(releases) or failed
                releases = {}
            if failed is not None and item.key is not None:
                self._failed(item, failed)  # those writes did not land: not yet
            else:
                self._attempt(item)
        self._release_all(releases)

    def _release_all(self, releases: dict[int, list[Owed]]) -> Exception | None:
        failed = None
        for items in releases.values():
            failed = self._release(items) or failed
        return failed

    def _release(self, items: list[Owed]) -> Exception | None:
        try:
            released = items[0].store.release_many([item.release for item in items])  # type: ignore[misc]
        except Exception as error:
            for item in items:
                self._failed(item, error)
            return error
        self._succeeded()
        for item, changed in zip(items, released, strict=True):
            if item.on_released is not None:
                try:
                    item.on_released(changed)
                except Exception:
                    logger.exception("a key_released receiver failed")
        return None

    def _attempt(self, item: Owed) -> None:
        assert item.action is not None
        try:
            final = item.action()
        except Exception as error:
            self._failed(item, error)
            return
        self._succeeded()
        if not final and item.repeats:
            later, *rest = item.repeats
            item.due, item.repeats, item.attempts = time.monotonic() + later, tuple(rest), 0
            self.owe(item)

    def _failed(self, item: Owed, error: Exception) -> None:
        item.attempts += 1
        now = time.monotonic()
        if now >= item.deadline:
            logger.warning(
                "gave up %s after %d attempts over %.0f s (%s); the key's lease frees it",
                item.what,
                item.attempts,
                now - item.started,
                error,
            )
            return
        if not self._failing:
            self._failing = True
            logger.warning(
                "uniqueness store not answering; %s and other owed writes are retried "
                "in the background: %s",
                item.what,
                error,
            )
        backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (item.attempts - 1))
        item.due = min(now + backoff, item.deadline)
        self.owe(item)

    def _succeeded(self) -> None:
        if self._failing:
            self._failing = False
            logger.warning("uniqueness store answering again; owed writes are being sent")


def _in_order(ready: list[Owed], waiting: list[Owed]) -> list[Owed]:
    """``ready``, less the writes of a key that an earlier write still waits to reach,
    oldest first: a key sees this process's writes in the order they were owed (the
    end of one run of a job before the release by the next)."""
    first: dict[str, float] = {}
    for item in waiting:
        # A write that waits for its message's fate or its child's exit may never
        # go (a message redelivered after a lost connection): it holds nothing up.
        key = _key_of(item)
        if key is not None and item.after is None and item.after_exit_of is None:
            first[key] = min(first.get(key, item.started), item.started)
    go = [
        item
        for item in ready
        if (key := _key_of(item)) is None or item.started <= first.get(key, item.started)
    ]
    return sorted(go, key=lambda item: item.started)


def _key_of(item: Owed) -> str | None:
    return item.release.key if item.release is not None else item.key


_cleanup: Cleanup | None = None
_lock = threading.Lock()


#: How long a process that is exiting waits for what it still owes.
EXIT_WAIT_S = 3.0


def _thread() -> Cleanup:
    global _cleanup
    current = _cleanup
    if current is None or not current.is_alive():
        with _lock:
            if _cleanup is None or not _cleanup.is_alive():
                _cleanup = Cleanup()
                _cleanup.start()
            current = _cleanup
    return current


@atexit.register
def _at_exit() -> None:
    # A producer script that dispatches and exits: give owed undos a moment.
    if pending():
        flush(EXIT_WAIT_S)


def _after_fork_in_child() -> None:
    # What the parent owes is the parent's to send; the child starts empty.
    global _cleanup
    _cleanup = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def deadline_after(seconds: float | None) -> float:
    """A deadline ``seconds`` from now, kept within the bounds of owed writes."""
    span = MAX_DEADLINE_S if seconds is None else seconds
    return time.monotonic() + min(MAX_DEADLINE_S, max(MIN_DEADLINE_S, span))


def claims_lifetime_s(claims: Sequence[Claim]) -> float | None:
    """How long the keys a claim may have written can live, at most (``None``: no bound)."""
    lifetimes: list[float] = []
    for claim in claims:
        if claim.active is not None:
            if claim.active.lease_ms is None:
                return None
            lifetimes.append(claim.active.lease_ms / 1000)
        if claim.window is not None:
            lifetimes.append(claim.window.window_ms / 1000)
    return max(lifetimes, default=0.0)


def release(
    store: Store,
    hold: Release,
    *,
    within_s: float | None,
    on_released: Callable[[bool], None] | None = None,
    after_exit_of: int | None = None,
    after: Callable[[], bool | None] | None = None,
    first: Sequence[Release] = (),
    before: Callable[[], None] | None = None,
    ending: Callable[[], bool] | None = None,
) -> None:
    """Send ``hold``'s release soon: once process ``after_exit_of`` is gone and ``after``
    says so (``None`` from it cancels the release), when given.

    ``ending``: what ends the hold instead of ``hold``'s release (retried while it
    raises, like any owed write); it returns whether it changed the key.

    ``first``: writes sent ahead of it, in order, whatever ``after`` says (the end
    of the run, which holds even if the release never goes); owed at the same
    moment, so that all usually travel in one round trip.

    ``before``: work done first, once ``after_exit_of`` is gone but without
    waiting for ``after`` (retried while it raises, like any owed write); the
    release is owed only once it is done, and then waits for ``after``.
    """
    deadline = deadline_after(within_s)

    def owed(write: Release, **waits: Any) -> Owed:
        return Owed(
            store=store,
            what=_describe(write),
            deadline=deadline,
            release=write,
            after_exit_of=after_exit_of,
            **waits,
        )

    # Made in order: the thread sends what is ready oldest first.
    ahead = [owed(write) for write in first]
    last = owed(hold, on_released=on_released, after=after)
    if ending is not None:
        last = _ending(store, hold, ending, deadline, on_released, after, after_exit_of)
    if before is not None:
        work = before
        released = last
        released.after_exit_of = None

        def action() -> bool:
            work()
            released.started = time.monotonic()
            _thread().owe(released)
            return True

        last = Owed(
            store=store,
            what=f"{_describe(hold)}, once the run it owes is passed on",
            deadline=deadline,
            action=action,
            key=hold.key,
            after_exit_of=after_exit_of,
        )
    _thread().owe(*ahead, last)


def _ending(
    store: Store,
    hold: Release,
    ending: Callable[[], bool],
    deadline: float,
    on_released: Callable[[bool], None] | None,
    after: Callable[[], bool | None] | None,
    after_exit_of: int | None,
) -> Owed:
    def action() -> bool:
        changed = ending()
        if on_released is not None:
            try:
                on_released(changed)
            except Exception:
                logger.exception("a key_released receiver failed")
        return True

    return Owed(
        store=store,
        what=_describe(hold),
        deadline=deadline,
        action=action,
        key=hold.key,
        after=after,
        after_exit_of=after_exit_of,
    )


def release_once_unmarked(
    store: Store,
    hold: Release,
    *,
    every_s: float,
    within_s: float | None,
    on_released: Callable[[bool], None] | None = None,
) -> None:
    """Send ``hold`` (the release of a delivery that never ran) again every ``every_s``
    while its job still holds the key under another delivery's run mark.

    The store leaves a key alone while another delivery of its job runs, and frees it
    once nobody vouches for that run any more. But the run's own release may never
    come: a worker cut off from its broker can lose track of a run its pool goes on
    with. This one then frees the key, within ``every_s`` of the vouching running out.
    """
    assert hold.run is None

    def action() -> bool:
        held = store.get(hold.key)
        if held is None or held.job_id != hold.job_id or held.finished or held.run is None:
            return True  # the key moved on, or its job's run ended it
        changed = store.release_many([hold])[0]
        if changed and on_released is not None:
            on_released(True)
        return changed

    span = MAX_DEADLINE_S if within_s is None else min(within_s, MAX_DEADLINE_S)
    _thread().owe(
        Owed(
            store=store,
            what=f"{_describe(hold)}, once no other delivery of it runs",
            deadline=deadline_after(within_s),
            due=time.monotonic() + every_s,
            action=action,
            key=hold.key,
            repeats=(every_s,) * max(1, int(span / every_s)),
        )
    )


def _describe(hold: Release) -> str:
    what = {
        GOES_ON: "ending the run",
        RUNNING: "marking the run",
        HANDING_OVER: "marking the hand-over",
        HAND_OVER_UNDONE: "taking back the hand-over",
    }.get(hold.keep_ms or 0)
    if what is None:
        return f"releasing key {hold.key!r} of job {hold.job_id}"
    return f"{what} of job {hold.job_id} on key {hold.key!r}"


def _first_jobs(claims: Sequence[Claim]) -> str:
    """The first three claims' job ids, for a log line."""
    return ", ".join(claim.job_id for claim in claims[:3]) + (", ..." if len(claims) > 3 else "")


def undo_decision(store: Store, claims: Sequence[Claim], error: Exception) -> None:
    """Undo what a decision whose answer was lost may have written, as soon as possible."""
    from celery_unique.exceptions import BackendUnavailable

    assert isinstance(error, BackendUnavailable)
    jobs = _first_jobs(claims)
    _thread().owe(
        Owed(
            store=store,
            what=f"undoing the lost decision of job(s) {jobs}",
            deadline=deadline_after(claims_lifetime_s(claims)),
            action=lambda: store.forget_decision(claims, error),
            repeats=UNDO_REPEATS_S,
        )
    )


def roll_back(store: Store, claims: Sequence[Claim]) -> None:
    """Roll back created claims whose jobs were not published, in the background."""

    def action() -> bool:
        store.rollback_many(claims)
        return True

    jobs = _first_jobs(claims)
    _thread().owe(
        Owed(
            store=store,
            what=f"rolling back the keys of unpublished job(s) {jobs}",
            deadline=deadline_after(claims_lifetime_s(claims)),
            action=action,
        )
    )


def discard(store: Store | None = None) -> int:
    """Forget the writes owed to ``store``, or to every store (stores being thrown away, in
    tests)."""
    current = _cleanup
    return 0 if current is None else current.discard(store)


def pending() -> int:
    """How many writes this process still owes."""
    current = _cleanup
    return 0 if current is None else current.pending()


def flush(timeout: float = 5.0) -> bool:
    """Wait (at most ``timeout`` seconds) until this process owes nothing; ``True`` if so."""
    current = _cleanup
    return True if current is None else current.flush(timeout)
