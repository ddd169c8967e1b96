"""A store with a planted bug, for proving that the history checker catches one.

Now and then it forgets that an active key is held before deciding (as a
store that loses writes would): two jobs of one key get created and run at
once. A run against it must report violations.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from celery_unique.stores.base import Claim, PendingDecisions
from celery_unique.stores.redis import RedisStore

#: The store override the chaos actors take: ``scheme:factory``.
OVERRIDE = "brokenredis:tests.history.broken:BrokenStore.from_url"


class BrokenStore(RedisStore):
    """Redis, but a decision forgets the claims' held active keys one time in three."""

    @classmethod
    def from_url(cls, url: str) -> RedisStore:
        return super().from_url("redis://" + url.split("://", 1)[1])

    def send_decide(
        self, claims: Sequence[Claim], *, all_or_nothing: bool = True
    ) -> PendingDecisions:
        keys = [claim.active.key for claim in claims if claim.active is not None]
        if keys and random.random() < 1 / 3:
            self.client.delete(*keys)
        return super().send_decide(claims, all_or_nothing=all_or_nothing)
