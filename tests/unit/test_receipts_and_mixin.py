"""Receipts are typed results; uniqueness composes with a project's own task class."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
from celery import Celery, Task
from celery.result import AsyncResult, EagerResult

from celery_unique import (
    CallbacksNotAttached,
    Disposition,
    DuplicateMatch,
    UniqueMixin,
    UniqueResult,
    UniqueTask,
)


def test_a_receipt_is_the_apps_own_result_class_with_the_dispatch_outcome(app: Celery) -> None:
    @app.task(base=UniqueTask, unique_key="k", shared=False)
    def job() -> None:
        return None

    first, again = job.delay(), job.delay()
    for receipt in (first, again):
        assert isinstance(receipt, UniqueResult)
        assert isinstance(receipt, app.AsyncResult)
    assert (first.disposition, first.duplicate, first.duplicate_match) == (
        Disposition.CREATED,
        False,
        None,
    )
    assert (again.disposition, again.duplicate, again.duplicate_match) == (
        Disposition.REUSED,
        True,
        DuplicateMatch.ACTIVE,
    )
    assert again.id == first.id
    assert (first.callbacks_dropped, again.callbacks_dropped) == (False, False)


def test_a_pickled_receipt_is_the_plain_result(app: Celery) -> None:
    @app.task(base=UniqueTask, unique_key="k", shared=False)
    def job() -> None:
        return None

    receipt = job.delay()
    copy = pickle.loads(pickle.dumps(receipt))
    assert isinstance(copy, AsyncResult)
    assert not isinstance(copy, UniqueResult)
    assert copy.id == receipt.id


def test_an_eager_receipt_is_an_eager_result(app: Celery) -> None:
    app.conf.task_always_eager = True

    @app.task(base=UniqueTask, unique_key="k", shared=False)
    def double(n: int) -> int:
        return 2 * n

    receipt = double.delay(21)
    assert isinstance(receipt, EagerResult)
    assert isinstance(receipt, UniqueResult)
    assert (receipt.get(), receipt.disposition) == (42, Disposition.CREATED)
    assert type(pickle.loads(pickle.dumps(receipt))) is EagerResult


def test_a_reuse_that_leaves_callbacks_behind_says_so_on_the_receipt(app: Celery) -> None:
    @app.task(base=UniqueTask, unique_key="k", shared=False)
    def job() -> None:
        return None

    @app.task(shared=False)
    def after(_: Any) -> None:
        return None

    job.delay()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CallbacksNotAttached)
        again = job.apply_async(link=after.s())
    assert (again.disposition, again.callbacks_dropped) == (Disposition.REUSED, True)


class Audited(Task):  # type: ignore[type-arg]
    """A project's base class that does its own thing on every dispatch."""

    abstract = True
    sent: list[str] = []

    def apply_async(self, *args: Any, **kwargs: Any) -> Any:
        result = super().apply_async(*args, **kwargs)
        Audited.sent.append(result.id)
        return result


def test_the_mixin_decides_before_the_project_base_class_publishes(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    class AuditedUnique(UniqueMixin, Audited):
        abstract = True

    Audited.sent = []

    @app.task(base=AuditedUnique, unique_key=lambda job: f"n:{job.n}", shared=False)
    def job(n: int) -> None:
        return None

    first, again, other = job.delay(1), job.delay(1), job.delay(2)
    assert (first.disposition, again.disposition, other.disposition) == (
        Disposition.CREATED,
        Disposition.REUSED,
        Disposition.CREATED,
    )
    assert again.id == first.id
    # The reused dispatch never reached the base class, nor the broker.
    assert Audited.sent == [first.id, other.id]
    assert [headers["id"] for headers in published] == [first.id, other.id]


def test_the_mixin_validates_declarations_like_the_task_class(app: Celery) -> None:
    from celery_unique import InvalidDeclaration

    with pytest.raises(InvalidDeclaration):

        @app.task(base=type("Mixed", (UniqueMixin, Task), {}), unique_while="forever", shared=False)
        def job() -> None:
            return None
