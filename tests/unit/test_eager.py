"""Eager mode and .apply(): the same semantics as a real dispatch."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.result import EagerResult

from celery_unique import (
    Disposition,
    DuplicateMatch,
    EagerOutcomeUnknown,
    UniquenessConflict,
    UniqueTask,
    dispatch_many,
)
from celery_unique.stores.base import Store
from celery_unique.testing import held_keys, unique_store


def test_eager_dispatch_runs_and_releases(app: Celery, unique_eager: Store) -> None:
    """An eager job runs at once, and its queued/active key is free when delay() returns."""
    runs: list[int] = []

    @app.task(shared=False, base=UniqueTask, unique_key="k", unique_while="active")
    def job(x: int) -> int:
        runs.append(x)
        return x

    first = job.delay(1)
    assert first.get() == 1
    assert first.disposition is Disposition.CREATED
    assert held_keys() == []
    assert job.delay(2).id != first.id
    assert runs == [1, 2]


def test_eager_job_dispatching_its_own_key_is_deduplicated(app: Celery) -> None:
    """Inside a running eager job, a dispatch of another job with its key reuses it."""
    inner: list[Any] = []

    @app.task(shared=False, base=UniqueTask, unique_key="k", unique_while="active")
    def outer() -> None:
        inner.append(other.delay())

    @app.task(
        shared=False, base=UniqueTask, unique_key="k", unique_while="active", unique_prefix=False
    )
    def other() -> None:
        return None

    @app.task(
        shared=False, base=UniqueTask, unique_key="k", unique_while="active", unique_prefix=False
    )
    def holder() -> None:
        inner.append(other.delay())

    with unique_store(app, eager=True):
        outer.delay()
        held = holder.delay()
    assert inner[0].disposition is Disposition.CREATED
    assert (inner[1].disposition, inner[1].id) == (Disposition.REUSED, held.id)


def test_apply_checks_uniqueness_too(app: Celery) -> None:
    """Calling .apply() directly goes through the same decision as a dispatch."""

    @app.task(
        shared=False, base=UniqueTask, unique_key="k", unique_while="exists", unique_retention=60
    )
    def job() -> str:
        return "ran"

    with unique_store(app):
        first = job.apply()
        again = job.apply()
    assert first.get() == "ran"
    assert (again.disposition, again.duplicate_match, again.id) == (
        Disposition.REUSED,
        DuplicateMatch.ACTIVE,
        first.id,
    )


def test_eager_window_conflict(app: Celery, unique_eager: Store) -> None:
    """Window keys behave in eager mode as they do on a worker."""

    @app.task(shared=False, base=UniqueTask, unique_window_key=lambda j: j.rid, unique_window=60)
    def order(rid: str, amount: int) -> int:
        return amount

    first = order.delay("r1", 5)
    assert order.delay("r1", 5).id == first.id
    with pytest.raises(UniquenessConflict):
        order.delay("r1", 6)
    assert held_keys() == [f"{order.name}:r1"]


def test_eager_duplicate_returns_the_holders_eager_result(app: Celery, unique_eager: Store) -> None:
    """A reused eager dispatch is an EagerResult carrying the holder's value, not a PENDING one."""

    @app.task(
        shared=False, base=UniqueTask, unique_key="k", unique_while="exists", unique_retention=60
    )
    def job(x: int) -> int:
        return x * 10

    first = job.delay(1)
    again = job.delay(2)
    batch = dispatch_many([job.s(3)])[0]
    for receipt in (again, batch):
        assert isinstance(receipt, EagerResult)
        assert (receipt.id, receipt.duplicate, receipt.state) == (first.id, True, "SUCCESS")
        assert receipt.get(timeout=1) == 10
    assert (first.disposition, first.get()) == (Disposition.CREATED, 10)


def test_apply_duplicate_returns_the_holders_eager_result(app: Celery) -> None:
    """``.apply()`` of a duplicate hands back the holder's outcome, its failure included."""

    @app.task(shared=False, base=UniqueTask, unique_window_key=lambda j: j.rid, unique_window=60)
    def fails(rid: str) -> None:
        raise ValueError(rid)

    with unique_store(app):
        first = fails.apply(("r1",))
        again = fails.apply(("r1",))
    assert isinstance(again, EagerResult)
    assert (again.id, again.duplicate_match, again.state) == (
        first.id,
        DuplicateMatch.WINDOW,
        "FAILURE",
    )
    with pytest.raises(ValueError, match="r1"):
        again.get()


def test_eager_duplicate_of_a_running_holder_says_its_outcome_is_unknown(app: Celery) -> None:
    """A duplicate of a job still running eagerly cannot carry its value: get() says why."""
    inner: list[Any] = []

    shared = {"unique_key": "k", "unique_while": "active", "unique_prefix": False}

    @app.task(shared=False, base=UniqueTask, **shared)
    def holder() -> str:
        inner.append(other.delay())
        return "done"

    @app.task(shared=False, base=UniqueTask, **shared)
    def other() -> None:
        return None

    with unique_store(app, eager=True):
        outer = holder.delay()
    (duplicate,) = inner
    assert isinstance(duplicate, EagerResult)
    assert (duplicate.id, duplicate.duplicate, duplicate.state) == (outer.id, True, "PENDING")
    with pytest.raises(EagerOutcomeUnknown) as raised:
        duplicate.get(timeout=1)
    assert (raised.value.code, raised.value.job_id) == ("eager_outcome_unknown", outer.id)
