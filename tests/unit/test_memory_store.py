"""The memory store around the shared rules: its clock told as dates, and scans that meet
release notes."""

from __future__ import annotations

import time

from celery_unique.stores.base import ActiveClaim, Claim, OnDuplicate, Scope, Verdict
from celery_unique.stores.memory import MemoryStore

A = "unique:v1:{ns}:a:tasks.reindex\x1fcustomer:42"
B = "unique:v1:{ns}:a:tasks.reindex\x1fcustomer:43"
LONG = 60_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_a_planned_start_is_told_as_a_date_on_the_wall_clock() -> None:
    """The store counts on the monotonic clock; a debounced job's start is answered as ms
    since the epoch, as the worker compares it with the wall clock."""
    store = MemoryStore()
    claim = ActiveClaim(A, Scope.ACTIVE, LONG, OnDuplicate.DEBOUNCE, "args", 5_000, None)
    before = now_ms()
    created = store.decide([Claim("j1", "tasks.reindex", claim)])[0]
    after = now_ms()
    assert created.verdict is Verdict.CREATED
    assert created.starts_at_ms is not None
    # One ms of slack: the two clocks may round the same instant apart.
    assert before + 5_000 - 1 <= created.starts_at_ms <= after + 5_000 + 1


def test_a_scan_passes_over_a_release_note_to_the_keys_after_it() -> None:
    """A note (``unique:released:...``) sorts before every held key."""
    store = MemoryStore()
    store.decide(
        [Claim("j1", "tasks.reindex", ActiveClaim(A, Scope.ACTIVE, LONG, generation="g1"))]
    )
    assert store.delete(A, job_id="j1") is True
    store.decide([Claim("j2", "tasks.reindex", ActiveClaim(B, Scope.ACTIVE, LONG))])
    assert [(held.key, held.job_id) for held in store.scan()] == [(B, "j2")]


def test_the_times_the_store_answers_are_whole_milliseconds() -> None:
    store = MemoryStore()
    claim = ActiveClaim(A, Scope.ACTIVE, LONG, OnDuplicate.DEBOUNCE, "args", 5_000, None)
    created = store.decide([Claim("j1", "tasks.reindex", claim)])[0]
    held = store.get(A)
    assert held is not None
    assert type(created.starts_at_ms) is int
    assert type(held.expires_in_ms) is int
    assert type(held.starts_in_ms) is int


def test_a_memory_url_makes_an_empty_store_of_its_own() -> None:
    first = MemoryStore.from_url("memory://")
    first.decide([Claim("j1", "tasks.reindex", ActiveClaim(A, Scope.ACTIVE, LONG))])
    second = MemoryStore.from_url("memory://anything")
    assert isinstance(second, MemoryStore)
    assert list(second.scan()) == []
    assert [held.job_id for held in first.scan()] == ["j1"]
