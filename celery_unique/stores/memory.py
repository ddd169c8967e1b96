"""A store in this process's memory: for eager mode, unit tests and demos.

Nothing is shared between processes; a worker in another process sees none
of these keys. Time is this process's monotonic clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from celery_unique.stores import _records
from celery_unique.stores.base import Claim, Decision, HeldKey, KeyKind, Store


def _now() -> int:
    return time.monotonic_ns() // 1_000_000


class MemoryStore(Store):
    """Keys in a dict guarded by a lock."""

    def __init__(self) -> None:
        self._records: dict[str, _records.Record] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        """``memory://`` (anything after the scheme is ignored)."""
        return cls()

    def decide(self, claims: Sequence[Claim], *, all_or_nothing: bool = True) -> list[Decision]:
        with self._lock:
            decisions, writes = _records.decide(
                claims, self._records.get, _now(), all_or_nothing=all_or_nothing
            )
            self._apply(writes)
            return decisions

    def release(self, job_id: str, key: str, *, keep_ms: int | None = 0) -> bool:
        with self._lock:
            return self._change(key, _records.releasing(job_id, keep_ms))

    def rollback(self, claim: Claim) -> None:
        with self._lock:
            for key in _records.claim_keys(claim):
                self._change(key, _records.rolling_back(claim, key))

    def renew(self, job_id: str, keys: Sequence[str], lease_ms: int) -> int:
        return self.renew_many([(job_id, key) for key in keys], lease_ms)

    def renew_many(self, holds: Sequence[tuple[str, str]], lease_ms: int) -> int:
        with self._lock:
            return sum(
                self._change(key, _records.renewing(job_id, lease_ms)) for job_id, key in holds
            )

    def get(self, key: str) -> HeldKey | None:
        now = _now()
        record = self._records.get(key)
        return record.held(key, now) if record is not None and record.alive(now) else None

    def scan(self, *, kind: KeyKind | None = None, prefix: str = "") -> Iterator[HeldKey]:
        now = _now()
        with self._lock:
            items = list(self._records.items())
        for key, record in sorted(items):
            if key.startswith(prefix) and record.alive(now) and kind in (None, record.kind):
                yield record.held(key, now)

    def delete(self, key: str, *, job_id: str | None = None) -> bool:
        with self._lock:
            return self._change(key, _records.forgetting(job_id))

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

    def _change(self, key: str, change: _records.Change) -> bool:
        result = change(self._records.get(key), _now())
        if result is _records.UNCHANGED:
            return False
        self._apply({key: result})
        return True
