"""What a dispatch reports back, on the ``AsyncResult`` it returns."""

from __future__ import annotations

import enum
from typing import TypeVar

from celery.result import AsyncResult


class Disposition(str, enum.Enum):
    """Whether a dispatch created a job or handed back an existing one."""

    CREATED = "created"
    REUSED = "reused"


class DuplicateMatch(str, enum.Enum):
    """Which key found the existing job."""

    ACTIVE = "active"
    WINDOW = "window"


R = TypeVar("R", bound=AsyncResult)  # type: ignore[type-arg]


def stamp(
    result: R,
    disposition: Disposition = Disposition.CREATED,
    match: DuplicateMatch | None = None,
    *,
    policy_drift: bool = False,
) -> R:
    """Attach the receipt attributes; every dispatch through a UniqueTask gets them."""
    result.disposition = disposition  # type: ignore[attr-defined]
    result.duplicate = disposition is Disposition.REUSED  # type: ignore[attr-defined]
    result.duplicate_match = match  # type: ignore[attr-defined]
    result.policy_drift = policy_drift  # type: ignore[attr-defined]
    return result
