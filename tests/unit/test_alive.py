"""The process running a job vouches for the run (celery_unique.worker.alive)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery import Celery

from celery_unique.config import runtime
from celery_unique.stores.base import ActiveClaim, Claim, Hold, RunStart, Scope
from celery_unique.worker import alive, runs

KEY = "unique:v1:{ns}:a:tasks.t\x1fk"


@pytest.mark.parametrize(
    ("lease_ms", "interval_s", "alive_ms"),
    [
        (3_600_000, 2.5, 10_000),  # the default lease: every 2.5 s, 10 s ahead
        (None, 2.5, 10_000),  # no lease
        (3_000, 1.0, 3_000),  # a short lease: a third of it, never past it
        (150, 0.1, 150),
    ],
)
def test_how_often_and_how_far_ahead_a_run_is_vouched_for(
    lease_ms: int | None, interval_s: float, alive_ms: int
) -> None:
    assert alive.interval_s(lease_ms) == interval_s
    assert alive.alive_ms(lease_ms) == alive_ms


def test_a_run_is_vouched_for_from_its_start_to_its_end(app: Celery) -> None:
    store = runtime(app).store
    store.decide(
        [Claim(job_id="j1", task="tasks.t", active=ActiveClaim(KEY, Scope.ACTIVE, 60_000))]
    )
    store.begin_run("j1", KEY, RunStart("r1", Scope.ACTIVE, "tasks.t", 60_000, alive_ms=1))
    voucher = alive.Voucher(app)  # not started: rounds are driven by hand
    with voucher.lock:
        voucher.runs["r1"] = Hold("j1", KEY, "r1")
    assert voucher.vouch_once(60_000) == 1
    copy = RunStart("r2", Scope.ACTIVE, "tasks.t", 60_000, alive_ms=10_000)
    begun = store.begin_run("j1", KEY, copy)
    assert begun.busy_ms is not None
    assert 9_000 < begun.busy_ms <= 10_000

    with voucher.lock:
        voucher.runs.clear()
    assert voucher.vouch_once(60_000) == 0  # nothing in progress: no store call at all


def test_a_run_that_ended_is_vouched_for_no_more(app: Celery) -> None:
    alive.started(app, Hold("j1", KEY, "r1"))
    alive.started(app, Hold("j2", KEY, "r2"))
    runs.body_ended(SimpleNamespace(**{runs.RUN_FIELD: "r1"}))  # as UniqueTask.__call__ does
    runs.body_ended(SimpleNamespace())  # a request with no run: nothing to end
    slots = [slot for slot, voucher in alive._vouchers.items() if voucher.app is app]
    assert len(slots) == 1  # one thread per process and app, whatever the runs
    voucher = alive._vouchers.pop(slots[0])
    voucher.stopped.set()
    assert list(voucher.runs) == ["r2"]
    alive.ended("r2")
