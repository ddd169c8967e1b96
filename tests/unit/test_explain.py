"""explain(): the keys, digests and verdict a dispatch would get, with nothing written."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from celery import Celery

from celery_unique import (
    InvalidKey,
    KeyMismatch,
    Payload,
    UniqueTask,
    UnsupportedCombination,
)
from celery_unique.config import runtime
from celery_unique.explain import explain, explain_dispatch
from celery_unique.keys import keyspace
from celery_unique.stores.base import KeyKind, Scope, Verdict


def snapshot(app: Celery) -> list[Any]:
    """Everything the store holds, to prove explain wrote nothing.

    The remaining lifetime counts down between two reads, so it is left out
    here; `assert_not_extended` checks it separately.
    """
    return [dataclasses.replace(held, expires_in_ms=None) for held in runtime(app).store.scan()]


def remaining_ms(app: Celery) -> list[int | None]:
    return [held.expires_in_ms for held in runtime(app).store.scan()]


def assert_not_extended(before: list[int | None], after: list[int | None]) -> None:
    """A read that renewed a key would push its remaining lifetime back up."""
    assert len(before) == len(after)
    for earlier, later in zip(before, after, strict=True):
        assert earlier is not None
        assert later is not None
        assert later <= earlier


@pytest.fixture
def report(app: Celery) -> Any:
    @app.task(
        shared=False,
        base=UniqueTask,
        name="ex.report",
        unique_key=lambda job: f"tenant:{job.tenant}",
        unique_while="active",
    )
    def report(tenant: int, detail: str = "full") -> None:
        return None

    return report


@pytest.fixture
def charge(app: Celery) -> Any:
    @app.task(
        shared=False,
        base=UniqueTask,
        name="ex.charge",
        unique_window_key=Payload(only=[".request_id"]),
        unique_window=3600,
    )
    def charge(request_id: str, amount: int) -> None:
        return None

    return charge


def test_free_key_would_create_and_nothing_is_written(
    app: Celery, report: Any, published: list[Any]
) -> None:
    """With the key free the verdict is 'would create'; the store and broker are untouched."""
    explanation = explain(report, 7)
    assert explanation.verdict == "would create"
    assert explanation.would_create
    assert (explanation.outcome, explanation.job_id, explanation.window) == (
        Verdict.CREATED,
        None,
        None,
    )
    active = explanation.active
    assert active is not None
    assert (active.kind, active.display_key, active.scope, active.holder) == (
        KeyKind.ACTIVE,
        "ex.report:tenant:7",
        Scope.ACTIVE,
        None,
    )
    assert active.storage_key == keyspace.storage_key(
        runtime(app).namespace, keyspace.ACTIVE, "ex.report", "tenant:7"
    )
    assert active.lease_ms == runtime(app).lease_ms
    assert snapshot(app) == []
    assert published == []


def test_held_key_would_reuse_its_job(app: Celery, report: Any, published: list[Any]) -> None:
    """While the key is held, explain names the job the dispatch would hand back."""
    first = report.delay(7)
    before, lifetimes = snapshot(app), remaining_ms(app)
    explanation = explain(report, tenant=7, detail="short")
    assert explanation.verdict == f"would reuse job {first.id} (active)"
    assert not explanation.would_create
    assert explanation.active is not None
    holder = explanation.active.holder
    assert holder is not None
    assert (holder.job_id, holder.finished, holder.expires_in_ms is not None) == (
        first.id,
        False,
        True,
    )
    assert snapshot(app) == before
    assert_not_extended(lifetimes, remaining_ms(app))
    assert len(published) == 1
    assert report.delay(7).id == first.id


def test_window_same_request_reuses_and_different_request_conflicts(
    app: Celery, charge: Any
) -> None:
    """A remembered window key reuses the same request and names the job another one hits."""
    first = charge.delay("R1", 10)
    same = explain(charge, "R1", 10)
    assert same.verdict == f"would reuse job {first.id} (window)"
    assert same.window is not None
    assert (same.window.same_request, same.window.same_policy) == (True, True)
    assert same.window.fingerprint == same.window.holder.fingerprint  # type: ignore[union-attr]

    other = explain(charge, "R1", 11)
    assert other.verdict == f"would conflict with job {first.id}"
    assert other.outcome is Verdict.CONFLICT
    assert other.window is not None
    assert other.window.same_request is False
    assert "a DIFFERENT request" in str(other)


def test_window_policy_drift_is_reported(app: Celery, charge: Any) -> None:
    """The same request with other retry settings reuses with policy drift."""
    first = charge.delay("R1", 10)
    drift = explain_dispatch(charge, ("R1", 10), max_retries=9)
    assert drift.verdict == f"would reuse job {first.id} (window, with policy drift)"
    assert drift.policy_drift
    assert drift.window is not None
    assert (drift.window.same_request, drift.window.same_policy) == (True, False)


def test_routing_options_count_like_they_do_for_apply_async(app: Celery, charge: Any) -> None:
    """explain_dispatch takes apply_async's options: another queue is another request."""
    charge.apply_async(("R1", 10), queue="fast")
    assert explain_dispatch(charge, ("R1", 10), queue="fast").outcome is Verdict.REUSED_WINDOW
    assert explain_dispatch(charge, ("R1", 10), queue="slow").outcome is Verdict.CONFLICT
    assert explain_dispatch(charge, ("R1", 10), countdown=5).outcome is Verdict.CONFLICT


def test_composition_conflict_is_explained(app: Celery) -> None:
    """A window key and an active key held by two jobs give a composition verdict naming both."""

    @app.task(
        shared=False,
        base=UniqueTask,
        name="ex.both",
        unique_key=lambda job: f"order:{job.order}",
        unique_while="active",
        unique_window_key=lambda job: job.request,
        unique_window=600,
    )
    def both(order: int, request: str) -> None:
        return None

    window_job = both.delay(2, "R1")
    # The first job finishes (its active key is released); another takes the active key.
    active_key = keyspace.storage_key(runtime(app).namespace, keyspace.ACTIVE, "ex.both", "order:2")
    assert runtime(app).store.release(window_job.id, active_key)
    active_job = both.delay(2, "R9")
    explanation = explain(both, 2, "R1")
    assert explanation.outcome is Verdict.COMPOSITION_CONFLICT
    assert explanation.conflicting_job_ids == (window_job.id, active_job.id)
    assert explanation.verdict == (
        f"would be a composition conflict (window key -> job {window_job.id}, "
        f"active key -> job {active_job.id})"
    )


def test_keys_given_per_dispatch_are_explained(app: Celery) -> None:
    """A task without declared keys explains the keys a dispatch passes, and none without them."""

    @app.task(shared=False, base=UniqueTask, name="ex.plain")
    def plain(x: int) -> None:
        return None

    assert explain(plain, 1).verdict == "would create (no uniqueness keys)"
    assert explain(plain, 1).outcome is None
    held = plain.apply_async((1,), unique_key="nightly", unique_while="exists")
    explanation = explain_dispatch(plain, (1,), unique_key="nightly")
    assert explanation.verdict == f"would reuse job {held.id} (active)"
    assert explanation.active is not None
    assert explanation.active.scope is Scope.QUEUED
    assert explanation.active.holder is not None
    assert explanation.active.holder.scope is Scope.EXISTS


def test_preset_task_id_already_holding_names_that_job(app: Celery, report: Any) -> None:
    """A preset task id whose key already points at it is reported as that job, not a new one."""
    first = report.delay(7)
    explanation = explain_dispatch(report, (7,), task_id=first.id)
    assert explanation.verdict == f"would reuse job {first.id} (active)"
    assert explanation.job_id == first.id


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda task: explain(task, "x", "y", "z"), TypeError),
        (lambda task: explain_dispatch(task, (1,), unique_key="a\nb"), InvalidKey),
        (lambda task: explain_dispatch(task, (1,), unique_key="other"), KeyMismatch),
        (lambda task: explain_dispatch(task, (1,), chord=object()), UnsupportedCombination),
    ],
)
def test_bad_input_raises_what_the_dispatch_would(
    app: Celery, report: Any, call: Any, error: type[Exception]
) -> None:
    """Arguments that do not bind, bad keys, mismatched keys: the dispatch's own errors."""
    with pytest.raises(error):
        call(report)
    assert snapshot(app) == []


def test_a_plain_task_cannot_be_explained(app: Celery) -> None:
    """Only a UniqueTask has uniqueness to explain."""

    @app.task(shared=False, name="ex.not_unique")
    def not_unique() -> None:
        return None

    with pytest.raises(TypeError, match="not a UniqueTask"):
        explain(not_unique)


def test_verdict_matches_the_dispatch_that_follows(app: Celery, charge: Any, report: Any) -> None:
    """For a run of dispatches, each explanation predicts the real dispatch's job and receipt."""
    calls = [
        (report, (1,)),
        (report, (1,)),
        (report, (2,)),
        (charge, ("R1", 5)),
        (charge, ("R1", 5)),
        (charge, ("R2", 5)),
    ]
    for task, args in calls:
        explanation = explain(task, *args)
        result = task.delay(*args)
        assert result.duplicate is (not explanation.would_create)
        if not explanation.would_create:
            assert result.id == explanation.job_id


def test_text_form_names_keys_holder_and_storage_key(app: Celery, report: Any) -> None:
    """str() shows the verdict, each key, its escaped storage key and who holds it."""
    first = report.delay(3)
    text = str(explain(report, 3))
    lines = text.splitlines()
    assert lines[0] == "task:    ex.report"
    assert lines[1] == f"verdict: would reuse job {first.id} (active)"
    assert lines[2] == "active key:  ex.report:tenant:3  (while active, lease 1h)"
    assert lines[3] == f"  storage key: unique:v1:{{{app.main}}}:a:ex.report\\x1ftenant:3"
    assert lines[4].startswith(f"  held by:     job {first.id} (ex.report), held, expires in ")


def test_as_dict_is_plain_json(app: Celery, charge: Any) -> None:
    """as_dict() holds only JSON values, holder included."""
    import json

    charge.delay("R1", 10)
    data = explain(charge, "R1", 10).as_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["outcome"] == "reused_window"
    assert data["window"]["holder"]["kind"] == "window"
    assert data["window"]["same_request"] is True
