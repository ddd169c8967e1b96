"""Keys a dispatch found held in this process: their next dispatch asks first.

A duplicate is answered by the store in one round trip, but Celery builds its
message meanwhile (the answer is read only when the message would leave), and
on a shared store and broker server a created dispatch waits for its message
to be built before it asks. For a key found held a moment ago, the next
dispatch is most likely a duplicate again: it reads the answer before any
message is built. A wrong guess (the key was freed since) costs the overlap
of one dispatch, never a wrong answer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from celery_unique.stores.base import Claim, Decision

#: How many keys a process remembers (each costs a dict entry).
SIZE = 4096


class RecentlyHeld:
    """The keys (active and window key of a claim) last found held, newest last, bounded."""

    def __init__(self, size: int = SIZE) -> None:
        self._keys: OrderedDict[tuple[str | None, str | None], None] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def __contains__(self, claim: Claim) -> bool:
        return _keys_of(claim) in self._keys

    def note(self, claim: Claim, decision: Decision | None) -> None:
        keys = _keys_of(claim)
        with self._lock:
            if decision is None or decision.verdict.publishes:
                self._keys.pop(keys, None)
                return
            self._keys[keys] = None
            self._keys.move_to_end(keys)
            while len(self._keys) > self._size:
                self._keys.popitem(last=False)


def _keys_of(claim: Claim) -> tuple[str | None, str | None]:
    active, window = claim.active, claim.window
    return (active.key if active else None, window.key if window else None)
