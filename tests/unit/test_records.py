"""The decision rules of the stores that run Python (``stores/_records.py``), called directly
where the store contract (``tests/contract``) cannot tell: what each store does with them is
held there, on every store."""

from __future__ import annotations

import dataclasses

import pytest

from celery_unique.stores._records import UNCHANGED, Record, decide, renewing, rolling_back
from celery_unique.stores.base import ActiveClaim, Claim, Hold, KeyKind, Scope, Verdict


def test_a_record_cannot_be_changed_in_place() -> None:
    """A store keeps the records it hands to a change function: a change returns a new
    record (dataclasses.replace), and may never alter the one the store still holds."""
    record = Record("job", "task", KeyKind.ACTIVE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.job_id = "other"  # type: ignore[misc]


def test_a_rollback_names_its_job_by_value() -> None:
    """A store that reads records back (SQLite, Django) holds a job id equal to the
    claim's, never the same object: the rollback undoes the write all the same."""
    job_id = "".join(["job-", "1"])
    claim = Claim(job_id, "task", active=ActiveClaim("key", Scope.ACTIVE, None))
    stored = Record("".join(["job", "-1"]), "task", KeyKind.ACTIVE, Scope.ACTIVE)
    assert stored.job_id == job_id
    assert stored.job_id is not job_id
    assert rolling_back(claim, "key")(stored, 0) is None
    other = Record("job-2", "task", KeyKind.ACTIVE, Scope.ACTIVE)
    assert rolling_back(claim, "key")(other, 0) is UNCHANGED


@pytest.mark.parametrize(
    ("due", "starts_in_ms"), [(None, None), (100, None), (200, None), (300, 100)]
)
def test_a_planned_start_reads_as_the_time_left_until_it(
    due: int | None, starts_in_ms: int | None
) -> None:
    """A start that is due (now or past: the worker has not marked the run yet) is no
    start still to wait for."""
    record = Record("job", "task", KeyKind.ACTIVE, Scope.ACTIVE, due=due)
    assert record.held("key", 200).starts_in_ms == starts_in_ms


def test_a_handoff_names_the_running_job_by_value() -> None:
    """A task that chains to itself hands its key to the next job: the holder read back
    from a store is equal to the one the claim names, never the same object."""
    held = Record("".join(["job", "-1"]), "task", KeyKind.ACTIVE, Scope.ACTIVE, run="r1")
    claim = Claim(
        "job-2",
        "task",
        active=ActiveClaim("key", Scope.ACTIVE, None),
        handoff_from="".join(["job-", "1"]),
    )
    assert held.job_id is not claim.handoff_from
    (decision,), writes = decide([claim], {"key": held}.get, 0, all_or_nothing=True)
    assert (decision.verdict, decision.job_id) == (Verdict.CREATED, "job-2")
    assert (writes["key"].job_id, writes["key"].handed_from) == ("job-2", held.job_id)
    other = Record("job-9", "task", KeyKind.ACTIVE, Scope.ACTIVE, run="r9")
    (decision,), _ = decide([claim], {"key": other}.get, 0, all_or_nothing=True)
    assert (decision.verdict, decision.job_id) == (Verdict.REUSED_ACTIVE, "job-9")  # type: ignore[union-attr]


def test_a_record_is_gone_at_its_expiry() -> None:
    record = Record("job", "task", KeyKind.ACTIVE, expires_at=100)
    assert (record.alive(99), record.alive(100)) == (True, False)
    assert Record("job", "task", KeyKind.ACTIVE).alive(10**15)


def test_a_renewal_holds_the_key_for_the_lease_from_now() -> None:
    record = Record("job", "task", KeyKind.ACTIVE, Scope.ACTIVE, expires_at=1_000)
    renewed = renewing(Hold("job", "key"), 5_000)(record, 500)
    assert isinstance(renewed, Record)
    assert renewed.expires_at == 5_500
