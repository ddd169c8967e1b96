"""Fakes of a runtime and its store, for unit tests of code that reads only a few of their
fields (the publish gate, the dispatch path's small rules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery_unique.stores.base import Claim, Decision, Hold, Verdict

CREATED = Decision(Verdict.CREATED, "job")


@dataclass
class AnsweringStore:
    """Answers ``decide`` with ``answers`` (or raises ``error``), counting the calls; records
    each renewal (or raises ``error`` there too)."""

    answers: list[Decision] = field(default_factory=lambda: [CREATED])
    error: BaseException | None = None
    asked: int = 0
    renewed: list[tuple[list[Hold], int]] = field(default_factory=list)

    def decide(self, claims: list[Claim]) -> list[Decision]:
        self.asked += 1
        if self.error is not None:
            raise self.error
        return self.answers

    def renew_many(self, holds: list[Hold], lease_ms: int) -> None:
        if self.error is not None:
            raise self.error
        self.renewed.append((holds, lease_ms))


@dataclass
class FakeRuntime:
    """The fields of an app's runtime the gate and the dispatch path read."""

    store: Any = field(default_factory=AnsweringStore)
    lease_ms: int | None = 60_000
    fail_open: bool = False
    outage: bool = False
