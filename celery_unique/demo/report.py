"""What the demo saw: every dispatch as a row, by scene, with short names for its jobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery.result import AsyncResult

from celery_unique import UniquenessError


@dataclass(frozen=True)
class Row:
    """One dispatch and what came of it."""

    #: What the dispatch was, or the moment it was sent at.
    step: str
    #: ``CREATED``, ``REUSED`` or an error code.
    outcome: str
    #: ``J1``, ``J2`` ... in the order the scene met the jobs; for errors, the
    #: job the error names (``conflicting_job_id``), if any.
    job: str | None
    job_id: str | None
    #: ``active``, ``window`` or ``None`` (the receipt's ``duplicate_match``).
    match: str | None = None
    policy_drift: bool = False
    #: What the store held for the key just before this dispatch.
    key_before: str = ""
    #: Free text: the key, or the error's message.
    detail: str = ""

    @property
    def summary(self) -> str:
        """``"REUSED J1"``: the outcome and the job, as :data:`.expected.EXPECTED` lists them."""
        return f"{self.outcome} {self.job}" if self.job else self.outcome


@dataclass(frozen=True)
class Refusal:
    """An invalid dispatch: the error it raised and what it changed (nothing)."""

    given: str
    code: str
    message: str
    keys_written: int
    messages_published: int


@dataclass
class Report:
    """Every dispatch the demo made, by scene, and what did not go as documented."""

    scopes: dict[str, list[Row]] = field(default_factory=dict)
    #: For each scope, the moment its first job's key was seen free (or ``None``).
    freed: dict[str, str | None] = field(default_factory=dict)
    payload: list[Row] = field(default_factory=list)
    #: Per payload dispatch: the store holds the key computed by hand with
    #: ``Payload.key`` for the job the dispatch returned.
    payload_keys_held: list[bool] = field(default_factory=list)
    window: list[Row] = field(default_factory=list)
    invalid: list[Refusal] = field(default_factory=list)
    #: Lines the library logged at WARNING or above (logger ``celery_unique``).
    warnings: list[str] = field(default_factory=list)
    surprises: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.surprises


class Labels:
    """Short names for job ids, in the order a scene meets them: J1, J2, ..."""

    def __init__(self) -> None:
        self._names: dict[str, str] = {}

    def __call__(self, job_id: str | None) -> str | None:
        if job_id is None:
            return None
        return self._names.setdefault(job_id, f"J{len(self._names) + 1}")

    @property
    def ids(self) -> list[str]:
        return list(self._names)


def dispatched(step: str, result: AsyncResult[Any], labels: Labels, before: str) -> Row:
    """The row of a dispatch that returned a job, created or reused."""
    match = result.duplicate_match  # type: ignore[attr-defined]
    return Row(
        step=step,
        outcome=result.disposition.name,  # type: ignore[attr-defined]
        job=labels(result.id),
        job_id=result.id,
        match=None if match is None else match.value,
        policy_drift=result.policy_drift,  # type: ignore[attr-defined]
        key_before=before,
    )


def refused(step: str, error: UniquenessError, labels: Labels, before: str) -> Row:
    """The row of a dispatch the library refused with ``error``."""
    job_id: str | None = getattr(error, "conflicting_job_id", None)
    return Row(
        step=step,
        outcome=error.code,
        job=labels(job_id),
        job_id=job_id,
        key_before=before,
        detail=str(error),
    )
