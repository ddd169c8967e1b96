"""The background sender of owed writes keeps each key's writes in the order they were owed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest

from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores import cleanup
from celery_unique.stores.base import GOES_ON, Release
from celery_unique.stores.memory import MemoryStore


class FlakyStore(MemoryStore):
    """Refuses its first ``failures`` release calls (a fake: the order is what is tested)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.sent: list[Release] = []
        self.lock = threading.Lock()

    def release_many(self, releases: Sequence[Release]) -> list[bool]:
        with self.lock:
            if self.failures:
                self.failures -= 1
                raise BackendUnavailable("not answering")
            self.sent += releases
        return [True for _ in releases]


def test_a_write_owed_later_never_overtakes_an_earlier_one_of_the_same_key() -> None:
    """The end of a run is refused once and retried; the next run's release, owed after it
    and ready at once, still reaches the store second."""
    store = FlakyStore(failures=1)
    sender = cleanup.Cleanup()
    sender.start()
    ended = Release("j1", "k", GOES_ON, "r1")
    other_key = Release("j2", "other", 0, None)
    sender.owe(
        cleanup.Owed(store=store, what="end r1", deadline=cleanup.deadline_after(60), release=ended)
    )
    assert _wait_until(lambda: store.failures == 0)
    released = Release("j1", "k", 0, "r2")
    for hold in (released, other_key):
        sender.owe(
            cleanup.Owed(
                store=store, what="release", deadline=cleanup.deadline_after(60), release=hold
            )
        )
    assert sender.flush(10)
    assert store.sent.index(ended) < store.sent.index(released)
    assert set(store.sent) == {ended, released, other_key}


def _wait_until(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.001)
    return False


def test_work_done_before_a_release_waits_for_the_earlier_writes_of_its_key() -> None:
    """The end of a run is refused once; the work owed before the next release of that key
    (passing a run owed to duplicates on) runs only once that end has landed."""
    store = FlakyStore(failures=1)
    sender = cleanup.Cleanup()
    sender.start()
    ended = Release("j1", "k", GOES_ON, "r1")
    sender.owe(
        cleanup.Owed(store=store, what="end r1", deadline=cleanup.deadline_after(60), release=ended)
    )
    assert _wait_until(lambda: store.failures == 0)
    seen: list[list[Release]] = []

    def work() -> bool:
        with store.lock:
            seen.append(list(store.sent))
        return True

    sender.owe(
        cleanup.Owed(
            store=store, what="pass on", deadline=cleanup.deadline_after(60), action=work, key="k"
        )
    )
    assert sender.flush(10)
    assert seen == [[ended]]


def test_writes_past_the_bound_are_dropped_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process owes at most ``MAX_OWED`` writes: more are dropped (the lease frees their
    keys), counted, and logged once per overflow rather than once per write."""
    monkeypatch.setattr(cleanup, "MAX_OWED", 10)
    store = MemoryStore()
    sender = cleanup.Cleanup()  # not started: nothing is sent, so the backlog stays
    owed = [
        cleanup.Owed(
            store=store,
            what=f"release {n}",
            deadline=cleanup.deadline_after(60),
            release=Release(f"j{n}", f"k{n}", 0, None),
        )
        for n in range(15)
    ]
    with caplog.at_level("WARNING", logger="celery_unique"):
        sender.owe(*owed[:8])
        sender.owe(*owed[8:])
        sender.owe(owed[0])
    assert sender.pending() == 10
    assert sender.dropped == 6
    overflow = [r for r in caplog.records if "owed; dropping" in r.getMessage()]
    assert len(overflow) == 1
    assert "release 10" in overflow[0].getMessage()


def test_a_write_no_longer_owed_leaves_the_backlog_unsent() -> None:
    """A release whose wait answers ``None`` (its message came back) is dropped from what
    is owed without being sent, while the rest of the backlog goes out."""
    store = FlakyStore(failures=0)
    sender = cleanup.Cleanup()
    cancelled = Release("j1", "k1", 0, None)
    kept = Release("j2", "k2", 0, None)
    sender.owe(
        cleanup.Owed(
            store=store,
            what="cancelled",
            deadline=cleanup.deadline_after(60),
            release=cancelled,
            after=lambda: None,
        ),
        cleanup.Owed(store=store, what="kept", deadline=cleanup.deadline_after(60), release=kept),
    )
    sender.start()
    assert sender.flush(10)
    assert store.sent == [kept]


def test_discarding_drops_what_is_owed_to_one_store_or_to_every_store() -> None:
    """Writes owed to a store thrown away are forgotten: one store's, or (no store named)
    all of them, as a test file ends with its stores."""
    one, other = MemoryStore(), MemoryStore()
    sender = cleanup.Cleanup()  # not started: nothing is sent, so the backlog stays

    def owed(store: MemoryStore, n: int) -> cleanup.Owed:
        release = Release(f"j{n}", f"k{n}", 0, None)
        return cleanup.Owed(
            store=store, what=f"release {n}", deadline=cleanup.deadline_after(60), release=release
        )

    sender.owe(owed(one, 1), owed(other, 2), owed(one, 3))
    assert sender.discard(one) == 2
    assert sender.pending() == 1
    sender.owe(owed(one, 4))
    assert sender.discard(None) == 2
    assert sender.pending() == 0
