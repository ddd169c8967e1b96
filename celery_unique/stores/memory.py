"""A store in this process's memory: for eager mode, unit tests and demos.

Nothing is shared between processes; a worker in another process sees none
of these keys. Time is this process's monotonic clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from celery_unique.keys.keyspace import is_release_note
from celery_unique.stores import _records
from celery_unique.stores.base import Claim, Decision, HeldKey, KeyKind


def _now() -> int:
    return time.monotonic_ns() // 1_000_000


class MemoryStore(_records.RecordStore):
    """Keys in a dict guarded by a lock."""

    def __init__(self) -> None:
        self._records: dict[str, _records.Record] = {}
        self._lock = threading.Lock()
        # The wall clock, read as the monotonic one plus an offset fixed once: times
        # told as dates (a planned start) then move exactly as the store's clock does.
        self._epoch_ms = time.time_ns() // 1_000_000 - _now()

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        """``memory://`` (anything after the scheme is ignored)."""
        return cls()

    def decide(self, claims: Sequence[Claim], *, all_or_nothing: bool = True) -> list[Decision]:
        with self._lock:
            # One reading of the clock: two could differ by a millisecond, and a planned
            # start told as a date would then move back and forth.
            now = _now()
            decisions, writes = _records.decide(
                claims,
                self._records.get,
                now,
                all_or_nothing=all_or_nothing,
                wall=now + self._epoch_ms,
            )
            self._apply(writes)
            return decisions

    def get(self, key: str) -> HeldKey | None:
        now = _now()
        record = self._records.get(key)
        return record.held(key, now) if record is not None and record.alive(now) else None

    def scan(self, *, kind: KeyKind | None = None, prefix: str = "") -> Iterator[HeldKey]:
        now = _now()
        with self._lock:
            items = list(self._records.items())
        for key, record in sorted(items):
            if is_release_note(key):
                continue
            if key.startswith(prefix) and record.alive(now) and kind in (None, record.kind):
                yield record.held(key, now)

    def ping(self) -> None:
        return None

    def clear(self) -> None:
        """Forget every key (for tests)."""
        with self._lock:
            self._records.clear()

    def _apply(self, writes: _records.Writes) -> None:
        for key, record in writes.items():
            if record is None:
                self._records.pop(key, None)
            else:
                self._records[key] = record

    def _change(self, changes: Sequence[tuple[str, _records.Change]]) -> list[bool]:
        with self._lock:
            changed, writes = _records.apply_changes(changes, self._records.get, _now())
            self._apply(writes)
            return changed
