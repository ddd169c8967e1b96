"""The ``unique_*`` management commands, on the example project's Django store."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from celery import Celery
from django.core.management import call_command
from django.core.management.base import CommandError

from celery_unique import Disposition
from celery_unique.config import runtime
from tests.django.example.shop.tasks import charge, recalculate_totals

pytestmark = pytest.mark.django_db(transaction=True)

ADA = f"{recalculate_totals.name}:customer:ada"


def run(*args: str, **options: object) -> str:
    out = StringIO()
    call_command(*args, stdout=out, **options)
    return out.getvalue()


def test_list_shows_every_key_of_the_namespace(example_app: Celery) -> None:
    """unique_list prints one row per key: key, kind, scope, state, job, task, expiry."""
    ada = recalculate_totals.delay("ada").id
    order = charge.delay(order_id=1, amount_cents=5).id
    out = run("unique_list")
    assert out.splitlines()[0].split() == [
        "KEY",
        "KIND",
        "SCOPE",
        "STATE",
        "JOB",
        "TASK",
        "EXPIRES",
        "IN",
    ]
    assert ADA in out
    assert ada in out
    assert order in out
    only_windows = json.loads(run("unique_list", "--kind", "window", "--json"))
    assert [key["job_id"] for key in only_windows["keys"]] == [order]


def test_show_names_the_holder(example_app: Celery) -> None:
    """unique_show finds a key by its display form and tells who holds it."""
    job = recalculate_totals.delay("ada").id
    out = run("unique_show", ADA)
    assert job in out
    assert "queued" in out
    with pytest.raises(CommandError, match="no held key matches"):
        run("unique_show", f"{recalculate_totals.name}:customer:nobody")


def test_release_frees_the_key(example_app: Celery) -> None:
    """unique_release --no-input frees the key; a second release finds nothing."""
    recalculate_totals.delay("ada")
    assert "released active key" in run("unique_release", ADA, interactive=False)
    assert recalculate_totals.delay("ada").disposition is Disposition.CREATED
    run("unique_release", ADA, interactive=False)
    with pytest.raises(CommandError, match="no key matches"):
        run("unique_release", ADA, interactive=False)


def test_release_with_job_id_is_compare_and_delete(example_app: Celery) -> None:
    """--job-id of a job that does not hold the key releases nothing."""
    job = recalculate_totals.delay("ada").id
    with pytest.raises(CommandError, match="held by job not-that-one"):
        run("unique_release", ADA, "--job-id", "not-that-one", interactive=False)
    assert {held.job_id for held in runtime(example_app).store.scan()} == {job}


def test_reap_is_a_dry_run_until_applied(example_app: Celery) -> None:
    """unique_reap reports keys whose job has finished in the result backend; --apply frees them."""
    done = recalculate_totals.delay("ada").id
    running = recalculate_totals.delay("bob").id
    example_app.backend.mark_as_done(done, 0)
    dry = run("unique_reap")
    assert "1 orphaned of 2 held active keys" in dry
    assert done in dry
    assert "dry run" in dry
    assert {held.job_id for held in runtime(example_app).store.scan()} == {done, running}
    assert "released 1" in run("unique_reap", "--apply")
    assert {held.job_id for held in runtime(example_app).store.scan()} == {running}


def test_stats_counts_keys_and_reports_the_store(example_app: Celery) -> None:
    """unique_stats counts per kind and task, then what the Django store says of itself."""
    recalculate_totals.delay("ada")
    recalculate_totals.delay("bob")
    charge.delay(order_id=1, amount_cents=5)
    out = run("unique_stats")
    assert "namespace 'example': 3 keys" in out
    assert "active 2" in out
    assert "window 1" in out
    assert "expired rows awaiting sweep: 0" in out
    assert json.loads(run("unique_stats", "--json"))["kinds"] == {"active": 2, "window": 1}


def test_app_option_names_another_app() -> None:
    """--app picks the Celery app; one that cannot be imported is a command error."""
    with pytest.raises(CommandError, match="cannot be imported"):
        run("unique_stats", "--app", "no.such.module:app")
