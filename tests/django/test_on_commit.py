"""Dispatch on commit: the uniqueness decision and the publish wait for the transaction."""

from __future__ import annotations

import logging

import pytest
from celery import Celery
from django.db import transaction

from celery_unique import Disposition, UniquenessConflict
from celery_unique.config import runtime
from celery_unique_django.on_commit import OnCommitDispatch, dispatch_on_commit
from celery_unique_django.task import UniqueDjangoTask
from tests.django.example.shop.models import Order
from tests.django.example.shop.tasks import charge, recalculate_totals, send_receipt

pytestmark = pytest.mark.django_db(transaction=True)


def held(app: Celery) -> list[tuple[str, str]]:
    """(key, job id) of every held key of the app."""
    return [(h.key, h.job_id) for h in runtime(app).store.scan()]


def test_dispatch_waits_for_commit_then_reports(example_app: Celery, published: list[str]) -> None:
    """Inside the transaction nothing is decided or sent; at commit the job is created."""
    with transaction.atomic():
        Order.objects.create(customer="ada", total_cents=500)
        pending = dispatch_on_commit(recalculate_totals, "ada")
        assert (pending.done, pending.result, held(example_app), published) == (
            False,
            None,
            [],
            [],
        )
    assert pending.done
    assert pending.result is not None
    assert pending.result.disposition is Disposition.CREATED
    assert published == [pending.result.id]
    assert [job for _, job in held(example_app)] == [pending.result.id]


def test_rolled_back_transaction_publishes_nothing_and_holds_no_key(
    example_app: Celery, published: list[str]
) -> None:
    """A rollback drops the dispatch: no message, no key, the handle never runs."""
    handles: list[OnCommitDispatch] = []

    def save_order() -> None:
        with transaction.atomic():
            handles.append(send_receipt.delay_on_commit(order_id=7))
            raise RuntimeError("the order could not be saved")

    with pytest.raises(RuntimeError):
        save_order()
    (pending,) = handles
    assert (pending.done, pending.result, pending.error) == (False, None, None)
    assert held(example_app) == []
    assert published == []
    again = send_receipt.delay(order_id=7)
    assert again.disposition is Disposition.CREATED


def test_two_dispatches_of_one_key_in_a_transaction_make_one_job(
    example_app: Celery, published: list[str]
) -> None:
    """At commit the second dispatch is decided after the first: REUSED, same job."""
    with transaction.atomic():
        first = dispatch_on_commit(recalculate_totals, customer="bob")
        second = dispatch_on_commit(recalculate_totals.s(customer="bob"))
    assert first.result is not None
    assert second.result is not None
    assert (first.result.disposition, second.result.disposition) == (
        Disposition.CREATED,
        Disposition.REUSED,
    )
    assert second.result.id == first.result.id
    assert published == [first.result.id]


def test_outside_a_transaction_it_dispatches_at_once(example_app: Celery) -> None:
    """With no transaction open there is nothing to wait for."""
    pending = send_receipt.apply_async_on_commit(kwargs={"order_id": 1}, countdown=5)
    assert pending.done
    assert pending.result is not None
    assert pending.result.disposition is Disposition.CREATED


def test_an_error_at_commit_is_kept_and_raised(example_app: Celery) -> None:
    """A conflict found at commit is on the handle and raised where the transaction commits."""
    charge.delay(order_id=3, amount_cents=100)
    with pytest.raises(UniquenessConflict), transaction.atomic():
        pending = dispatch_on_commit(charge, order_id=3, amount_cents=999)
    assert pending.done
    assert isinstance(pending.error, UniquenessConflict)
    assert pending.result is None


def test_robust_dispatch_logs_the_error_instead(
    example_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """With robust=True Django logs the failure and the transaction's block returns normally."""
    charge.delay(order_id=4, amount_cents=100)
    with caplog.at_level(logging.ERROR, logger="django.db.backends.base"), transaction.atomic():
        pending: OnCommitDispatch = dispatch_on_commit(
            charge, order_id=4, amount_cents=999, robust=True
        )
    assert isinstance(pending.error, UniquenessConflict)
    assert "uniqueness_conflict" in repr(pending) or "UniquenessConflict" in repr(pending)


def test_a_unique_django_task_is_celerys_django_task(
    example_app: Celery, published: list[str]
) -> None:
    """UniqueDjangoTask is Celery's DjangoTask, its on-commit methods deferring as Celery's do."""
    django_task = pytest.importorskip("celery.contrib.django.task").DjangoTask
    assert issubclass(UniqueDjangoTask, django_task)
    assert isinstance(send_receipt, django_task)
    with transaction.atomic():
        # Celery's call: positional args and kwargs, options as keywords.
        pending = send_receipt.apply_async_on_commit((), {"order_id": 8}, countdown=0)
        assert (pending.done, published) == (False, [])
    assert pending.result is not None
    assert pending.result.disposition is Disposition.CREATED
    assert published == [pending.result.id]
