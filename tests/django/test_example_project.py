"""The example project: tasks declared with base=UniqueTask, everything set in settings.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from django.test import override_settings

from celery_unique import Disposition, DuplicateMatch
from celery_unique.config import reset, runtime
from celery_unique_django.models import UniqueKey
from celery_unique_django.store import DjangoStore
from tests.django.conftest import require_database
from tests.django.example.shop.tasks import charge, recalculate_totals, send_receipt

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def eager(example_app: Celery) -> Iterator[Celery]:
    """The example app running tasks in-process (``task_always_eager``)."""
    example_app.conf.task_always_eager = True
    yield example_app
    example_app.conf.task_always_eager = False


def test_settings_reach_celery_unique_through_the_celery_namespace(example_app: Celery) -> None:
    """CELERY_UNIQUE_* in settings.py become the app's store, namespace, lease and fail-open."""
    rt = runtime(example_app)
    assert (rt.backend_url, rt.namespace, rt.lease_ms, rt.fail_open) == (
        "django://",
        "example",
        30 * 60 * 1000,
        False,
    )
    assert isinstance(rt.store, DjangoStore)
    assert rt.store.alias == "default"


def test_a_second_dispatch_reuses_the_job(example_app: Celery) -> None:
    """An ordinary task with base=UniqueTask is deduplicated through the database."""
    first = recalculate_totals.delay("ada")
    second = recalculate_totals.delay(customer="ada")
    assert (first.disposition, second.disposition, second.duplicate_match) == (
        Disposition.CREATED,
        Disposition.REUSED,
        DuplicateMatch.ACTIVE,
    )
    assert second.id == first.id
    assert recalculate_totals.delay("bob").disposition is Disposition.CREATED


def test_window_key_returns_the_same_job_for_the_same_request(example_app: Celery) -> None:
    """A retried charge within the window is the first charge's job."""
    first = charge.delay(order_id=9, amount_cents=250)
    retry = charge.delay(order_id=9, amount_cents=250)
    assert (retry.disposition, retry.duplicate_match, retry.id) == (
        Disposition.REUSED,
        DuplicateMatch.WINDOW,
        first.id,
    )


@pytest.mark.parametrize("task", [recalculate_totals, send_receipt], ids=["queued", "active"])
def test_keys_are_released_when_the_job_has_run(eager: Celery, task: object) -> None:
    """Run eagerly, a job frees its key through the lifecycle signals: the next one is new."""
    arguments = {"customer": "eve"} if task is recalculate_totals else {"order_id": 5}
    first = task.delay(**arguments)  # type: ignore[attr-defined]
    assert first.get() is not None
    assert list(runtime(eager).store.scan()) == []
    second = task.delay(**arguments)  # type: ignore[attr-defined]
    assert (second.disposition, second.id != first.id) == (Disposition.CREATED, True)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True, databases=["default", "postgres"])
def test_store_url_can_name_another_database(example_app: Celery) -> None:
    """``CELERY_UNIQUE_BACKEND = "django://postgres"`` keeps the keys on that database."""
    require_database("postgres")
    with override_settings(CELERY_UNIQUE_BACKEND="django://postgres"):
        reset(example_app)
        store = runtime(example_app).store
        assert isinstance(store, DjangoStore)
        assert store.alias == "postgres"
        job = recalculate_totals.delay("pat")
        assert UniqueKey.objects.using("postgres").get().job_id == job.id
        assert not UniqueKey.objects.using("default").exists()
        reset(example_app)
