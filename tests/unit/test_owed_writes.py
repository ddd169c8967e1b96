"""Owed store writes: when they are sent, retried and given up, what waits for what, what
is logged, and the process-wide sender the stores and the worker owe them to.

The store is a fake that refuses its first calls and records when each came; backoffs,
repeats and the wait for a pool child are the module's constants, shortened here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from pathlib import Path

import pytest

from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores import cleanup
from celery_unique.stores.base import (
    GOES_ON,
    HAND_OVER_UNDONE,
    HANDING_OVER,
    RUNNING,
    ActiveClaim,
    Claim,
    HeldKey,
    KeyKind,
    Release,
    Scope,
    WindowClaim,
)
from celery_unique.stores.memory import MemoryStore

LOG = "celery_unique"


class RecordingStore(MemoryStore):
    """Refuses its first ``failures`` calls; records every call, with when it came."""

    def __init__(self, failures: int = 0, changed: bool = True) -> None:
        super().__init__()
        self.failures = failures
        self.changed = changed
        self.final = True
        self.calls: list[tuple[str, float, list[object]]] = []
        self.refused = 0
        self.lock = threading.Lock()
        self.held: HeldKey | None = None

    def _call(self, name: str, args: Sequence[object]) -> None:
        with self.lock:
            self.calls.append((name, time.monotonic(), list(args)))
            if self.failures:
                self.failures -= 1
                self.refused += 1
                raise BackendUnavailable("not answering")

    def release_many(self, releases: Sequence[Release]) -> list[bool]:
        self._call("release", releases)
        return [self.changed for _ in releases]

    def rollback_many(self, claims: Sequence[Claim]) -> None:
        self._call("rollback", claims)

    def forget_decision(self, claims: Sequence[Claim], error: BackendUnavailable) -> bool:
        self._call("forget", claims)
        return self.final

    def get(self, key: str) -> HeldKey | None:
        self._call("get", [key])
        return self.held

    def released(self) -> list[object]:
        """What the releases that were not refused carried (the refused ones come first)."""
        with self.lock:
            calls = self.calls[self.refused :]
            return [each for name, _, args in calls if name == "release" for each in args]

    def times(self, name: str) -> list[float]:
        with self.lock:
            return [when for each, when, _ in self.calls if each == name]


def _wait_until(condition: Callable[[], object], timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.002)
    return False


def _owed(store: RecordingStore, hold: Release, **fields: object) -> cleanup.Owed:
    return cleanup.Owed(
        store=store,
        what=f"release of {hold.job_id}",
        deadline=cleanup.deadline_after(60),
        release=hold,
        **fields,  # type: ignore[arg-type]
    )


@pytest.fixture
def sender() -> Iterator[cleanup.Cleanup]:
    started = cleanup.Cleanup()
    started.start()
    yield started
    started.discard(None)


@pytest.fixture
def process_sender(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process-wide sender, started afresh for the test."""
    monkeypatch.setattr(cleanup, "_cleanup", None)
    yield
    cleanup.discard()


@pytest.fixture
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cleanup, "FIRST_BACKOFF_S", 0.02)
    monkeypatch.setattr(cleanup, "MAX_BACKOFF_S", 0.02)


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# Retries and giving up


def test_a_refused_write_is_first_retried_fifty_milliseconds_later(
    sender: cleanup.Cleanup,
) -> None:
    store = RecordingStore(failures=1)
    sender.owe(_owed(store, Release("j1", "k1")))
    assert sender.flush(5)
    first, second = store.times("release")
    assert 0.05 <= second - first < 0.5


def test_a_write_is_retried_until_its_deadline_then_given_up_with_a_warning(
    sender: cleanup.Cleanup, short_backoff: None, caplog: pytest.LogCaptureFixture
) -> None:
    store = RecordingStore(failures=10**6)
    deadline = time.monotonic() + 0.3
    with caplog.at_level(logging.WARNING, logger=LOG):
        sender.owe(
            cleanup.Owed(
                store=store, what="the doomed write", deadline=deadline, release=Release("j1", "k1")
            )
        )
        assert sender.flush(5)
    times = store.times("release")
    assert times[-1] >= deadline
    assert all(later - earlier < 0.2 for earlier, later in pairwise(times))
    assert _warnings(caplog, "gave up") == [
        f"gave up the doomed write after {len(times)} attempts over 0 s (not answering); "
        "the key's lease frees it"
    ]
    # One warning for the whole outage, not one per attempt, and none of it ending.
    assert len(_warnings(caplog, "not answering;")) == 1
    assert _warnings(caplog, "answering again") == []


def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(
    sender: cleanup.Cleanup, short_backoff: None, caplog: pytest.LogCaptureFixture
) -> None:
    store = RecordingStore(failures=3)
    with caplog.at_level(logging.WARNING, logger=LOG):
        sender.owe(_owed(store, Release("j1", "k1")))
        assert sender.flush(5)
    assert store.released() == [Release("j1", "k1")]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "uniqueness store not answering; release of j1 and other owed writes are retried "
        "in the background: not answering",
        "uniqueness store answering again; owed writes are being sent",
    ]


def test_the_next_outage_is_logged_again(
    sender: cleanup.Cleanup, short_backoff: None, caplog: pytest.LogCaptureFixture
) -> None:
    store = RecordingStore(failures=1)
    with caplog.at_level(logging.WARNING, logger=LOG):
        sender.owe(_owed(store, Release("j1", "k1")))
        assert sender.flush(5)
        store.failures = 1
        sender.owe(_owed(store, Release("j2", "k2")))
        assert sender.flush(5)
    assert len(_warnings(caplog, "not answering;")) == 2
    assert len(_warnings(caplog, "answering again")) == 2


# When a write goes


def test_a_write_due_later_goes_when_it_falls_due(sender: cleanup.Cleanup) -> None:
    store = RecordingStore()
    owed = time.monotonic()
    sender.owe(_owed(store, Release("j1", "k1"), due=owed + 0.2))
    assert sender.flush(5)
    (sent,) = store.times("release")
    assert 0.2 <= sent - owed < 0.7


def test_a_write_waiting_for_a_signal_asks_it_at_most_every_ten_milliseconds(
    sender: cleanup.Cleanup,
) -> None:
    store = RecordingStore()
    asked: list[float] = []
    go = threading.Event()

    def after() -> bool:
        asked.append(time.monotonic())
        return go.is_set()

    sender.owe(_owed(store, Release("j1", "k1"), after=after))
    assert _wait_until(lambda: len(asked) >= 6)
    assert asked[5] - asked[0] >= 0.05
    assert store.calls == []
    go.set()
    flipped = time.monotonic()
    assert sender.flush(5)
    (sent,) = store.times("release")
    assert sent - flipped < 0.5


def test_a_write_owed_while_the_sender_looks_over_the_backlog_goes_at_once(
    sender: cleanup.Cleanup,
) -> None:
    """The sender reads what is owed, then decides what to do without the lock: a write
    owed meanwhile is not left for a wake-up it has already missed."""
    store = RecordingStore()
    meanwhile = Release("j2", "k2")

    def after() -> bool | None:
        sender.owe(_owed(store, meanwhile))
        return None  # and this write is no longer owed

    sender.owe(_owed(store, Release("j1", "k1"), after=after))
    assert sender.flush(2)
    assert store.released() == [meanwhile]


def test_a_write_owed_as_others_are_discarded_meanwhile_goes_at_once(
    sender: cleanup.Cleanup,
) -> None:
    """Fewer writes owed than the sender read is no sign that nothing was owed meanwhile."""
    store, thrown_away = RecordingStore(), RecordingStore()
    meanwhile = Release("j2", "k2")
    later = time.monotonic() + 60

    def after() -> bool | None:
        sender.discard(thrown_away)
        sender.owe(_owed(store, meanwhile))
        return None  # and this write is no longer owed

    sender.owe(
        _owed(store, Release("j1", "k1"), after=after),
        *(_owed(thrown_away, Release(f"j{n}", f"k{n}"), due=later) for n in range(3, 5)),
    )
    assert sender.flush(2)
    assert store.released() == [meanwhile]


def test_a_write_whose_signal_never_comes_is_dropped_unsent_at_its_deadline(
    sender: cleanup.Cleanup,
) -> None:
    store = RecordingStore()
    sender.owe(
        cleanup.Owed(
            store=store,
            what="never acknowledged",
            deadline=time.monotonic() + 0.1,
            release=Release("j1", "k1"),
            after=lambda: False,
        )
    )
    assert sender.flush(5)
    assert store.calls == []


def test_flush_says_so_when_writes_are_still_owed_at_its_timeout(sender: cleanup.Cleanup) -> None:
    store = RecordingStore()
    sender.owe(_owed(store, Release("j1", "k1"), due=time.monotonic() + 60))
    started = time.monotonic()
    assert not sender.flush(0.1)
    assert 0.1 <= time.monotonic() - started < 0.6
    assert sender.pending() == 1


def test_without_proc_a_child_that_may_not_be_signalled_is_there(
    sender: cleanup.Cleanup, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Signal 0 refused (a process of another user, under a reused pid) is a process that
    exists: the release waits, and the sender goes on with other writes."""
    monkeypatch.setattr(cleanup, "PROC", tmp_path)
    store = RecordingStore()
    child = _child()
    signal_process = os.kill

    def kill(pid: int, signal: int) -> None:
        if pid == child.pid and signal == 0:
            raise PermissionError(1, "Operation not permitted")
        signal_process(pid, signal)

    try:
        monkeypatch.setattr(os, "kill", kill)
        sender.owe(_owed(store, Release("j1", "k1"), after_exit_of=child.pid))
        assert not sender.flush(0.3)
        sender.owe(_owed(store, Release("j2", "k2")))
        assert _wait_until(lambda: store.released() == [Release("j2", "k2")])
        assert sender.pending() == 1
    finally:
        monkeypatch.undo()
        child.kill()
        child.wait()


# The order of one key's writes


def test_a_ready_write_waits_for_the_oldest_earlier_write_of_its_key(
    sender: cleanup.Cleanup,
) -> None:
    store = RecordingStore()
    due = time.monotonic() + 0.2
    oldest = _owed(store, Release("j1", "k", GOES_ON, "r1"), due=due)
    ready = _owed(store, Release("j1", "k", 0, "r2"))
    later = _owed(store, Release("j1", "k", RUNNING, "r3"), due=due)
    sender.owe(oldest, ready, later)
    assert sender.flush(5)
    assert store.released()[:2] == [oldest.release, ready.release]


def test_a_ready_write_goes_without_waiting_for_a_later_write_of_its_key(
    sender: cleanup.Cleanup,
) -> None:
    store = RecordingStore()
    ready = _owed(store, Release("j1", "k", 0, "r1"))
    later = _owed(store, Release("j2", "k", 0, "r2"), due=time.monotonic() + 60)
    sender.owe(ready, later)
    assert _wait_until(lambda: store.released() == [ready.release])
    assert sender.pending() == 1


def test_a_write_waiting_for_a_signal_holds_up_no_later_write_of_its_key(
    sender: cleanup.Cleanup,
) -> None:
    store = RecordingStore()
    waiting = _owed(store, Release("j1", "k", 0, "r1"), after=lambda: False)
    ready = _owed(store, Release("j2", "k", 0, "r2"))
    sender.owe(waiting, ready)
    assert _wait_until(lambda: store.released() == [ready.release])


def test_releases_owed_to_one_store_go_in_one_round_trip_around_other_work(
    sender: cleanup.Cleanup,
) -> None:
    store, other = RecordingStore(), RecordingStore()
    done: list[bool] = []

    def work() -> bool:
        done.append(True)
        return True

    first, second, elsewhere = Release("j1", "k1"), Release("j2", "k2"), Release("j3", "k3")
    sender.owe(
        _owed(store, first),
        cleanup.Owed(
            store=store,
            what="work",
            deadline=cleanup.deadline_after(60),
            action=work,
        ),
        _owed(other, elsewhere),
        _owed(store, second),
    )
    assert sender.flush(5)
    assert [args for _, _, args in store.calls] == [[first, second]]
    assert [args for _, _, args in other.calls] == [[elsewhere]]
    assert done == [True]


def test_work_on_a_key_waits_for_a_refused_release_of_it_owed_with_it(
    sender: cleanup.Cleanup, short_backoff: None
) -> None:
    store = RecordingStore(failures=1)
    seen: list[list[object]] = []

    def work() -> bool:
        seen.append(store.released())
        return True

    hold = Release("j1", "k", GOES_ON, "r1")
    sender.owe(
        _owed(store, hold),
        cleanup.Owed(
            store=store, what="work", deadline=cleanup.deadline_after(60), action=work, key="k"
        ),
    )
    assert sender.flush(5)
    assert seen == [[hold]]


def test_each_release_tells_its_receiver_whether_it_changed_the_key_even_if_one_fails(
    sender: cleanup.Cleanup, caplog: pytest.LogCaptureFixture
) -> None:
    store = RecordingStore(changed=False)
    told: list[tuple[str, bool]] = []

    def failing(changed: bool) -> None:
        raise RuntimeError("receiver broke")

    with caplog.at_level(logging.ERROR, logger=LOG):
        sender.owe(
            _owed(store, Release("j1", "k1"), on_released=failing),
            _owed(
                store, Release("j2", "k2"), on_released=lambda changed: told.append(("j2", changed))
            ),
        )
        assert sender.flush(5)
    assert told == [("j2", False)]
    assert _warnings(caplog, "a key_released receiver failed") == ["a key_released receiver failed"]


# Work that is repeated


def test_work_not_final_is_repeated_at_its_intervals_then_no_more(sender: cleanup.Cleanup) -> None:
    done: list[float] = []

    def work() -> bool:
        done.append(time.monotonic())
        return False

    owed = cleanup.Owed(
        store=RecordingStore(),
        what="undo",
        deadline=cleanup.deadline_after(60),
        action=work,
        repeats=(0.1, 0.2),
    )
    sender.owe(owed)
    assert sender.flush(5)
    assert len(done) == 3
    assert 0.1 <= done[1] - done[0] < 0.19
    assert 0.2 <= done[2] - done[1] < 0.39


def test_work_that_is_final_or_has_no_repeats_is_done_once_and_the_sender_goes_on(
    sender: cleanup.Cleanup,
) -> None:
    store = RecordingStore()
    done: list[str] = []

    def work(name: str, final: bool) -> Callable[[], bool]:
        def action() -> bool:
            done.append(name)
            return final

        return action

    deadline = cleanup.deadline_after(60)
    sender.owe(
        cleanup.Owed(
            store=store, what="a", deadline=deadline, action=work("final", True), repeats=(0.05,)
        ),
        cleanup.Owed(store=store, what="b", deadline=deadline, action=work("no repeats", False)),
    )
    assert sender.flush(5)
    sender.owe(_owed(store, Release("j1", "k1")))
    assert sender.flush(5)
    assert sorted(done) == ["final", "no repeats"]
    assert store.released() == [Release("j1", "k1")]


# The bound on what is owed


def test_a_backlog_filled_exactly_drops_nothing_and_logs_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cleanup, "MAX_OWED", 4)
    store = RecordingStore()
    sender = cleanup.Cleanup()
    with caplog.at_level(logging.WARNING, logger=LOG):
        sender.owe(*(_owed(store, Release(f"j{n}", f"k{n}")) for n in range(4)))
    assert sender.pending() == 4
    assert sender.dropped == 0
    assert caplog.records == []
    sender.owe(_owed(store, Release("j4", "k4")), _owed(store, Release("j5", "k5")))
    assert sender.pending() == 4
    assert sender.dropped == 2


def test_writes_being_sent_count_against_the_bound(
    sender: cleanup.Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cleanup, "MAX_OWED", 4)
    entered, leave = threading.Event(), threading.Event()

    class SlowStore(RecordingStore):
        def release_many(self, releases: Sequence[Release]) -> list[bool]:
            entered.set()
            leave.wait(5)
            return super().release_many(releases)

    store = SlowStore()
    try:
        sender.owe(_owed(store, Release("j1", "k1")), _owed(store, Release("j2", "k2")))
        assert entered.wait(5)
        sender.owe(
            *(
                _owed(store, Release(f"j{n}", f"k{n}"), due=time.monotonic() + 60)
                for n in range(3, 6)
            )
        )
        assert sender.dropped == 1
        assert sender.pending() == 4
    finally:
        leave.set()


def test_overflow_is_logged_again_only_once_the_backlog_fell_below_half_the_bound(
    sender: cleanup.Cleanup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cleanup, "MAX_OWED", 11)  # odd: half of it is 5, not 5.5
    store, thrown_away = RecordingStore(), RecordingStore()
    asked: list[float] = []

    def probe() -> bool:
        asked.append(time.monotonic())
        return False

    def passes() -> None:
        # Two more questions of the probe: the sender went over the backlog since.
        seen = len(asked)
        assert _wait_until(lambda: len(asked) >= seen + 2)

    later = time.monotonic() + 60

    def held(n: int, owner: RecordingStore = store) -> cleanup.Owed:
        return cleanup.Owed(
            store=owner,
            what=f"held {n}",
            deadline=cleanup.deadline_after(60),
            release=Release(f"j{n}", f"k{n}"),
            due=later,
        )

    with caplog.at_level(logging.WARNING, logger=LOG):
        sender.owe(_owed(RecordingStore(), Release("p", "probe"), after=probe))
        sender.owe(*(held(n) for n in range(4)), *(held(n, thrown_away) for n in range(4, 11)))
        assert len(_warnings(caplog, "owed; dropping")) == 1
        passes()
        sender.owe(held(11))  # still full: dropped without a word
        assert sender.dropped == 2
        sender.discard(thrown_away)  # 5 owed: less than half the bound, but not below 5
        passes()
        sender.owe(*(held(n) for n in range(12, 19)))
        assert sender.dropped == 3
        assert len(_warnings(caplog, "owed; dropping")) == 1
        sender.discard(store)
        sender.owe(*(held(n) for n in range(19, 22)))  # 4 owed: below it
        passes()
        sender.owe(*(held(n) for n in range(22, 30)))
    assert len(_warnings(caplog, "owed; dropping")) == 2


# The process-wide sender and what the stores and the worker owe it


def test_nothing_owed_before_any_write_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cleanup, "_cleanup", None)
    assert cleanup.pending() == 0
    assert cleanup.discard() == 0
    assert cleanup.flush(0.1)


def test_a_sender_that_died_is_replaced_by_the_next_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cleanup, "_cleanup", cleanup.Cleanup())  # never started, as if dead
    store = RecordingStore()
    cleanup.release(store, Release("j1", "k1"), within_s=60)
    assert cleanup.flush(5)
    assert store.released() == [Release("j1", "k1")]
    cleanup.discard()


def test_writes_owed_first_go_ahead_of_a_release_that_waits(process_sender: None) -> None:
    store = RecordingStore()
    go = threading.Event()
    ended, hold = Release("j1", "k", GOES_ON, "r1"), Release("j1", "k", 0, "r1")
    cleanup.release(store, hold, within_s=60, first=[ended], after=go.is_set)
    assert _wait_until(lambda: store.released() == [ended])
    assert cleanup.pending() == 1
    go.set()
    assert cleanup.flush(5)
    assert store.released() == [ended, hold]


def test_work_before_a_release_is_done_without_waiting_for_its_signal(
    process_sender: None, short_backoff: None
) -> None:
    store = RecordingStore()
    go = threading.Event()
    tries: list[float] = []
    told: list[bool] = []

    def before() -> None:
        tries.append(time.monotonic())
        if len(tries) == 1:
            raise BackendUnavailable("not yet")

    hold = Release("j1", "k")
    cleanup.release(
        store, hold, within_s=60, before=before, after=go.is_set, on_released=told.append
    )
    assert _wait_until(lambda: len(tries) == 2)
    assert cleanup.pending() == 1  # the release, waiting for its signal
    assert store.calls == []
    go.set()
    assert cleanup.flush(5)
    assert store.released() == [hold]
    assert told == [True]
    assert len(tries) == 2


def test_a_release_ended_otherwise_tells_its_receiver_what_the_ending_did(
    process_sender: None, short_backoff: None, caplog: pytest.LogCaptureFixture
) -> None:
    store = RecordingStore()
    endings: list[int] = []
    told: list[bool] = []

    def ending() -> bool:
        endings.append(1)
        if len(endings) == 1:
            raise BackendUnavailable("not yet")
        return False

    cleanup.release(store, Release("j1", "k"), within_s=60, ending=ending, on_released=told.append)
    assert cleanup.flush(5)
    assert store.calls == []
    assert told == [False]
    assert len(endings) == 2

    def failing(changed: bool) -> None:
        raise RuntimeError("receiver broke")

    with caplog.at_level(logging.ERROR, logger=LOG):
        cleanup.release(
            store, Release("j2", "k"), within_s=60, ending=lambda: True, on_released=failing
        )
        assert cleanup.flush(5)
    assert _warnings(caplog, "a key_released receiver failed") == ["a key_released receiver failed"]


@pytest.mark.parametrize(
    ("keep_ms", "what"),
    [
        (0, "releasing key 'k' of job j1"),
        (5000, "releasing key 'k' of job j1"),
        (None, "releasing key 'k' of job j1"),
        (GOES_ON, "ending the run of job j1 on key 'k'"),
        (RUNNING, "marking the run of job j1 on key 'k'"),
        (HANDING_OVER, "marking the hand-over of job j1 on key 'k'"),
        (HAND_OVER_UNDONE, "taking back the hand-over of job j1 on key 'k'"),
    ],
)
def test_a_refused_release_is_logged_by_what_it_does(
    process_sender: None,
    short_backoff: None,
    caplog: pytest.LogCaptureFixture,
    keep_ms: int | None,
    what: str,
) -> None:
    store = RecordingStore(failures=1)
    with caplog.at_level(logging.WARNING, logger=LOG):
        cleanup.release(store, Release("j1", "k", keep_ms), within_s=60)
        assert cleanup.flush(5)
    assert _warnings(caplog, "not answering;")[0].startswith(
        f"uniqueness store not answering; {what} and"
    )


def _claims(count: int, lease_ms: int | None = 60_000) -> list[Claim]:
    return [
        Claim(f"j{n}", "task", ActiveClaim(f"k{n}", Scope.ACTIVE, lease_ms))
        for n in range(1, count + 1)
    ]


def test_an_undo_is_repeated_while_the_store_cannot_make_it_final(
    process_sender: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cleanup, "UNDO_REPEATS_S", (0.05, 0.1))
    store = RecordingStore()
    store.final = False
    claims = _claims(2)
    cleanup.undo_decision(store, claims, _lost())
    assert cleanup.flush(5)
    assert [(name, args) for name, _, args in store.calls] == [("forget", claims)] * 3


def test_a_final_undo_is_not_repeated(process_sender: None) -> None:
    store = RecordingStore()
    cleanup.undo_decision(store, _claims(1), _lost())
    assert cleanup.flush(5)
    assert [name for name, _, _ in store.calls] == ["forget"]


@pytest.mark.parametrize(("count", "jobs"), [(1, "j1"), (3, "j1, j2, j3"), (4, "j1, j2, j3, ...")])
def test_a_rollback_refused_is_retried_and_logged_by_its_first_jobs(
    process_sender: None,
    short_backoff: None,
    caplog: pytest.LogCaptureFixture,
    count: int,
    jobs: str,
) -> None:
    store = RecordingStore(failures=1)
    claims = _claims(count)
    with caplog.at_level(logging.WARNING, logger=LOG):
        cleanup.roll_back(store, claims)
        assert cleanup.flush(5)
    assert [(name, args) for name, _, args in store.calls] == [("rollback", claims)] * 2
    (warning,) = _warnings(caplog, "not answering;")
    assert f"rolling back the keys of unpublished job(s) {jobs} and other" in warning


def _held(job_id: str = "j1", run: str | None = "r9", finished: bool = False) -> HeldKey:
    # The store's job id equals the release's, and is never the same object.
    return HeldKey("k", KeyKind.ACTIVE, "".join(list(job_id)), "task", finished=finished, run=run)


def test_a_copy_unrun_is_released_every_round_while_another_delivery_runs(
    process_sender: None,
) -> None:
    store = RecordingStore(changed=False)
    store.held = _held()
    told: list[bool] = []
    started = time.monotonic()
    cleanup.release_once_unmarked(
        store, Release("j1", "k"), every_s=0.05, within_s=0.18, on_released=told.append
    )
    # Three rounds in 0.18 s (of 0.05 s each), then the key's lease is over.
    assert cleanup.flush(5)
    releases = store.times("release")
    assert len(releases) == 4
    assert releases[0] - started >= 0.05
    assert told == []


def test_a_copy_unrun_released_once_the_run_ended_tells_its_receiver(process_sender: None) -> None:
    store = RecordingStore()
    store.held = _held()
    told: list[bool] = []
    cleanup.release_once_unmarked(
        store, Release("j1", "k"), every_s=0.02, within_s=60, on_released=told.append
    )
    assert cleanup.flush(5)
    assert store.released() == [Release("j1", "k")]
    assert told == [True]


@pytest.mark.parametrize(
    "held",
    [None, _held(job_id="j0"), _held(job_id="j2"), _held(finished=True), _held(run=None)],
    ids=["gone", "an-earlier-job", "a-later-job", "finished", "no-run"],
)
def test_a_copy_unrun_leaves_alone_a_key_that_moved_on(
    process_sender: None, held: HeldKey | None
) -> None:
    store = RecordingStore()
    store.held = held
    cleanup.release_once_unmarked(store, Release("j1", "k"), every_s=0.02, within_s=60)
    assert cleanup.flush(5)
    assert [name for name, _, _ in store.calls] == ["get"]


# Deadlines


@pytest.mark.parametrize(
    ("seconds", "span"),
    [(None, 24 * 3600.0), (1.0, 60.0), (120.0, 120.0), (10**7, 24 * 3600.0)],
)
def test_an_owed_write_is_retried_between_a_minute_and_a_day(
    seconds: float | None, span: float
) -> None:
    before = time.monotonic()
    deadline = cleanup.deadline_after(seconds)
    assert before + span <= deadline <= time.monotonic() + span


def test_the_keys_of_claims_live_as_long_as_their_longest_lease_or_window() -> None:
    window = WindowClaim("w", 90_000, "f", "p")
    assert cleanup.claims_lifetime_s([]) == 0.0
    assert (
        cleanup.claims_lifetime_s(
            [
                Claim("j1", "t", ActiveClaim("k1", Scope.ACTIVE, 30_000)),
                Claim("j2", "t", window=window),
            ]
        )
        == 90.0
    )
    assert (
        cleanup.claims_lifetime_s([Claim("j1", "t", ActiveClaim("k1", Scope.ACTIVE, 120_500))])
        == 120.5
    )
    assert (
        cleanup.claims_lifetime_s(
            [
                Claim("j1", "t", ActiveClaim("k1", Scope.ACTIVE, 30_000)),
                Claim("j2", "t", ActiveClaim("k2", Scope.ACTIVE, None), window),
            ]
        )
        is None
    )


def _lost() -> BackendUnavailable:
    error = BackendUnavailable("lost")
    error.maybe_applied = True
    return error


# Waiting for the pool child that ran the job


def _child(comm: str = "sleeper") -> subprocess.Popen[str]:
    # A name with ") Z " in it: the state after the last ")" of /proc/<pid>/stat is what counts.
    code = (
        f"open('/proc/self/comm', 'w').write({comm!r}); print('ready', flush=True); "
        "import time; time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline() == "ready\n"
    child.stdout.close()
    return child


def test_a_release_waits_for_its_pool_child_to_exit(sender: cleanup.Cleanup) -> None:
    store = RecordingStore()
    child = _child("x) Z y")
    try:
        sender.owe(_owed(store, Release("j1", "k1"), after_exit_of=child.pid))
        assert not sender.flush(0.3)
        assert store.calls == []
        child.kill()  # not reaped yet: a zombie is gone too
        assert sender.flush(2)
        assert store.released() == [Release("j1", "k1")]
    finally:
        child.kill()
        child.wait()


def test_a_release_after_a_child_already_reaped_goes_at_once(sender: cleanup.Cleanup) -> None:
    store = RecordingStore()
    child = _child()
    child.kill()
    child.wait()
    sender.owe(_owed(store, Release("j1", "k1"), after_exit_of=child.pid))
    assert sender.flush(2)
    assert store.released() == [Release("j1", "k1")]


def test_a_release_stops_waiting_for_a_child_that_outlives_the_wait(
    sender: cleanup.Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cleanup, "CHILD_EXIT_WAIT_S", 0.3)
    store = RecordingStore()
    child = _child()
    try:
        owed = _owed(store, Release("j1", "k1"), after_exit_of=child.pid)
        sender.owe(owed)
        assert sender.flush(3)
        (sent,) = store.times("release")
        assert sent - owed.started >= 0.3
    finally:
        child.kill()
        child.wait()


def test_without_proc_a_release_asks_the_system_whether_its_child_is_gone(
    sender: cleanup.Cleanup, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where there is no /proc (macOS), a missing /proc/<pid> says nothing of the child."""
    monkeypatch.setattr(cleanup, "PROC", tmp_path)
    store = RecordingStore()
    child = _child()
    try:
        sender.owe(_owed(store, Release("j1", "k1"), after_exit_of=child.pid))
        assert not sender.flush(0.3)
        assert store.calls == []
        assert child.poll() is None  # asked with signal 0, which it never receives
    finally:
        child.kill()
        child.wait()
    assert sender.flush(2)
    assert store.released() == [Release("j1", "k1")]


# Slower: real waits of a second, a backlog of a hundred thousand writes.


def test_retries_back_off_twice_as_long_each_time_up_to_the_cap(
    sender: cleanup.Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cleanup, "FIRST_BACKOFF_S", 0.1)
    monkeypatch.setattr(cleanup, "MAX_BACKOFF_S", 0.4)
    store = RecordingStore(failures=4)
    sender.owe(_owed(store, Release("j1", "k1")))
    assert sender.flush(5)
    times = store.times("release")
    gaps = [later - earlier for earlier, later in pairwise(times)]
    assert len(gaps) == 4
    for gap, expected in zip(gaps, (0.1, 0.2, 0.4, 0.4), strict=True):
        assert expected <= gap < expected * 1.4, gaps


def test_the_default_bound_is_a_hundred_thousand_writes() -> None:
    store = RecordingStore()
    sender = cleanup.Cleanup()  # not started: the backlog stays
    hold = Release("j", "k")
    deadline = cleanup.deadline_after(60)
    sender.owe(
        *(
            cleanup.Owed(store=store, what="w", deadline=deadline, release=hold)
            for _ in range(100_001)
        )
    )
    assert sender.pending() == 100_000
    assert sender.dropped == 1


def test_work_repeated_counts_its_failed_attempts_afresh(
    sender: cleanup.Cleanup, short_backoff: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Once done and owed again for a repeat, its tries are counted from zero."""
    done: list[float] = []

    def work() -> bool:
        done.append(time.monotonic())
        if len(done) == 2:
            return False  # done, not final: repeated
        raise BackendUnavailable("not answering")

    with caplog.at_level(logging.WARNING, logger=LOG):
        sender.owe(
            cleanup.Owed(
                store=RecordingStore(),
                what="the undo",
                deadline=time.monotonic() + 0.3,
                action=work,
                repeats=(0.02,),
            )
        )
        assert sender.flush(5)
    (gave_up,) = _warnings(caplog, "gave up")
    assert gave_up.startswith(f"gave up the undo after {len(done) - 2} attempts over 0 s")


def test_a_copy_unrun_with_less_time_left_than_a_round_is_released_again_once(
    process_sender: None,
) -> None:
    store = RecordingStore(changed=False)
    store.held = _held()
    cleanup.release_once_unmarked(store, Release("j1", "k"), every_s=0.05, within_s=0.01)
    assert cleanup.flush(5)
    assert len(store.times("release")) == 2


def test_a_process_exiting_waits_for_what_it_owes(process_sender: None) -> None:
    store = RecordingStore()
    cleanup.release(store, Release("j1", "k"), within_s=60, after=_after(0.1))
    cleanup._at_exit()
    assert store.released() == [Release("j1", "k")]


def _after(seconds: float) -> Callable[[], bool]:
    ready = time.monotonic() + seconds
    return lambda: time.monotonic() >= ready
