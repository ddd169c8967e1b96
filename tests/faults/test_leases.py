"""A live prefork worker keeps the keys of the jobs it has received alive.

Leases here are a few seconds long and jobs wait or run several leases: a key
that nothing renews is gone after one lease, and a dispatch then creates a
second job while the first still runs or waits on a live worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_unique import Disposition

from ._apps import JOB, Spec
from .conftest import OneKey, Worker, eventually, finished, one_key, starts

pytestmark = [pytest.mark.slow, pytest.mark.alone]

LEASE_S = 1.5


def hold_throughout(job: OneKey, job_id: str, until: Callable[[], bool]) -> None:
    """Until ``until()``: ``job_id`` holds the key, and past two leases a dispatch is REUSED."""
    began = time.monotonic()
    deadline = began + 20 * LEASE_S
    looks = reused = 0
    while not until():
        assert time.monotonic() < deadline, "timed out"
        holder = job.holder()
        if until():
            break  # the key may be released just now, as it should be
        assert holder == job_id, f"the key lapsed after {time.monotonic() - began:.1f}s"
        looks += 1
        if not reused and time.monotonic() - began > 2 * LEASE_S:
            again = job.dispatch()
            assert (again.disposition, again.id) == (Disposition.REUSED, job_id)
            reused += 1
        time.sleep(0.2)
    assert reused == 1, "the wait was shorter than two leases"
    assert looks > 0


def test_a_live_worker_renews_the_key_of_a_job_longer_than_its_lease(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """A job running four leases long holds its key throughout; a dispatch meanwhile is REUSED."""
    spec = make_spec(lease_s=LEASE_S)
    start_worker(spec)
    with one_key(spec, "long") as job:
        first = job.dispatch(hold_s=4 * LEASE_S)
        eventually(lambda: starts(marks, spec), what="the job to start")
        hold_throughout(job, first.id, lambda: first.id in finished(marks, spec))
        eventually(lambda: job.holder() is None, what="the key to be released")


def test_a_received_job_waiting_for_its_rate_limit_keeps_its_key(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """A job the worker received but holds back for its rate limit keeps its key till it runs."""
    # One token every 5 s (over three leases): the second job waits for it on the worker.
    spec = make_spec(lease_s=LEASE_S, settings={"task_annotations": {JOB: {"rate_limit": "12/m"}}})
    worker = start_worker(spec)
    with one_key(spec, "first") as first_job, one_key(spec, "waiting") as job:
        first = first_job.dispatch()
        waiting = job.dispatch()
        eventually(lambda: first.id in finished(marks, spec), what="the first job to run")
        eventually(lambda: f"[{waiting.id}] received" in worker.log(), what="the second job")

        hold_throughout(job, waiting.id, lambda: waiting.id in finished(marks, spec))
    assert [job_id for job_id, _, _, _ in starts(marks, spec)] == [first.id, waiting.id]
